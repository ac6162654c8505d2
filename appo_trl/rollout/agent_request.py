"""The agent endpoint's request body, checked before anything is rendered or sampled (pydantic).

`parse_request(body)` returns the validated `ChatRequest` or raises `RequestError` with one line naming the field
(`messages.2.tool_calls.0.function.name: Field required`). It decides which OpenAI chat-completions fields are:

- **served**: `messages` (text content: a string or text parts), `tools`, `tool_choice`, `stream`, `stream_options`,
  `max_tokens`, `max_completion_tokens`, `stop`, `logprobs`, `model`;
- **the trainer's**: `temperature`, `top_p`, `top_k`, `presence_penalty`, `frequency_penalty`, `seed`: a request's
  values are not used (every rollout samples with the trainer's settings); the endpoint warns once per run;
- **refused** (HTTP 400 naming the field): `n` other than 1, `response_format` other than text (JSON mode or a
  schema would constrain decoding, and a row must be what the policy sampled: ask for JSON in the prompt),
  `logit_bias`, `top_logprobs`, image or audio content, `functions` / `function_call` (the legacy form of `tools`),
  `audio`, `modalities` other than text, `prediction`;
- **refused anywhere in the body**: nesting deeper than `MAX_DEPTH` (tool arguments given as a JSON string too) and
  text that is not Unicode a tokenizer takes (a lone surrogate such as `"\\ud800"`): a 400 naming where;
- **ignored quietly**: bookkeeping that does not change the answer (`user`, `metadata`, `store`, `service_tier`,
  `prompt_cache_key`, `safety_identifier`, `parallel_tool_calls`); any other field is ignored with one warning per
  run (`ChatRequest.unknown`).

What it does not do: judge the conversation (extension or restart: `agent_session`), or answer (`agent_endpoint`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from appo_trl.rollout.text import MAX_DEPTH, body_problem

_QUIET = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "parallel_tool_calls"}
_REFUSED = {
    "functions": "the legacy `functions` form is not served; pass `tools`",
    "function_call": "the legacy `function_call` form is not served; pass `tool_choice`",
    "audio": "audio output is not served",
    "prediction": "predicted outputs are not served",
}


class RequestError(ValueError):
    """A request body the endpoint cannot serve; the message names the field (HTTP 400)."""


def loads(raw: bytes | str) -> Any:
    """The request body as JSON; `RequestError` when it is not JSON or nests past what the parser takes."""
    import json

    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError(f"body: nested over {MAX_DEPTH} levels deep, more than is taken") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise RequestError(f"the request body is not JSON ({str(exc).splitlines()[0][:120]})") from None
    problem = body_problem(body)
    if problem is not None:
        raise RequestError(problem)
    return body


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ToolCallFunction(_Open):
    name: str
    arguments: Any = ""

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (str, dict)):
            raise ValueError("must be a JSON string or an object")
        if isinstance(v, str) and v.strip()[:1] in ("{", "["):  # parsed later (rendering, comparing turns): check it
            import json

            try:
                parsed = json.loads(v)
            except RecursionError:
                raise ValueError(f"nested over {MAX_DEPTH} levels deep, more than is taken") from None
            except ValueError:
                return v  # not JSON: kept as the text it is
            problem = body_problem(parsed)
            if problem is not None:
                raise ValueError(f"the JSON text's {problem}")
        return v


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list) or not all(isinstance(p, dict) for p in v):
            raise ValueError("must be a string, null or a list of content parts")
        for p in v:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError(f"only text parts are served (got a part of type {p.get('type')!r})")
        return v


class FunctionSpec(_Open):
    name: str


class Tool(_Open):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(_Open):
    include_usage: bool = False


class ChatRequest(_Open):
    """A `POST /v1/chat/completions` body (see the module head for what each field gets)."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    response_format: dict | None = None
    logit_bias: dict | None = None
    modalities: list[str] | None = None

    @field_validator("max_tokens", "max_completion_tokens", "n", "top_k", "seed", mode="before")
    @classmethod
    def _not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # pydantic would read `true` as 1
            raise ValueError(f"must be an integer, not {str(v).lower()}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("an empty stop string would match everywhere: leave it out")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"n={v} is not served: each request is one turn of one trajectory (n=1)")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type") != "text":
            raise ValueError(
                f"{v.get('type')!r} is not served: JSON mode or a schema constrains decoding, and a training row "
                "must be what the policy sampled (ask for JSON in the prompt)"
            )
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("is not served: a bias changes what the policy samples")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("is not served (`logprobs: true` returns each sampled token's logprob)")
        return v

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, v: list[str] | None) -> list[str] | None:
        if v and v != ["text"]:
            raise ValueError("only text is served")
        return v

    @property
    def unknown(self) -> list[str]:
        """Fields this endpoint does not know and ignores (warned once per run)."""
        return sorted(k for k in self.model_extra or () if k not in _QUIET)


def parse_request(body: Any) -> ChatRequest:
    """`body` (parsed JSON) as a `ChatRequest`, or `RequestError` naming the first bad field."""
    if isinstance(body, dict):
        for key, why in _REFUSED.items():
            if body.get(key) is not None:
                raise RequestError(f"{key}: {why}")
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise RequestError(f"{where}: {msg}{more}") from None


__all__ = ["MAX_DEPTH", "ChatRequest", "RequestError", "body_problem", "loads", "parse_request"]
