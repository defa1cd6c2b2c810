"""Messages between peers: hivemind's `ExpertRequest`/`ExpertResponse` protobufs carrying tensors and a small
msgpack metadata map. Everything read from a peer is validated here before use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from nesa_node.compression.codec import CODECS, CodecError, EncodedTensor, decode, encode, wire_bytes
from nesa_node.errors import BadRequestError, NesaError, RequestError, error_from_code

# handler names registered by the node (hivemind ServicerBase names them "<class>.<method>")
RPC_INFO = "BlockHandler.rpc_info"
RPC_FORWARD = "BlockHandler.rpc_forward"
RPC_INFERENCE = "BlockHandler.rpc_inference"
RPC_PUSH = "BlockHandler.rpc_push"
RPC_PUSH_STREAM = "BlockHandler.rpc_push_stream"
RPC_PING = "BlockHandler.rpc_ping"
RPC_LANE_TICKET = "BlockHandler.rpc_lane_ticket"

MAX_METADATA_BYTES = 16 * 1024  # metadata is a handful of ids and integers
MAX_METADATA_KEYS = 32

MAX_CODEC_PARAMS = 4


@dataclass(frozen=True)
class WireCodec:
    """A codec with its parameters, as named in a message's metadata: {"name": "blockwise8", "block_size": 64}.

    Tensors on the wire are opaque bytes to hivemind (its own compression field stays NONE); the codec that
    encoded a message's tensor travels in the message's metadata under "codec" (absent: "none").
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
        if value is None:
            value = {"name": "none"}
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
        compression=runtime_pb2.CompressionType.NONE,
    )


def tensor_from_proto(
    proto: runtime_pb2.Tensor,
    *,
    allowed_dtypes: tuple[str, ...],
    max_elements: int,
    rank: int | None = None,
    codec: WireCodec = NO_CODEC,
) -> torch.Tensor:
    """Decode a tensor from a peer; raises BadRequestError (never casts, never trusts the declared shape)."""
    if proto.compression != runtime_pb2.CompressionType.NONE:
        raise BadRequestError(f"unsupported hivemind tensor compression {proto.compression}; name a codec instead")
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
    "NO_CODEC",
    "RequestError",
    "WireCodec",
    "error_response",
    "field",
    "pack_metadata",
    "raise_if_error",
    "tensor_from_proto",
    "tensor_to_proto",
    "unpack_metadata",
]
