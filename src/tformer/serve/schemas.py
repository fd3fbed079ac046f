"""Request bodies, as OpenAI's (the official `openai` client sends these), plus tformer's own
sampling fields. Pydantic checks the types and ranges; a violation answers 400 (malformed JSON) or
422 (a wrong type or value) in OpenAI's error shape (app.py)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..generation.settings import OPENAI_DEFAULTS as OPENAI  # OpenAI's defaults, stated once there
from .served import InputError

MAX_N = 16                  # choices per prompt
MAX_INPUTS = 256            # prompts, texts or messages per request
MAX_STOPS = 4               # stop strings (OpenAI's limit)
MAX_BIAS = 300              # logit_bias entries (OpenAI's limit)
MAX_TOOLS = 128             # functions per request (OpenAI's limit)

Stop = Union[str, list[str], None]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")   # clients send fields we do not use (user, metadata...)


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchema(Body):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="the JSON schema (none: any JSON object)")
    strict: bool | None = None      # the answer follows the schema either way (a grammar constrains it)


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class Sampled(Body):
    """Fields shared by completions and chat completions."""
    model: str | None = Field(None, description="the served model's name or one of its adapters' (none: the model)")
    temperature: float = Field(OPENAI.temperature, ge=0, le=2,
                               description="0: greedy (the most likely token each step)")
    top_p: float = Field(OPENAI.top_p, gt=0, le=1)
    n: int = Field(OPENAI.num_return_sequences, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = Field(None, description="stop when the text contains one of these (not returned)")
    seed: int | None = Field(None, ge=0, lt=2**63, description="the same seed gives the same text")
    top_k: int | None = Field(OPENAI.top_k, ge=0,
                              description="tformer: sample among the k most likely tokens (0/None: off)")
    min_p: float | None = Field(OPENAI.min_p, ge=0, le=1,
                                description="tformer: drop tokens below min_p x the top probability")
    repetition_penalty: float = Field(OPENAI.repetition_penalty, gt=0, le=10,
                                      description="tformer: >1 makes tokens already seen less likely")
    frequency_penalty: float = Field(0.0, ge=-2, le=2,
                                     description="minus this x the times a token was generated, from its logit")
    presence_penalty: float = Field(0.0, ge=-2, le=2,
                                    description="minus this from the logit of every token generated so far")
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_BIAS,
                                                description='{"token id": bias in -100..100} added to the logits')
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name", "schema", "strict"}}: the answer is constrained by a grammar')
    return_tokens_as_token_ids: bool = Field(
        False, description='vLLM\'s: with logprobs, each token and top_logprobs key as "token_id:{id}" (a special '
                           'token, or part of a character, has no text of its own)')

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        """logit_bias with its keys read as token ids of a vocabulary of vocab_size; a key that is
        not one answers 400 naming it."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.strip().isascii() and key.strip().isdigit()) or int(key) >= vocab_size:
                raise InputError(f"logit_bias: {key!r} is not a token id of this model (its vocabulary has ids "
                                 f"0 to {vocab_size - 1})", "logit_bias")
            if not -100 <= value <= 100:
                raise InputError(f"logit_bias: the bias of token {key} is {value}; it must be in -100..100",
                                 "logit_bias")
            bias[int(key)] = value
        return bias


class CompletionRequest(Sampled):
    prompt: Union[str, list[str]] = Field(..., description="text to continue (an encoder-decoder: the source text)")
    max_tokens: int = Field(OPENAI.max_new_tokens, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20, description="report the top-N tokens and their log-probabilities")


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None        # an assistant's earlier calls, for the chat template
    tool_call_id: str | None = None             # a tool's answer: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it: role, content (text) and the tool fields given."""
        extra = {k: v for k, v in (("name", self.name), ("tool_calls", self.tool_calls),
                                   ("tool_call_id", self.tool_call_id)) if v is not None}
        return {"role": self.role, "content": self.text(), **extra}


class Function(Body):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments (none: no arguments)")
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: Function


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(Sampled):
    messages: list[Message] = Field(..., min_length=1, max_length=MAX_INPUTS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="functions the model may call")
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description='"none", "auto" (default with tools), "required" or {"type": "function", "function": '
                          '{"name": ...}}: required and named calls are constrained by a grammar')
    parallel_tool_calls: bool | None = None     # accepted; a choice makes at most one call
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class EmbeddingRequest(Body):
    model: str
    input: Union[str, list[str]]
    encoding_format: Literal["float", "base64"] = "float"


class ClassifyRequest(Body):
    model: str
    input: Union[str, list[str]]
