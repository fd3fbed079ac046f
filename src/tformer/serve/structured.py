"""Structured outputs, the request's side: which grammar a request asks for (response_format, or a
tool call that tool_choice requires) and how a tool call is read back from the text.

    response_format {"type": "json_object"}                   any JSON object
    response_format {"type": "json_schema", "json_schema": {"schema": S}}     S
    tool_choice "required"                                    {"name": one of the tools, "arguments": its parameters}
    tool_choice {"type": "function", "function": {"name": F}}  {"name": F, "arguments": F's parameters}
    tool_choice "auto"        no grammar; where the chat template mentions tools, an answer that is one
                              JSON object {"name": a tool, "arguments" (or "parameters"): {...}} is a call
    tool_choice "none"        no grammar, no call (also "auto" with a template that never mentions tools)

A call comes back as OpenAI's tool_calls: [{id, type "function", function: {name, arguments (a JSON
string)}}], content null, finish_reason "tool_calls"."""

from __future__ import annotations

import asyncio
import json
import uuid

from .errors import ApiError
from .schemas import ChatRequest, ResponseFormat, Tool

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}   # a function without parameters


class Tools:
    """The tools a chat request offers and what tool_choice makes of them."""

    def __init__(self, body: ChatRequest, template_source: str | None):
        self.tools: list[Tool] = body.tools or []
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if self.tools else "none")
        names = [t.function.name for t in self.tools]
        if choice != "none" and not self.tools:
            raise ApiError(400, f"tool_choice {describe(choice)} needs tools, and the request gives none",
                           param="tool_choice", code="invalid_value")
        if len(set(names)) != len(names):
            raise ApiError(400, f"tools name a function twice ({', '.join(names)})", param="tools",
                           code="invalid_value")
        if not isinstance(choice, str):
            if choice.function.name not in names:
                raise ApiError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                                    f"the tools ({', '.join(names)})", param="tool_choice", code="invalid_value")
            self.offered = [t for t in self.tools if t.function.name == choice.function.name]
            choice = "named"
        else:
            self.offered = self.tools
        if choice == "auto" and "tools" not in (template_source or ""):
            choice = "none"          # the model was never taught tools: its answer is plain text
        self.choice = choice
        self.forced = choice in ("required", "named")

    @property
    def for_template(self) -> list[dict] | None:
        """The tools as chat templates read them (OpenAI's own shape), unless no call can be made."""
        return None if self.choice == "none" else [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    def schema(self) -> dict:
        """The grammar of a forced call: {"name": a tool offered, "arguments": that tool's parameters}."""
        calls = [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": t.function.parameters if t.function.parameters is not None else NO_ARGUMENTS},
            "required": ["name", "arguments"], "additionalProperties": False} for t in self.offered]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def may_be_call(self, text: str) -> bool:
        """While streaming: could this start of an answer still become a call (then it is held back)?"""
        return self.forced or not text.lstrip() or text.lstrip().startswith("{")

    def calls(self, text: str) -> list[dict] | None:
        """OpenAI's tool_calls for an answer that is a call to one of the tools, else None."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in {t.function.name for t in self.offered}:
            return None
        arguments = value.get("arguments", value.get("parameters"))    # Llama 3.1's templates say "parameters"
        if not isinstance(arguments, dict):
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}]


def describe(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


def wanted_schema(response_format: ResponseFormat | None) -> tuple[bool, dict | None]:
    """(constrained, schema): whether response_format asks for JSON, and its schema (None: any JSON object)."""
    if response_format is None or response_format.type == "text":
        return False, None
    if response_format.type == "json_object" or response_format.json_schema is None:
        return True, None
    return True, response_format.json_schema.schema_


async def compile_grammar(grammars, schema: dict | None, param: str = "response_format"):
    """The compiled grammar of `schema` (None: any JSON object), on a worker thread: compiling takes
    milliseconds, which the event loop should not wait for."""
    return await asyncio.get_running_loop().run_in_executor(None, grammars.compile, schema, param)
