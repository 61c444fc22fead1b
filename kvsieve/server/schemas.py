"""The request bodies the server accepts: OpenAI's completion and chat fields that it implements, parameters that
only have a neutral value here, and kvsieve's own fields (``kv_policy``, ``kv_budget``, ``kv_params``; the official
client sends them through ``extra_body``). Anything else is refused (HTTP 400) rather than ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4


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
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI parameters accepted only at their neutral value (anything else changes the output in ways not built)
    presence_penalty: float = 0
    frequency_penalty: float = 0
    logit_bias: dict[str, float] | None = None
    # kvsieve: the request's cache (defaults: the server's --policy, --budget, -p)
    kv_policy: str | None = None
    kv_budget: int | float | str | None = None
    kv_params: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported (only 0)")
        return value

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


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int]
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    logprobs: None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


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
    logprobs: Literal[False] | None = None

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name), else ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens
