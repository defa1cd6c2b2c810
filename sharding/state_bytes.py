"""Canonical bytes of a training state: float32 tensors in safetensors with one JSON metadata entry, named by their
sha256 (a node's AdamW moments, sharding/lora_train.py OptimizerState; the client's edge layers,
sharding/lora_edges.py EdgeState).

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
from typing import Protocol, TypeVar

import torch

from nesa_node.errors import AdapterError, AdapterHashError


class _Named(Protocol):
    @property
    def sha256(self) -> str: ...


State = TypeVar("State", bound=_Named)


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


__all__ = ["decode_state", "encode_state"]
