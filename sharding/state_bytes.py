"""Canonical bytes of a training state: float32 tensors in safetensors with one JSON metadata entry, named by their
sha256 (a node's AdamW moments, sharding/lora_train.py OptimizerState; the client's edge layers,
sharding/lora_edges.py EdgeState).

- `CanonicalState`: the base of such a state class: its `METADATA_KEY` and `WHAT` (for messages), `to_bytes()` and
  `_build(header, tensors)` of its own; `sha256` and `from_bytes(data, expected_sha256)` come from here.
- `encode_state(tensors, key, header)`: the tensors contiguous on the CPU in float32, `header` as sorted compact JSON
  under metadata `key`. Equal states give equal bytes, so the hash names the state.
- `decode_state(data, expected_sha256, key, what, build)`: AdapterHashError when `data` does not hash to the name
  asked for; then `build(header, tensors)` makes the state (a ValueError, KeyError or TypeError there, or bytes that
  are not safetensors with that entry, is an AdapterError "bytes are not an <what>"); a state whose own bytes differ
  from `data` is an AdapterError too, so one state has one name.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Mapping
from typing import ClassVar, Protocol, Self, TypeVar

import torch

from nesa_node.errors import AdapterError, AdapterHashError


class _Named(Protocol):
    @property
    def sha256(self) -> str: ...


State = TypeVar("State", bound=_Named)


class CanonicalState:
    METADATA_KEY: ClassVar[str]
    WHAT: ClassVar[str]

    def to_bytes(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def _build(cls, header: dict, tensors: dict[str, torch.Tensor]) -> Self:
        raise NotImplementedError

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes, expected_sha256: str) -> Self:
        """The state `data` holds once its sha256 is `expected_sha256` and it is in canonical form; AdapterHashError
        or AdapterError otherwise."""
        return decode_state(data, expected_sha256, cls.METADATA_KEY, cls.WHAT, cls._build)


def encode_state(tensors: Mapping[str, torch.Tensor], key: str, header: Mapping[str, object]) -> bytes:
    from safetensors.torch import save

    metadata = json.dumps(dict(header), sort_keys=True, separators=(",", ":"))
    canonical = {name: tensor.detach().cpu().float().contiguous() for name, tensor in tensors.items()}
    return save(canonical, metadata={key: metadata})


def decode_state(
    data: bytes,
    expected_sha256: str,
    key: str,
    what: str,
    build: Callable[[dict, dict[str, torch.Tensor]], State],
) -> State:
    from safetensors import SafetensorError
    from safetensors.torch import load

    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256.lower():
        raise AdapterHashError(f"{what} bytes hash to {actual[:16]}…, not {expected_sha256[:16]}…")
    try:
        (header_length,) = struct.unpack("<Q", data[:8])
        header = json.loads(json.loads(data[8 : 8 + header_length])["__metadata__"][key])
        state = build(header, load(data))
    except (ValueError, KeyError, TypeError, RecursionError, struct.error, SafetensorError) as exc:
        raise AdapterError(f"bytes are not an {what} ({type(exc).__name__}: {exc})") from None
    if state.sha256 != actual:
        raise AdapterError(f"{what} not in canonical form")
    return state


__all__ = ["CanonicalState", "decode_state", "encode_state"]
