"""Tensor codecs for hidden states on the wire (pure: bytes in, tensors out, no I/O).

A codec turns a tensor into an `EncodedTensor` (codec name, codec parameters, dtype name, shape, payload bytes) and
back. Registered codecs (`CODECS`), with their payload size for n elements of a dtype w bytes wide:

    none        raw little-endian elements, lossless                               n * w
    fp16, bf16  elements cast to float16 / bfloat16; non-finite or out of range    n * 2
                values are refused rather than sent as inf
    blockwise8  per block of `block_size`: float32 absmax, then int8 linear codes   n + 4 * ceil(n / block_size)
    dynamic8    per block of `block_size`: float32 scale, then uint8 codes of the   n + 4 * ceil(n / block_size)
                dynamic map (Dettmers et al. 2022)

Quantized payloads hold all block scales first, then one code per element; the zero padding of the last block is not
sent. Lossy codecs refuse nan and inf; "none" passes them through (receivers check finiteness separately).

`decode` validates everything a peer controls before allocating: codec, parameters and dtype must be known and
allowed, the shape must have the expected rank and element count within the limit, the payload length must match
the shape and parameters, and block scales must be finite and within the dtype's range. It never casts silently:
the result has the dtype named in the `EncodedTensor`, and a dtype outside `allowed_dtypes` is an error.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from nesa_node.compression import quantize
from nesa_node.compression.names import CODECS, DEFAULT_CODEC

# dtype name on the wire -> (torch dtype, bytes per element)
WIRE_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "float32": (torch.float32, 4),
    "float16": (torch.float16, 2),
    "bfloat16": (torch.bfloat16, 2),
}

_SCALE_BYTES = 4  # one float32 per block


class CodecError(ValueError):
    """A tensor that cannot be encoded or decoded as declared; callers turn it into a typed request error."""


@dataclass(frozen=True)
class EncodedTensor:
    codec: str  # codec name, one of CODECS
    dtype: str  # element type of the decoded tensor
    shape: tuple[int, ...]
    # the bytes on the wire; from `encode_on_device`, the same bytes as a one-dimensional uint8 tensor still on the
    # encoded tensor's device (bytes once they go out: `encode`)
    payload: bytes | torch.Tensor
    params: tuple[
        tuple[str, int], ...
    ] = ()  # codec parameters as sorted (name, value) pairs, e.g. (("block_size", 64),)


@dataclass(frozen=True)
class _Range:
    default: int
    low: int
    high: int


@dataclass(frozen=True)
class _Codec:
    params: Mapping[str, _Range]
    payload_bytes: Callable[[int, int, dict[str, int]], int]  # (elements, dtype width, params) -> bytes
    encode: Callable[[torch.Tensor, dict[str, int]], torch.Tensor]  # flat tensor -> uint8 payload, same device
    # (uint8 payload on the CPU, elements, dtype, params, device) -> flat tensor; raises CodecError on bad content
    decode: Callable[[torch.Tensor, int, torch.dtype, dict[str, int], torch.device], torch.Tensor]


_WIRE_NAMES: dict[torch.dtype, str] = {torch_dtype: name for name, (torch_dtype, _) in WIRE_DTYPES.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, (torch_dtype, _) in WIRE_DTYPES.items():
        if torch_dtype == dtype:
            return name
    raise CodecError(f"dtype {dtype} cannot be sent; allowed: {', '.join(WIRE_DTYPES)}")


def _refuse_non_finite() -> CodecError:
    return CodecError("a lossy codec cannot encode nan or inf; send it with codec 'none' or fix the values")


def _encode_raw(flat: torch.Tensor, params: dict[str, int]) -> torch.Tensor:
    return flat.contiguous().view(torch.uint8)


def _decode_raw(raw: torch.Tensor, elements: int, dtype: torch.dtype, params: dict[str, int], device) -> torch.Tensor:
    return raw.view(dtype).to(device, copy=True)  # `raw` views the payload bytes, which must not be handed out


def _encode_cast(wire_dtype: torch.dtype, flat: torch.Tensor, params: dict[str, int]) -> torch.Tensor:
    cast = flat.to(wire_dtype)
    if not all_finite(cast):
        if not all_finite(flat):
            raise _refuse_non_finite()
        raise CodecError(
            f"values beyond the {wire_dtype} range (|x| <= {torch.finfo(wire_dtype).max:g}) would arrive as inf; "
            "use codec 'none' or a block codec"
        )
    return cast.view(torch.uint8)


def _decode_cast(
    wire_dtype: torch.dtype, raw: torch.Tensor, elements: int, dtype: torch.dtype, params: dict[str, int], device
) -> torch.Tensor:
    return raw.view(wire_dtype).to(device=device, dtype=dtype, copy=True)  # never a view of the payload bytes


def _block_count(elements: int, block_size: int) -> int:
    return -(-elements // block_size)


def _blockwise_bytes(elements: int, width: int, params: dict[str, int]) -> int:
    return elements + _SCALE_BYTES * _block_count(elements, params["block_size"])


def _encode_blocks(
    quantizer: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    flat: torch.Tensor,
    params: dict[str, int],
) -> torch.Tensor:
    elements, block_size = flat.numel(), params["block_size"]
    blocks = _block_count(elements, block_size)
    values = flat.to(torch.float32)
    if blocks * block_size != elements:
        values = torch.nn.functional.pad(values, (0, blocks * block_size - elements))  # zeros leave absmax unchanged
    codes, scales = quantizer(values.view(blocks, block_size))  # (blocks, block_size), (blocks,)
    if not bool(torch.isfinite(scales).all()):  # a nan or inf element makes its block's scale nan or inf
        raise _refuse_non_finite()
    return torch.cat([scales.view(torch.uint8), codes.view(torch.uint8).view(-1)[:elements]])


def _encode_linear(flat: torch.Tensor, params: dict[str, int]) -> torch.Tensor:
    """blockwise8 payload, written in place by `quantize.quantize_linear_into` (same bytes as `_encode_blocks`)."""
    elements, block_size = flat.numel(), params["block_size"]
    blocks = _block_count(elements, block_size)
    values = flat.contiguous()
    if blocks * block_size != elements:
        values = torch.nn.functional.pad(values, (0, blocks * block_size - elements))  # zeros leave absmax unchanged
    # scales, then the codes of whole blocks; the codes of the padding are cut off before sending
    payload = torch.empty(_SCALE_BYTES * blocks + blocks * block_size, dtype=torch.uint8, device=flat.device)
    scales = payload[: _SCALE_BYTES * blocks].view(torch.float32)  # (blocks,)
    codes = payload[_SCALE_BYTES * blocks :].view(torch.int8).view(blocks, block_size)
    highest = quantize.quantize_linear_into(values.view(blocks, block_size), scales, codes)
    if not math.isfinite(highest):  # a nan or inf element makes its block's scale nan or inf
        raise _refuse_non_finite()
    return payload[: _SCALE_BYTES * blocks + elements]


def _decode_blocks(
    signed_scales: bool,
    code_dtype: torch.dtype,
    dequantizer: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor],  # (codes, scales, dtype)
    raw: torch.Tensor,
    elements: int,
    dtype: torch.dtype,
    params: dict[str, int],
    device,
) -> torch.Tensor:
    block_size = params["block_size"]
    blocks = _block_count(elements, block_size)
    scales = raw[: _SCALE_BYTES * blocks].view(torch.float32)  # (blocks,)
    codes = raw[_SCALE_BYTES * blocks :].view(code_dtype)  # (elements,)
    # the decoded values are at most |scale|, so a finite scale within the dtype's range keeps them finite; the
    # extremes answer all three checks (min and max propagate nan; on the CPU torch.aminmax measured 20x slower than
    # both, so only a GPU's payload takes it: _extremes)
    linear = code_dtype == torch.int8
    lowest, highest, lowest_code = _extremes(scales, codes if linear else None, fused=raw.device.type != "cpu")
    if not (math.isfinite(lowest) and math.isfinite(highest)):
        raise CodecError("block scales must be finite")
    if not signed_scales and lowest < 0:
        raise CodecError("block scales of codec 'blockwise8' must be >= 0")
    if max(highest, -lowest) > torch.finfo(dtype).max:
        raise CodecError(f"a block scale exceeds the {dtype} range")
    if lowest_code < -127:
        raise CodecError("code -128 is not a linear code (codes are -127..127)")
    if blocks * block_size != elements:
        codes = torch.nn.functional.pad(codes, (0, blocks * block_size - elements))
    values = dequantizer(codes.to(device).view(blocks, block_size), scales.to(device), dtype)  # (blocks, block_size)
    return values.view(-1)[:elements]


def _extremes(scales: torch.Tensor, codes: torch.Tensor | None, *, fused: bool) -> tuple[float, float, int]:
    """(least scale, largest scale, least code) of a block payload (least code 0 without `codes`). On the CPU three
    reductions read directly, elsewhere stacked and read in one transfer. `fused` (the decoder's choice for a payload
    on a GPU, from encode_on_device) writes them into one small tensor, the scales' two by one min-and-max
    reduction, and reads it in one transfer: three kernels where a min, a max, a min, a conversion and a stack took
    five, and one wait for the device either way."""
    if not fused:
        if scales.device.type == "cpu":
            return float(scales.min()), float(scales.max()), int(codes.min()) if codes is not None else 0
        # another device without fusing (the codec table's comparison): five kernels, one transfer
        extremes = [scales.min(), scales.max()] + ([codes.min().to(torch.float32)] if codes is not None else [])
        lowest, highest, *rest = torch.stack(extremes).tolist()
        return lowest, highest, int(rest[0]) if rest else 0
    extremes = torch.empty(2 if codes is None else 3, dtype=torch.float32, device=scales.device)
    torch.aminmax(scales, out=(extremes[0], extremes[1]))
    if codes is not None:
        extremes[2].copy_(codes.min())  # int8 -128..127: exact in float32
    values = extremes.tolist()
    return values[0], values[1], int(values[2]) if codes is not None else 0


def _dequantize_linear(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)  # (blocks, block_size)
    return quantize.dequantize_linear_into(codes, scales, out)


def _dequantize_dynamic(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return quantize.dequantize_dynamic(codes, scales).to(dtype)


_NO_PARAMS: Mapping[str, _Range] = MappingProxyType({})
# block_size: 64 elements share a float32 scale, 1/16 byte per element, and an outlier coarsens only its own 64
# neighbours (guess, to be checked against bench/compression.py); below 16 the scales cost over 1/4 byte per element,
# above 4096 one scale spans more than a whole hidden vector of a 7B model
_BLOCK_PARAMS: Mapping[str, _Range] = MappingProxyType({"block_size": _Range(default=64, low=16, high=4096)})

_REGISTRY: Mapping[str, _Codec] = MappingProxyType(
    {
        "none": _Codec(_NO_PARAMS, lambda elements, width, params: elements * width, _encode_raw, _decode_raw),
        "fp16": _Codec(
            _NO_PARAMS,
            lambda elements, width, params: elements * 2,
            partial(_encode_cast, torch.float16),
            partial(_decode_cast, torch.float16),
        ),
        "bf16": _Codec(
            _NO_PARAMS,
            lambda elements, width, params: elements * 2,
            partial(_encode_cast, torch.bfloat16),
            partial(_decode_cast, torch.bfloat16),
        ),
        "blockwise8": _Codec(
            _BLOCK_PARAMS,
            _blockwise_bytes,
            _encode_linear,
            partial(_decode_blocks, False, torch.int8, _dequantize_linear),
        ),
        "dynamic8": _Codec(
            _BLOCK_PARAMS,
            _blockwise_bytes,
            partial(_encode_blocks, quantize.quantize_dynamic),
            partial(_decode_blocks, True, torch.uint8, _dequantize_dynamic),
        ),
    }
)
if tuple(_REGISTRY) != CODECS:  # names.py lists them for light importers (the CLI); keep the two in step
    raise ImportError(f"codec registry {tuple(_REGISTRY)} differs from compression.names.CODECS {CODECS}")


def _codec(name: str) -> _Codec:
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise CodecError(f"unknown codec {name!r}; known: {', '.join(CODECS)}")
    return spec


def _resolve_params(name: str, spec: _Codec, given: Any) -> dict[str, int]:
    """Check codec parameters (a mapping or (name, value) pairs, possibly from a peer) and fill in defaults."""
    try:
        pairs = list(given.items()) if isinstance(given, Mapping) else [tuple(pair) for pair in given]
    except TypeError:
        raise CodecError("codec parameters must be (name, value) pairs") from None
    resolved: dict[str, int] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise CodecError("codec parameters must be (name, value) pairs")
        key, value = pair
        allowed = spec.params.get(key) if isinstance(key, str) else None
        if allowed is None:
            known = ", ".join(spec.params) or "none"
            raise CodecError(f"codec {name!r} has no parameter {key!r}; its parameters: {known}")
        if key in resolved:
            raise CodecError(f"parameter {key!r} given twice")
        if isinstance(value, bool) or not isinstance(value, int):
            raise CodecError(f"parameter {key!r} must be an integer, got {value!r}")
        if not allowed.low <= value <= allowed.high:
            raise CodecError(f"parameter {key}={value} is outside {allowed.low}..{allowed.high}")
        resolved[key] = value
    for key, allowed in spec.params.items():
        resolved.setdefault(key, allowed.default)
    return resolved


MAX_RANK = 8  # dimensions a tensor from a peer may have (hidden states have 3); bounds the work spent on its shape


def _element_count(shape: Any, rank: int | None, max_elements: int) -> tuple[tuple[int, ...], int]:
    """The checked shape and element count of a tensor a peer declared.

    Every dimension counts against `max_elements` as if none were 0: a tensor of no elements can still declare
    dimensions whose strides overflow torch (shape (0, 2**40, 2**40) made `torch.empty` raise RuntimeError)."""
    try:
        if len(shape) > MAX_RANK:
            raise CodecError(f"a tensor has at most {MAX_RANK} dimensions, got {len(shape)}")
        dims = tuple(operator.index(dim) for dim in shape)
    except TypeError:
        raise CodecError(f"shape must be a sequence of integers, got {shape!r}") from None
    if rank is not None and len(dims) != rank:
        raise CodecError(f"expected a tensor of rank {rank}, got shape {list(dims)}")
    if any(dim < 0 for dim in dims):
        raise CodecError(f"negative dimension in shape {list(dims)}")
    extent = 1  # the product of the dimensions, zeros counted as 1
    for dim in dims:
        extent *= max(dim, 1)
        if extent > max_elements:
            raise CodecError(f"tensor of shape {list(dims)} exceeds the limit of {max_elements} elements")
    return dims, math.prod(dims)


def encode(tensor: torch.Tensor, codec: str = "none", **params: int) -> EncodedTensor:
    """Encode a float32, float16 or bfloat16 tensor of any shape and device for the wire.

    The work runs on the tensor's device (`encode_on_device`); only the payload bytes move to the CPU. `params` are
    the codec's parameters (blockwise8, dynamic8: `block_size`, 16..4096 elements, default 64); the result records
    all of them. Per-element error: none exact; fp16 / bf16 one rounding to the wire dtype; blockwise8
    |x - x'| <= absmax / 254 and dynamic8 |x - x'| <= 0.00703125 * absmax, absmax taken over the element's block
    (see `quantize`).
    Raises CodecError for an unknown codec, bad parameters, a dtype not in WIRE_DTYPES, nan or inf with a lossy codec,
    and values beyond the float16 / bfloat16 range with fp16 / bf16.
    """
    if codec == "none" and not params and tensor.device.type == "cpu" and tensor.dtype in _WIRE_NAMES:
        # a host tensor, lossless: its bytes as they lie, without the registry's lookups (a decode step's hidden
        # states are a few KiB, so those lookups were most of its encoding)
        data = tensor.detach()
        # numpy writes the elements in order whatever the strides; it has no bfloat16, whose bits are int16's
        payload = (data.view(torch.int16) if data.dtype == torch.bfloat16 else data).numpy().tobytes()
        return EncodedTensor(codec="none", dtype=_WIRE_NAMES[tensor.dtype], shape=tuple(tensor.shape), payload=payload)
    payload, name, resolved = _encode(tensor, codec, params)
    return EncodedTensor(
        codec=codec,
        dtype=name,
        shape=tuple(tensor.shape),
        payload=payload.cpu().numpy().tobytes() if len(payload) else b"",
        params=resolved,
    )


def encode_on_device(tensor: torch.Tensor, codec: str = "none", **params: int) -> EncodedTensor:
    """`encode` without the way out: the payload is a one-dimensional uint8 tensor on the tensor's device, which
    `decode` takes as it is (`decode(encode_on_device(x, c), device=x.device)` is `x` through codec `c` without
    leaving the device). A GPU copies only these bytes to the host, when they go out. With codec "none" the payload
    may share memory with `tensor` (decode copies). Same errors as `encode`."""
    payload, name, resolved = _encode(tensor, codec, params)
    return EncodedTensor(codec=codec, dtype=name, shape=tuple(tensor.shape), payload=payload, params=resolved)


def _encode(tensor: torch.Tensor, codec: str, params: dict[str, int]) -> tuple[torch.Tensor, str, tuple]:
    """(uint8 payload on the tensor's device, dtype name, sorted codec parameters) of `tensor` through `codec`."""
    spec = _codec(codec)
    resolved = _resolve_params(codec, spec, params)
    name = _dtype_name(tensor.dtype)
    flat = tensor.detach().reshape(-1)  # (elements,)
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element of a strided view: "contiguous" to torch, yet its
        flat = flat.clone(memory_format=torch.contiguous_format)  # stride keeps it from being viewed as bytes
    if flat.numel():
        payload = spec.encode(flat, resolved)
    else:
        payload = torch.empty(0, dtype=torch.uint8, device=flat.device)
    return payload, name, tuple(sorted(resolved.items()))


def decode(
    encoded: EncodedTensor,
    *,
    allowed_dtypes: tuple[str, ...] = tuple(WIRE_DTYPES),
    max_elements: int = 1 << 26,
    rank: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Validate and decode a tensor that may come from a peer; the result is on `device` (default CPU).

    Checks, before allocating anything the size of the tensor: known codec, known parameters within range, dtype in
    `allowed_dtypes`, rank (when given, and at most MAX_RANK), no negative dimension, at most `max_elements` elements
    (zero dimensions counted as 1, so an empty tensor cannot declare dimensions torch cannot lay out), payload length
    exactly what shape and parameters require; then for block codecs that every scale is finite, within the dtype's
    range (and >= 0 for blockwise8), and that no int8 code is -128. Raises CodecError with a message naming the
    problem. Decoded values may still be nan or inf with codecs "none", "fp16" and "bf16": check with `all_finite`.
    The payload is bytes (from a peer) or, from `encode_on_device`, a one-dimensional uint8 tensor on any device.
    """
    if encoded.codec == "none" and device is None and encoded.params == ():
        lossless = _host_raw(encoded, allowed_dtypes, max_elements, rank)
        if lossless is not None:
            return lossless
    return _decode_checked(encoded, allowed_dtypes, max_elements, rank, device)


def _host_raw(
    encoded: EncodedTensor, allowed_dtypes: tuple[str, ...], max_elements: int, rank: int | None
) -> torch.Tensor | None:
    """`decode` of a lossless payload of bytes to the CPU, the common case (every hop of a lossless swarm), with the
    same checks in fewer steps: the dtype allowed, the rank, every dimension a positive int, at most `max_elements`
    elements, the payload exactly their bytes. None wherever anything is otherwise (an empty tensor, a zero or odd
    dimension, a wrong length, a payload tensor): `_decode_checked` then decodes it or names what is wrong."""
    dtype, shape, payload = encoded.dtype, encoded.shape, encoded.payload
    if type(dtype) is not str or dtype not in allowed_dtypes or dtype not in WIRE_DTYPES:
        return None
    if type(shape) is not tuple or len(shape) > MAX_RANK or (rank is not None and len(shape) != rank):
        return None
    elements = 1
    for dim in shape:
        if type(dim) is not int or dim <= 0:
            return None
        elements *= dim
        if elements > max_elements:
            return None
    torch_dtype, width = WIRE_DTYPES[dtype]
    if type(payload) is not bytes or len(payload) != elements * width:
        return None
    return _payload_view(payload).view(torch_dtype).clone().view(shape)  # a copy: the payload's bytes stay the peer's


def _decode_checked(
    encoded: EncodedTensor,
    allowed_dtypes: tuple[str, ...],
    max_elements: int,
    rank: int | None,
    device: torch.device | str | None,
) -> torch.Tensor:
    """`decode` by the codec's registry entry, every check in order (see `decode`)."""
    spec = _codec(encoded.codec)
    params = _resolve_params(encoded.codec, spec, encoded.params)
    if encoded.dtype not in WIRE_DTYPES or encoded.dtype not in allowed_dtypes:
        raise CodecError(f"dtype {encoded.dtype!r} is not allowed; allowed: {', '.join(allowed_dtypes)}")
    shape, elements = _element_count(encoded.shape, rank, max_elements)
    torch_dtype, width = WIRE_DTYPES[encoded.dtype]
    expected = spec.payload_bytes(elements, width, params)
    length = _payload_length(encoded.payload)
    if length != expected:
        raise CodecError(
            f"payload has {length} bytes but shape {list(shape)} of {encoded.dtype} with codec {encoded.codec!r} "
            f"needs {expected}"
        )
    target = torch.device(device) if device is not None else torch.device("cpu")
    if elements == 0:
        return torch.empty(shape, dtype=torch_dtype, device=target)
    raw = _payload_view(encoded.payload)  # (payload bytes,)
    return spec.decode(raw, elements, torch_dtype, params, target).reshape(shape)


def _payload_length(payload: bytes | torch.Tensor) -> int:
    """Bytes in a payload: bytes, or a one-dimensional contiguous uint8 tensor (CodecError for any other tensor)."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
            raise CodecError("a payload tensor must be one-dimensional, contiguous uint8")
        return payload.numel()
    return len(payload)


_FROMBUFFER_WARNED = False  # torch's one warning about views of immutable bytes has been given (and silenced)


def _payload_view(payload: bytes | torch.Tensor) -> torch.Tensor:
    """A read-only uint8 tensor over the payload, without copying it: decoders only read it (and copy where their
    result would otherwise be a view of it). torch warns once per process that such a tensor could write into
    immutable bytes; that one warning is silenced here, where nothing does (on the first view only: entering
    `catch_warnings` on every decode step costs more than the rest of a small tensor's decoding). A payload that is
    already a tensor (`encode_on_device`) is used as it is."""
    global _FROMBUFFER_WARNED
    if isinstance(payload, torch.Tensor):  # checked by _payload_length
        return payload
    if isinstance(payload, bytes | bytearray) and len(payload) > 0:
        if _FROMBUFFER_WARNED:
            return torch.frombuffer(payload, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            view = torch.frombuffer(payload, dtype=torch.uint8)
        _FROMBUFFER_WARNED = True
        return view
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def wire_bytes(codec: str, shape: tuple[int, ...], dtype: str | torch.dtype = "float32", **params: int) -> int:
    """Payload size in bytes of a tensor of `shape` and `dtype` sent with `codec` (raises CodecError when invalid)."""
    spec = _codec(codec)
    resolved = _resolve_params(codec, spec, params)
    name = _dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
    if name not in WIRE_DTYPES:
        raise CodecError(f"dtype {name!r} cannot be sent; allowed: {', '.join(WIRE_DTYPES)}")
    _, elements = _element_count(shape, None, 1 << 62)
    return spec.payload_bytes(elements, WIRE_DTYPES[name][1], resolved)


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)  # the float dtypes numpy holds as they are
_BF16_EXPONENT, _BF16_MAGNITUDE = np.int16(0x7F80), np.int16(0x7FFF)  # a bfloat16's exponent bits, all but its sign
SMALL_CHECK_ELEMENTS = 1 << 16  # up to this many elements of a CPU tensor, numpy checks them (see all_finite)


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no element is nan or inf."""
    if not tensor.numel():
        return True
    if tensor.device.type == "cpu" and tensor.numel() <= SMALL_CHECK_ELEMENTS:
        # a decode step's hidden states (hundreds to thousands of elements): numpy's exact check on a view of the
        # tensor costs a third of one torch call's dispatch, and every hop of every token pays it
        if tensor.dtype in _NUMPY_FLOATS:
            return bool(np.isfinite(tensor.detach().numpy()).all())
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: nan and inf are those whose exponent is all ones,
            # the magnitudes (sign bit cleared) from 0x7F80 up
            magnitudes = np.bitwise_and(tensor.detach().view(torch.int16).numpy(), _BF16_MAGNITUDE)
            return bool(magnitudes.max() < _BF16_EXPONENT)
    # nan and inf propagate through a sum, so a finite sum proves every element finite at the cost of one read (an
    # isfinite mask costs several times more); only a non-finite sum, which huge finite values can also cause,
    # pays for the exact check
    if bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())


__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "MAX_RANK",
    "WIRE_DTYPES",
    "CodecError",
    "EncodedTensor",
    "all_finite",
    "decode",
    "encode",
    "encode_on_device",
    "wire_bytes",
]
