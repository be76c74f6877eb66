"""OpenAI request schemas (validated at the HTTP edge) and the OpenAI error body.

Every request model forbids unknown fields and coerces nothing ("1" is not 1), so a
malformed request is a 400 naming the field, never a 5xx from deeper down.
vLLM extensions accepted: `ignore_eos`, `min_tokens`, `top_k`, `stop_token_ids`,
`return_token_ids`, and for chat `chat_template_kwargs` (e.g. V4's `{"thinking": true}`).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from workers.sampling import SamplingParams

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error the API reports with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist; this server serves `{served}`.",
                    param="model", code="model_not_found")


def overloaded(retry_after_s: int) -> APIError:
    return APIError(503, "The server is overloaded; retry shortly.", type="overloaded_error",
                    code="overloaded", headers={"Retry-After": str(retry_after_s)})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs)


class CompletionRequest(_Request):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="not supported: must be false")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, v):
        reserved = sorted(set(v or {}) & {"messages", "add_generation_prompt"})
        if reserved:
            raise ValueError(f"{reserved} cannot be set through chat_template_kwargs")
        return v

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """JSON bytes -> request model; every failure is a 400 naming the offending field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"the request body is not valid JSON: {err['msg']}") from None
        param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or None
        if param and param.split(".")[0] == "prompt" and err["type"] != "missing":
            raise bad_request("prompt: must be a non-empty string or a non-empty list of integer token ids",
                              "prompt") from None
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown field `{param}`", param) from None
        if err["type"] == "missing":
            raise bad_request(f"missing required field `{param}`", param) from None
        raise bad_request(f"{param}: {err['msg']}" if param else err["msg"], param) from None


def _is_union_tag(p) -> bool:
    # pydantic names union members in the error location ("str", "list[int]", "constrained-str")
    return isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p or p.startswith(("constrained", "function")))


def error_json(err: APIError) -> str:
    return json.dumps(err.body())
