"""What the gateway's answers are made of (gateway/app.py): a request checked and tokenized, a generation under way,
and the pieces of OpenAI's answer shapes (ids, usage, server-sent events)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nesa_node.gateway.text import TextStream


@dataclass(frozen=True)
class Prepared:
    """A request checked and tokenized once."""

    ids: list[int]
    stops: list[str]
    max_new: int
    adapter: str | None = None  # the LoRA adapter id the request's model names; None: the base model


@dataclass
class Generation:
    """One request's generation: its text so far, tokens and why it ended."""

    prompt_tokens: int
    text: TextStream
    completion_tokens: int = 0
    finish_reason: str | None = None
    pieces: list[str] = field(default_factory=list)
    verification: dict | None = None  # what the checks found (majority, audit, canary); None: no checks


def answer_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(generation: Generation) -> dict:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


def completion(generation: Generation, *, chat: bool, model: str) -> dict:
    """The answer of a request that is not streamed, once its generation is over."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": generation.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": generation.text.text}
    else:
        choice["text"] = generation.text.text
    return {
        "id": answer_id(chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(generation),
        "nesa": {"verification": generation.verification or {"mode": "off"}},
    }


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


__all__ = ["Generation", "Prepared", "answer_id", "completion", "event", "usage"]
