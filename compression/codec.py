"""Tensor codecs for hidden states on the wire (pure: bytes in, tensors out, no I/O).

A codec turns a tensor into an `EncodedTensor` (codec name, dtype name, shape, payload bytes) and back.
`decode` validates everything a peer controls before allocating: codec and dtype must be known, the shape must
have the expected rank and element count within the limit, and the payload length must match the shape.
It never casts silently: a dtype outside `allowed_dtypes` is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# dtype name on the wire -> (torch dtype, bytes per element)
WIRE_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "float32": (torch.float32, 4),
    "float16": (torch.float16, 2),
    "bfloat16": (torch.bfloat16, 2),
}


class CodecError(ValueError):
    """A tensor that cannot be decoded as declared; callers turn it into a typed request error."""


@dataclass(frozen=True)
class EncodedTensor:
    codec: str  # codec name, e.g. "none"
    dtype: str  # element type of the decoded tensor
    shape: tuple[int, ...]
    payload: bytes


def _dtype_name(dtype: torch.dtype) -> str:
    for name, (torch_dtype, _) in WIRE_DTYPES.items():
        if torch_dtype == dtype:
            return name
    raise CodecError(f"dtype {dtype} cannot be sent; allowed: {', '.join(WIRE_DTYPES)}")


def encode(tensor: torch.Tensor, codec: str = "none") -> EncodedTensor:
    """Encode `tensor` losslessly ("none" codec: raw little-endian elements)."""
    if codec != "none":
        raise CodecError(f"unknown codec {codec!r}")
    name = _dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous()
    payload = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return EncodedTensor(codec=codec, dtype=name, shape=tuple(flat.shape), payload=payload)


def decode(
    encoded: EncodedTensor,
    *,
    allowed_dtypes: tuple[str, ...] = tuple(WIRE_DTYPES),
    max_elements: int = 1 << 26,
    rank: int | None = None,
) -> torch.Tensor:
    """Decode and validate; raises CodecError with a message naming the problem."""
    if encoded.codec != "none":
        raise CodecError(f"unknown codec {encoded.codec!r}")
    if encoded.dtype not in WIRE_DTYPES or encoded.dtype not in allowed_dtypes:
        raise CodecError(f"dtype {encoded.dtype!r} is not allowed; allowed: {', '.join(allowed_dtypes)}")
    shape = tuple(encoded.shape)
    if rank is not None and len(shape) != rank:
        raise CodecError(f"expected a tensor of rank {rank}, got shape {list(shape)}")
    if any(int(dim) < 0 for dim in shape):
        raise CodecError(f"negative dimension in shape {list(shape)}")
    elements = 1
    for dim in shape:
        elements *= int(dim)
        if elements > max_elements:
            raise CodecError(f"tensor of shape {list(shape)} exceeds the limit of {max_elements} elements")
    torch_dtype, width = WIRE_DTYPES[encoded.dtype]
    if len(encoded.payload) != elements * width:
        raise CodecError(
            f"payload has {len(encoded.payload)} bytes but shape {list(shape)} of {encoded.dtype} needs "
            f"{elements * width}"
        )
    if elements == 0:
        return torch.empty(shape, dtype=torch_dtype)
    raw = torch.frombuffer(bytearray(encoded.payload), dtype=torch.uint8)
    return raw.view(torch_dtype).reshape(shape)


def all_finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor).all()) if tensor.numel() else True


__all__ = ["EncodedTensor", "CodecError", "encode", "decode", "all_finite", "WIRE_DTYPES"]
