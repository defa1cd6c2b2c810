"""Reading a peer's message metadata before any model sees it: msgpack with bounded size and nesting, no extension
types (whose decoders may recurse), a map at the top; and the wording of a model's validation errors."""

from __future__ import annotations

import msgpack
from pydantic import ValidationError

from nesa_node.errors import BadRequestError


def read_map(raw: bytes, *, max_bytes: int, max_depth: int) -> dict:
    """The msgpack map in `raw`; BadRequestError for more than `max_bytes`, anything but a map with string keys, an
    extension type, or containers nested deeper than `max_depth`."""
    if len(raw) > max_bytes:
        raise BadRequestError(f"message of {len(raw)} bytes exceeds {max_bytes}")
    try:
        value = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=False,  # arrays as tuples: the models' sequences are tuples (strict types)
            ext_hook=_no_extensions,
        )
    except Exception as exc:  # msgpack raises several types for malformed input
        raise BadRequestError(f"message is not valid msgpack: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise BadRequestError(f"a message is a map with a 'kind', got {type(value).__name__}")
    if not _nested_within(value, max_depth):
        raise BadRequestError(f"message nested deeper than {max_depth} levels")
    return value


def _no_extensions(code: int, data: bytes) -> None:
    raise ValueError(f"msgpack extension type {code} is not accepted")


def _nested_within(value: dict, limit: int) -> bool:
    """Whether a decoded map nests containers at most `limit` levels deep (counted without recursion; map keys are
    strings, as msgpack was told to require)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > limit:
            return False
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, dict | tuple | list):
                pending.append((child, depth + 1))
    return True


def describe(error: ValidationError, kind: object) -> str:
    parts = []
    for item in error.errors(include_url=False)[:3]:
        location = item["loc"][1:] if item["loc"][:1] == (kind,) else item["loc"]  # the union's tag: said already
        where = ".".join(str(part) for part in location)
        parts.append(f"{where}: {item['msg']}" if where else item["msg"])
    return "; ".join(parts)


__all__ = ["describe", "read_map"]
