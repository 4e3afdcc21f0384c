"""The OpenAI request bodies the server accepts, and its error shape.

Bodies are parsed strictly (pydantic strict mode on the raw JSON): a wrong
type is a 400 naming the parameter, never coerced; unknown parameters are
refused as OpenAI refuses them. Extensions beyond OpenAI's fields follow
vLLM's names: top_k, ignore_eos, stop_token_ids, return_token_ids, and
return_prompt (the chat prompt as rendered, with what was dropped / re-injected).
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_N = 16              # choices per prompt
MAX_STOP = 4            # stop strings, as OpenAI
MAX_LOGPROBS = 20       # top logprobs, as OpenAI's chat API


class APIError(Exception):
    """An error the client caused or must hear about, in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    model: str | None = None            # None: the served model
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0)     # accepted at 0 only: not implemented
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0)
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Literal[False] = False
    best_of: int | None = None
    suffix: None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    return_prompt: bool = False


def parse(model: type[BaseModel], body: bytes):
    """The body as `model`, or APIError 400 naming the first bad parameter."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    if err["type"] == "model_type":
        return APIError(400, "the body must be a JSON object", code="invalid_json")
    # loc holds the path, with pydantic's union-member tags ('str', 'list[int]') in between
    path = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))]
    param = ".".join(path) if path else None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    if err["type"] == "missing":
        return APIError(400, f"{param} is a required parameter", param=param, code="missing_required_parameter")
    return APIError(400, f"{param}: {err['msg']} (got {_short(err.get('input'))})", param=param,
                    code="invalid_parameter")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
