"""The request bodies the server accepts: OpenAI's completion and chat fields that it implements, parameters that
only have a neutral value here (``logit_bias``, ``best_of``, ``suffix``), vLLM's sampling extras, vLLM's
``/tokenize`` and ``/detokenize`` bodies, and kvsieve's own fields (``kv_policy``, ``kv_budget``, ``kv_params``;
the official client sends them through ``extra_body``). Anything else is refused (HTTP 400) rather than ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4
MAX_N = 128
"""The most choices per prompt (OpenAI's limit; the server's ``max_batch`` rows may be fewer)."""
MAX_LOGPROBS = 20
"""The most top log-probabilities a token may report (vLLM's default limit; OpenAI's is 5 for completions)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class GenerationFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # OpenAI parameters accepted only at their neutral value (anything else changes the output in ways not built)
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extras (the official client sends them through extra_body)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    # kvsieve: the request's cache (defaults: the server's --policy, --budget, -p)
    kv_policy: str | None = None
    kv_budget: int | float | str | None = None
    kv_params: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop is a non-empty string or a list of at most {MAX_STOP} non-empty strings")
        return stops


Prompt = str | list[int]
"""One prompt: text or token ids."""


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``. ``prompt``: one prompt (text or token ids) or a list of them, one choice each;
    ``echo``: the choice's text starts with its prompt (with ``logprobs``: the prompt's tokens scored too);
    ``logprobs``: each token's log-probability and the ``logprobs`` most likely tokens at its position;
    ``max_tokens=0``: only with ``echo`` (score the prompt)."""

    prompt: list[Prompt]
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: Literal[1] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> list[Any]:
        """One prompt becomes a list of one."""
        single = isinstance(value, str) or (isinstance(value, list) and bool(value) and _is_token(value[0]))
        prompts = [value] if single else value
        if not isinstance(prompts, list) or not prompts or not all(_is_prompt(p) for p in prompts):
            raise ValueError(
                "the prompt is a non-empty string or list of token ids, or a non-empty list of them (one kind)"
            )
        if len({type(p) for p in prompts}) > 1:
            raise ValueError("the prompts are all strings or all lists of token ids")
        return prompts


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_prompt(value: Any) -> bool:
    return (isinstance(value, str) and bool(value)) or (
        isinstance(value, list) and bool(value) and all(_is_token(t) for t in value)
    )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(GenerationFields):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name), else ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt`` or chat ``messages`` (templated as for a chat request)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the template has them)."""
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]
