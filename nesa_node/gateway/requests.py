"""What the gateway's HTTP API takes (gateway/app.py): OpenAI's request bodies as pydantic models, the limits a request
is held to before anything runs, and the errors in OpenAI's shape."""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_STOP_CHARS = 256  # each stop string: every token's text is searched for the starts of each one
# a prompt (or a chat's messages together) has at most this many characters per token of the model's context: far
# more than any tokenizer's longest token, so nothing that fits the context is refused, while a prompt that cannot
# fit is refused before the tokenizer spends seconds on it
MAX_CHARS_PER_TOKEN = 32
# a longer prompt is tokenized in growing prefixes from this many characters per token of the context (about what a
# token of English takes, so most prompts that fit are tokenized once), each refused once its tokens pass the context
# by more than the slack: the tokens a word cut at the prefix's end may take more than it does whole (guess, generous)
PREFIX_CHARS_PER_TOKEN = 4
PREFIX_SLACK_TOKENS = 64
# request bodies: the prompt's characters at up to 4 bytes each in UTF-8 (JSON escapes of control characters aside),
# plus room for the rest of the request
BODY_HEADROOM_BYTES = 1 << 20
# what OpenAI's API offers that this gateway does not do, and the value that asks for nothing: a request naming
# another value is refused, as its answer would mean something else than it asked
UNSUPPORTED = {
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "logit_bias": ({},),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "tools": ([],),
    "functions": ([],),
    "response_format": ({"type": "text"},),
}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# Every request model is strict, as OpenAI's schema is: `"max_tokens": true`, `"5"` or `5.0` and `"stream": "yes"`
# are 400s, not read as 1, 5 and true (an answer never means something else than was asked)
STRICT = ConfigDict(strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool | None = None


class _Sampling(BaseModel):
    # OpenAI clients send fields this gateway does not use (user, ...): kept aside, those of UNSUPPORTED checked
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # what a torch generator's seed takes
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None


MAX_MESSAGES = 1 << 16  # messages in one chat request, whatever the context (each is a token or more of it)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)


def content_text(content: str | list[ContentPart] | None) -> str:
    """A message's text: a string, or its parts' texts; ApiError for a part that is not text (an image, audio: a
    language model's swarm would answer as if it had not been sent)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"only text parts are read here, not {part.type[:40]!r}", param="messages")
    return "".join(part.text for part in content)


def unencodable_field(value: object, path: str = "") -> str | None:
    """The path of the first string in `value` (a request's fields, their lists and parts) that is not valid Unicode,
    such as a lone UTF-16 surrogate that JSON's "\\ud800" escape gives ("messages.0.content", "prompt.1"); None when
    every string encodes as UTF-8. A model's fields only: fields this gateway does not read are not looked at."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "request"
        return None
    if isinstance(value, BaseModel):
        items = ((name, getattr(value, name)) for name in type(value).model_fields)
    elif isinstance(value, list | tuple):
        items = ((str(index), item) for index, item in enumerate(value))
    else:
        return None
    for name, item in items:
        found = unencodable_field(item, f"{path}.{name}" if path else name)
        if found is not None:
            return found
    return None


def shown(text: str, limit: int = 80) -> str:
    """`text` as it may be quoted in an error message: at most `limit` characters, and what is not valid Unicode
    (lone surrogates) or not printable as backslash escapes."""
    head = text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    head = "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in head)
    return head + ("..." if len(text) > limit else "")


def unsupported_parameter(request: CompletionRequest | ChatRequest) -> str | None:
    """The first field of UNSUPPORTED the request sets to another value than null or its defaults, or None."""
    extra = request.model_extra or {}
    for name, defaults in UNSUPPORTED.items():
        value = extra.get(name)
        if value is not None and not any(value == default and type(value) is type(default) for default in defaults):
            return name
    return None


__all__ = [
    "BODY_HEADROOM_BYTES",
    "DEFAULT_MAX_TOKENS",
    "MAX_CHARS_PER_TOKEN",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "PREFIX_CHARS_PER_TOKEN",
    "PREFIX_SLACK_TOKENS",
    "UNSUPPORTED",
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ContentPart",
    "StreamOptions",
    "content_text",
    "shown",
    "unencodable_field",
    "unsupported_parameter",
]
