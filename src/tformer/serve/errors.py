"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, for every failure."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import TformerError
from .served import InputError

RETRY_AFTER = "1"           # seconds a client should wait after 429 / 503


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(InputError)
    async def input_error(request, e: InputError):
        return error_response(400, str(e), param=e.param, code="invalid_value")

    @app.exception_handler(TformerError)
    async def tformer_error(request, e: TformerError):
        return error_response(400, str(e), code="invalid_value")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid" or not where and first.get("type") == "model_attributes_type":
            return error_response(400, f"the body is not a valid JSON object: {first.get('msg', '')}",
                                  code="invalid_json")
        param = where[0] if where else None      # the field (a union's member names follow it)
        return error_response(422, f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid value')}", param=param,
                              code="invalid_type")

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error_response(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None,
                              headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        return error_response(500, f"internal error {type(e).__name__}: {e}", "server_error")
