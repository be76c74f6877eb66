"""OpenAI request schemas (validated at the HTTP edge) and the OpenAI error body.

Every request model forbids unknown fields and coerces nothing ("1" is not 1), so a
malformed request is a 400 naming the field, never a 5xx from deeper down.
vLLM extensions accepted: `ignore_eos`, `min_tokens`, `top_k`, `min_p`, `repetition_penalty`,
`stop_token_ids`, `return_token_ids`, and for chat `chat_template_kwargs` (e.g. V4's
`{"thinking": true}`); DeepSeek's `thinking: {"type": "enabled"|"disabled"}` and
`reasoning_effort`. A field this server does not implement (`suffix`, ...) is a 400
naming it, never silently ignored.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvmesh.workers.sampling.params import check_schema
from kvmesh.workers.sampling.params import MAX_N, InvalidRequestError, SamplingParams

from kvmesh.cluster.errors import APIError, bad_request

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20
MAX_PROMPTS = 64
# Every request model: unknown fields and loose types refused; NaN and ±Infinity (JSON extensions
# Python's parser takes) are refused as "a finite number", not by a bound they do not break.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(**STRICT, populate_by_name=True)
    name: str = "schema"
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _Request(BaseModel):
    model_config = STRICT

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
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias for token {key} must be in [-100, 100], got {bias}")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("only allowed when stream is true", "stream_options")
        if self.response_format is not None and self.response_format.type == "json_schema" \
                and self.response_format.json_schema is None:
            raise InvalidRequestError("required when type is json_schema", "response_format.json_schema")
        return self

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

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)

    @property
    def guide(self) -> tuple[str, str] | None:
        f = self.response_format
        if f is None or f.type == "text":
            return None
        if f.type == "json_object":
            return ("json_object", "")
        from kvmesh.cluster.chat.json_schema import check
        try:
            return ("json_schema", check_schema(check(f.json_schema.schema_, "response_format.json_schema.schema")))
        except InvalidRequestError as e:
            raise bad_request(str(e), e.field or "response_format") from None

    @property
    def num_sequences(self) -> int:
        """Sequences generated per prompt (best_of of them when set, else n)."""
        return getattr(self, "best_of", None) or self.n

    @property
    def top_n(self) -> int:
        return 0

    def sampling_params(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        bias = tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs,
                              top_logprobs=self.top_n, n=self.num_sequences,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, min_p=self.min_p, logit_bias=bias,
                              guide=self.guide)


_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(_Request):
    prompt: _Text | _Ids | Annotated[list[_Text], Field(min_length=1, max_length=MAX_PROMPTS)] \
        | Annotated[list[_Ids], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None:
            if self.best_of < self.n:
                raise InvalidRequestError(f"must be >= n ({self.n}), got {self.best_of}", "best_of")
            if self.stream and self.best_of > self.n:
                raise InvalidRequestError("not supported with stream", "best_of")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one string, one token list, or a batch of either."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)

    @property
    def top_n(self) -> int:
        return self.logprobs or 0


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


FUNCTION_NAME = r"^[A-Za-z0-9_.\-]+$"
THINKING_KWARGS = ("thinking", "enable_thinking")      # the template switches; a real bool only


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def json_object_text(text: str | None) -> str | None:
    """`text` if it is empty or the JSON text of an object (a call's arguments); else ValueError."""
    if text is None or not text.strip():
        return text
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("must be JSON text nested less deeply") from None
    except ValueError:
        raise ValueError("must be JSON text") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be the JSON text of an object, got {text.strip()[:20]}")
    return text


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME)
    arguments: str | None = None          # JSON text of an object, as OpenAI sends it back

    @field_validator("arguments")
    @classmethod
    def _object(cls, v):
        return json_object_text(v)


class ToolCall(BaseModel):
    model_config = STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None          # DeepSeek's / SGLang's name
    reasoning: str | None = None                  # vLLM's
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def as_dict(self) -> dict:
        """The message as DeepSeek-V4's encoder reads it (cluster/chat/dsv4_encode.py)."""
        out = {"role": self.role, "content": self.text, "reasoning": self.reasoning or self.reasoning_content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionSpec(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class ThinkingSwitch(BaseModel):
    model_config = STRICT
    type: Literal["enabled", "disabled"]


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None     # type: ignore[valid-type]
    thinking: ThinkingSwitch | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, v):
        reserved = sorted(set(v or {}) & {"messages", "add_generation_prompt"})
        if reserved:
            raise ValueError(f"{reserved} cannot be set through chat_template_kwargs")
        for key in THINKING_KWARGS:
            if key in (v or {}) and not isinstance(v[key], bool):
                raise InvalidRequestError(f"must be true or false, got {json.dumps(v[key])}",
                                          f"chat_template_kwargs.{key}")
        return v

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("requires logprobs to be true", "top_logprobs")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise InvalidRequestError("tool names must be unique", "tools")
        if self.tool_choice not in (None, "auto", "none") and not names:
            raise InvalidRequestError("needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise InvalidRequestError(f"names {self.tool_choice.function.name!r}, which is not among the tools",
                                      "tool_choice")
        return self

    @property
    def thinking_mode(self) -> str:
        """V4's mode: thinking unless a switch turns it off (V4 thinks by default, as DeepSeek's API does)."""
        kwargs = self.chat_template_kwargs or {}
        off = [kwargs.get(k) is False for k in THINKING_KWARGS]
        off += [self.thinking is not None and self.thinking.type == "disabled", self.reasoning_effort == "none"]
        return "chat" if any(off) else "thinking"

    @property
    def effort(self) -> str | None:
        """V4's reasoning effort: "max" (its prefix) for max / xhigh, else none."""
        return "max" if self.reasoning_effort in ("max", "xhigh") else None

    @property
    def guide(self) -> tuple[str, str] | None:
        """`tool_choice` "required" or a named function constrain the reply to a DSML block of
        valid calls (cluster/chat/dsv4_grammar.py); else response_format's guide."""
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if not forced:
            return super().guide
        if self.response_format is not None and self.response_format.type != "text":
            raise bad_request("cannot be combined with tool_choice required or a named function", "response_format")
        from kvmesh.cluster.chat.dsv4_grammar import tool_call_grammar
        name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        try:
            return ("ebnf", tool_call_grammar(self.offered_tools, self.thinking_mode, self.parallel_tool_calls, name))
        except InvalidRequestError as e:      # a schema the grammar cannot enforce exactly, or never satisfied
            raise bad_request(str(e), e.field) from None
        except Exception as e:        # a parameter schema xgrammar cannot turn into a grammar
            raise bad_request(f"tools: a parameter schema cannot be compiled: {grammar_error(e)}", "tools") from None

    @property
    def offered_tools(self) -> list[dict]:
        """The tools rendered into the prompt (none with tool_choice "none")."""
        if self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_n(self) -> int:
        return self.top_logprobs or 0 if self.logprobs else 0


def grammar_error(e: Exception) -> str:
    """xgrammar's reason for refusing a schema, without the time and C++ source line it starts
    with ("[12:17:11] /project/cpp/json_schema_converter.cc:5082: Type should be a string"):
    the client needs the reason, not where in xgrammar it was found."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered as the chat request would render
    them (the same chat fields)."""
    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None     # type: ignore[valid-type]
    thinking: ThinkingSwitch | None = None

    def as_chat(self) -> ChatCompletionRequest:
        fields = ("messages", "add_generation_prompt", "chat_template_kwargs", "tools", "tool_choice",
                  "reasoning_effort", "thinking")
        try:
            return ChatCompletionRequest.model_validate({k: getattr(self, k) for k in fields}, strict=False)
        except ValidationError as e:          # a check across chat fields (tool_choice needs tools, ...)
            err = e.errors()[0]
            msg, cause = err["msg"].removeprefix("Value error, "), (err.get("ctx") or {}).get("error")
            if isinstance(cause, InvalidRequestError):      # its message starts with its field
                raise bad_request(msg, cause.field) from None
            field = ".".join(str(p) for p in err["loc"]) or None     # pydantic's words name no field
            raise bad_request(f"{field}: {msg}" if field else msg, field) from None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
        return self


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvmesh")
    except PackageNotFoundError:
        return "0.0.0+local"


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """JSON bytes -> request model; every failure is a 400 naming the offending field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"the request body is not valid JSON: {err['msg']}") from None
        param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or None
        if param and param.split(".")[0] == "prompt" and err["type"] != "missing":
            batch = next((x["ctx"]["actual_length"] for x in errors
                          if x["type"] == "too_long" and x["loc"][0] == "prompt"), None)
            if batch is not None:       # a list of prompts, each well formed or not, is too long
                raise bad_request(f"prompt: a batch holds at most {MAX_PROMPTS} prompts, got {batch}",
                                  "prompt") from None
            raise bad_request("prompt: must be a non-empty string or a non-empty list of integer token ids",
                              "prompt") from None
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown field `{param}`", param) from None
        if err["type"] == "missing":
            raise bad_request(f"missing required field `{param}`", param) from None
        msg = err["msg"].removeprefix("Value error, ")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequestError) and (cause.field or not param):   # the check names its field
            raise bad_request(msg, cause.field) from None
        raise bad_request(f"{param}: {msg}" if param else msg, param) from None


def _is_union_tag(p) -> bool:
    # pydantic names union members in the error location ("str", "list[int]", "constrained-str")
    return isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p
                                   or p.startswith(("constrained-", "function-")))
