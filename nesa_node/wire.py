"""Messages between peers: hivemind's `ExpertRequest`/`ExpertResponse` protobufs carrying tensors and a small
msgpack metadata map. Everything read from a peer is validated here before use.
"""

from __future__ import annotations

from typing import Any

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from nesa_node.compression.codec import CodecError, EncodedTensor, decode, encode
from nesa_node.errors import BadRequestError, NesaError, RequestError, error_from_code

# handler names registered by the node (hivemind ServicerBase names them "<class>.<method>")
RPC_INFO = "BlockHandler.rpc_info"
RPC_FORWARD = "BlockHandler.rpc_forward"
RPC_INFERENCE = "BlockHandler.rpc_inference"
RPC_PUSH = "BlockHandler.rpc_push"
RPC_PUSH_STREAM = "BlockHandler.rpc_push_stream"

MAX_METADATA_BYTES = 16 * 1024  # metadata is a handful of ids and integers
MAX_METADATA_KEYS = 32

_CODEC_BY_COMPRESSION = {runtime_pb2.CompressionType.NONE: "none"}
_COMPRESSION_BY_CODEC = {name: value for value, name in _CODEC_BY_COMPRESSION.items()}


def tensor_to_proto(tensor: torch.Tensor, codec: str = "none") -> runtime_pb2.Tensor:
    encoded = encode(tensor, codec)
    return runtime_pb2.Tensor(
        buffer=encoded.payload,
        size=list(encoded.shape),
        dtype=encoded.dtype,
        compression=_COMPRESSION_BY_CODEC[encoded.codec],
    )


def tensor_from_proto(
    proto: runtime_pb2.Tensor, *, allowed_dtypes: tuple[str, ...], max_elements: int, rank: int | None = None
) -> torch.Tensor:
    """Decode a tensor from a peer; raises BadRequestError (never casts, never trusts the declared shape)."""
    codec = _CODEC_BY_COMPRESSION.get(proto.compression)
    if codec is None:
        raise BadRequestError(f"unsupported tensor compression {proto.compression}")
    try:
        return decode(
            EncodedTensor(codec=codec, dtype=proto.dtype, shape=tuple(proto.size), payload=proto.buffer),
            allowed_dtypes=allowed_dtypes,
            max_elements=max_elements,
            rank=rank,
        )
    except CodecError as exc:
        raise BadRequestError(str(exc)) from None


async def drain(queue, end: object):
    """Yield items of an asyncio queue until `end`: the request side of an outgoing stream."""
    while True:
        item = await queue.get()
        if item is end:
            return
        yield item


def pack_metadata(metadata: dict[str, Any]) -> bytes:
    return MSGPackSerializer.dumps(metadata)


def unpack_metadata(raw: bytes) -> dict[str, Any]:
    """Metadata from a peer: a small map with string keys, or BadRequestError."""
    if len(raw) > MAX_METADATA_BYTES:
        raise BadRequestError(f"metadata of {len(raw)} bytes exceeds {MAX_METADATA_BYTES}")
    if not raw:
        return {}
    try:
        value = MSGPackSerializer.loads(raw)
    except Exception as exc:
        raise BadRequestError(f"metadata is not valid msgpack: {exc}") from None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS or not all(isinstance(k, str) for k in value):
        raise BadRequestError("metadata must be a small map with string keys")
    return value


def field(metadata: dict[str, Any], name: str, kind: type | tuple[type, ...], *, default: Any = ...) -> Any:
    """Read one typed metadata field; bool is never accepted where int is asked."""
    if name not in metadata:
        if default is ...:
            raise BadRequestError(f"metadata field {name!r} is missing")
        return default
    value = metadata[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise BadRequestError(f"metadata field {name!r} must be {'/'.join(k.__name__ for k in kinds)}")
    return value


def error_response(error: NesaError, **extra: Any) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=pack_metadata({"error": error.code, "message": error.message, **extra}))


def error_from_metadata(metadata: dict[str, Any]) -> NesaError:
    return error_from_code(str(metadata.get("error")), str(metadata.get("message", "")))


def raise_if_error(metadata: dict[str, Any]) -> None:
    if "error" in metadata:
        raise error_from_metadata(metadata)


__all__ = [
    "RequestError",
    "error_response",
    "field",
    "pack_metadata",
    "raise_if_error",
    "tensor_from_proto",
    "tensor_to_proto",
    "unpack_metadata",
]
