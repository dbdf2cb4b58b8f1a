"""The wire format of ``dspark serve`` (:mod:`dspark_runtime.serving.app`): OpenAI-style error bodies and the request
models of ``/v1/completions`` and ``/v1/chat/completions`` (pydantic, unknown fields refused)."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from dspark_runtime.decoding.logprobs import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 8
MAX_CHOICES = 16  # n: choices per request (each takes a batch slot while it decodes)


# ---------------------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        """The JSON body of the error."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    """The ``error`` object of an error response (OpenAI format)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """An error response (OpenAI format)."""

    error: ErrorDetail


#: the error statuses of the generation routes, as FastAPI's ``responses=`` documents them in the OpenAPI schema
ERROR_RESPONSES = {s: {"model": ErrorResponse} for s in (400, 404, 429, 503)}


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a body that echoes a client's string (e.g. an unknown field name with
    a lone surrogate) still encodes, so it can never turn into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


# ---------------------------------------------------------------------------------------- request models


class _Strict(BaseModel):
    """Request models reject unknown fields (answered 400 "unrecognized request argument")."""

    model_config = ConfigDict(extra="forbid")


StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema the output must satisfy (OpenAI's structured outputs)."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    """``response_format``: ``text`` (unconstrained), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def as_dict(self) -> dict | None:
        """The OpenAI object the grammar compiler takes, or None for ``text``."""
        if self.type == "text":
            return None
        out = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = self.json_schema.model_dump(by_alias=True, exclude_none=True)
        return out


class _GenerationFields(_Strict):
    """The sampling and streaming fields both generation routes take."""

    model: str | None = Field(None, description="The served model's id (see /v1/models); optional.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=1_000_000, description="0 = off (extension).")
    seed: int | None = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1, description="Sampling seed.")
    stop: StopString | list[StopString] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices to generate; the prompt is prefilled once for all. "
                   "Choice i samples with seed + i.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100.0, allow_inf_nan=False, description="1 = off (extension).")
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_count(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(v)}; pass fewer")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        """The most tokens the client asked to generate, or None for the server's default."""
        return self.max_tokens


class CompletionRequest(_GenerationFields):
    """``POST /v1/completions``: ``prompt`` is raw text (no chat template) or a list of token ids."""

    prompt: Annotated[str, StringConstraints(min_length=1)] | Annotated[
        list[Annotated[int, Field(ge=0, lt=2 ** 31)]], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Log-probabilities of each token and of "
                                 "this many alternatives (the target's raw distribution).")

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per token to report, or None for no logprobs."""
        return self.logprobs


class TextPart(_Strict):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message (text only)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_GenerationFields):
    """``POST /v1/chat/completions``: messages rendered with the engine's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens (newer clients).")
    logprobs: bool = Field(False, description="Return each token's log-probability (the target's raw distribution).")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per token; needs "
                                     "logprobs: true.")

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per token to report, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else None (the server's default)."""
        return self.max_completion_tokens or self.max_tokens
