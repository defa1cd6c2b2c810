"""The tensor wire format: hivemind's `Tensor` protobuf carrying a codec's payload (compression/codec.py), and the
codec a message names for it. Everything read from a peer is checked here before a tensor is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from nesa_node.compression.codec import (
    CODECS,
    MAX_RANK,
    CodecError,
    EncodedTensor,
    all_finite,
    decode,
    encode,
    wire_bytes,
)
from nesa_node.errors import BadRequestError

MAX_CODEC_PARAMS = 4
_NONE_METADATA = {"name": "none"}
_NO_COMPRESSION = runtime_pb2.CompressionType.NONE  # hivemind's own compression field, always NONE here


@dataclass(frozen=True)
class WireCodec:
    """A codec with its parameters, as named in a message's metadata: {"name": "blockwise8", "block_size": 64}.

    Tensors on the wire are opaque bytes to hivemind (its own compression field stays NONE); the codec that
    encoded a message's tensor is named in the message (absent: "none").
    """

    name: str = "none"
    params: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, name: str, **params: int) -> WireCodec:
        """A checked codec choice (raises CodecError for an unknown codec or bad parameters)."""
        wire_bytes(name, (0,), **params)  # validates name and parameters
        return cls(name, tuple(sorted(params.items())))

    def to_metadata(self) -> dict[str, Any] | None:
        """The metadata value naming this codec; None (fewer bytes) for "none"."""
        return None if self.name == "none" else {"name": self.name, **dict(self.params)}

    @classmethod
    def from_metadata(cls, value: Any, *, accepted: tuple[str, ...] = CODECS) -> WireCodec:
        """Read a codec named by a peer; BadRequestError unless it is known, accepted and well-formed."""
        if (value is None or value == _NONE_METADATA) and "none" in accepted:  # every lossless step: nothing to check
            return NO_CODEC
        if not isinstance(value, dict) or len(value) > MAX_CODEC_PARAMS + 1:
            raise BadRequestError("codec must be a small map: {name, parameters}")
        name = value.get("name")
        if not isinstance(name, str) or name not in CODECS:
            raise BadRequestError(f"unknown codec {str(name)[:32]!r}; known: {', '.join(CODECS)}")
        if name not in accepted:
            raise BadRequestError(f"codec {name!r} is not accepted here; accepted: {', '.join(accepted)}")
        params = {key: item for key, item in value.items() if key != "name"}
        try:
            return cls.of(name, **params)
        except (CodecError, TypeError) as exc:
            raise BadRequestError(f"bad codec parameters: {exc}") from None


NO_CODEC = WireCodec()


def tensor_to_proto(tensor: torch.Tensor, codec: WireCodec = NO_CODEC) -> runtime_pb2.Tensor:
    """Encode a tensor with `codec`; the caller names the codec in the message metadata (`codec.to_metadata()`)."""
    try:
        encoded = encode(tensor, codec.name, **dict(codec.params))
    except CodecError as exc:  # e.g. nan/inf or values beyond fp16's range under a lossy codec
        raise BadRequestError(f"cannot encode the tensor with codec {codec.name!r}: {exc}") from None
    return runtime_pb2.Tensor(
        buffer=encoded.payload,
        size=list(encoded.shape),
        dtype=encoded.dtype,
        compression=_NO_COMPRESSION,
    )


def tensor_to_wire(tensor: torch.Tensor, codec: WireCodec) -> tuple[runtime_pb2.Tensor, WireCodec]:
    """`tensor_to_proto` with `codec`, or lossless where that codec cannot carry finite values (beyond fp16's
    range): (the tensor message, the codec it was encoded with, which its message must name). Every peer takes
    "none". BadRequestError for nan or inf, as `tensor_to_proto`."""
    try:
        return tensor_to_proto(tensor, codec), codec
    except BadRequestError:
        if codec.name == "none" or not all_finite(tensor):
            raise
        return tensor_to_proto(tensor, NO_CODEC), NO_CODEC


def tensor_from_proto(
    proto: runtime_pb2.Tensor,
    *,
    allowed_dtypes: tuple[str, ...],
    max_elements: int,
    rank: int | None = None,
    codec: WireCodec = NO_CODEC,
) -> torch.Tensor:
    """Decode a tensor from a peer; raises BadRequestError (never casts, never trusts the declared shape: every
    dimension, zeros included, is checked against `max_elements` before torch sees it)."""
    if proto.compression != _NO_COMPRESSION:
        raise BadRequestError(f"unsupported hivemind tensor compression {proto.compression}; name a codec instead")
    if len(proto.size) > MAX_RANK:  # before copying a shape of any length out of the protobuf
        raise BadRequestError(f"a tensor has at most {MAX_RANK} dimensions, got {len(proto.size)}")
    try:
        return decode(
            EncodedTensor(
                codec=codec.name, dtype=proto.dtype, shape=tuple(proto.size), payload=proto.buffer, params=codec.params
            ),
            allowed_dtypes=allowed_dtypes,
            max_elements=max_elements,
            rank=rank,
        )
    except CodecError as exc:
        raise BadRequestError(str(exc)) from None


def as_received(tensor: torch.Tensor, proto: runtime_pb2.Tensor, codec: WireCodec) -> torch.Tensor:
    """What a peer decodes from `proto`, the message `tensor_to_wire` made of `tensor` with `codec`: `tensor` itself
    when that is lossless, else the codec's round trip. A sender keeps this, not its own values, wherever it may
    have to send the same input again to another peer (a replacement rebuilding its cache from a history) or check
    what the receiver computed from it: a lossy codec's receiver never saw the exact values."""
    if codec.name == NO_CODEC.name:
        return tensor
    return tensor_from_proto(proto, allowed_dtypes=(proto.dtype,), max_elements=tensor.numel(), codec=codec)


def bytes_to_proto(data: bytes) -> runtime_pb2.Tensor:
    """Opaque bytes (an adapter's slice or manifest) as a `Tensor` of uint8, for a frame's tensor list."""
    return runtime_pb2.Tensor(
        buffer=data, size=[len(data)], dtype="uint8", compression=runtime_pb2.CompressionType.NONE
    )


def bytes_from_proto(proto: runtime_pb2.Tensor, *, max_bytes: int) -> bytes:
    """The bytes `bytes_to_proto` wrote; BadRequestError for any other tensor or more than `max_bytes`."""
    if proto.compression != runtime_pb2.CompressionType.NONE or proto.dtype != "uint8" or len(proto.size) != 1:
        raise BadRequestError("expected bytes: a one-dimensional uint8 tensor without hivemind compression")
    if proto.size[0] != len(proto.buffer):
        raise BadRequestError(f"a byte tensor declares {proto.size[0]} bytes but holds {len(proto.buffer)}")
    if len(proto.buffer) > max_bytes:
        raise BadRequestError(f"{len(proto.buffer)} bytes where at most {max_bytes} are accepted")
    return bytes(proto.buffer)


__all__ = [
    "NO_CODEC",
    "WireCodec",
    "as_received",
    "bytes_from_proto",
    "bytes_to_proto",
    "tensor_from_proto",
    "tensor_to_proto",
    "tensor_to_wire",
]
