"""Block-wise 8-bit quantization kernels for hidden states (pure: tensors in, tensors out, no I/O).

Both schemes are from Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022): the input is cut
into blocks, each block is normalized by its own absolute maximum (one float32 scale per block), and every element
becomes one byte.

- linear (`quantize_linear`): q = round(127 * x / absmax), x' = q / 127 * absmax, so |x - x'| <= absmax / 254.
  `quantize_linear_into` and `dequantize_linear_into` give the same bits in fewer passes over memory, writing into
  buffers the caller owns (the codec's payload and result); the plain functions are their reference.
- dynamic (`quantize_dynamic`): x / scale is replaced by the nearest of the 256 values of the dynamic map
  (`dynamic_map`), x' = map[q] * scale, so |x - x'| <= DYNAMIC_MAX_ERROR * absmax. The map is fine near zero and
  coarse near one, which keeps small elements of a block that also holds an outlier.

Callers flatten the input, pad it to whole blocks and check that the returned scales are finite (a non-finite scale
means non-finite input). Bounds hold up to float32 rounding of the operations (a few ulp of absmax).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

LINEAR_MAX_ERROR = 1 / 254  # |x - x'| / absmax for the linear code: half of one step of 1/127

# Adding 1.5 * 2**23 to a float32 of magnitude below 2**22 rounds it to an integer (to nearest, ties to even: what
# torch.round does) and leaves that integer, in two's complement, in the low bits of the sum; the low byte is the int8
# code. This turns the round and the float-to-int8 conversion into an add and an int32-to-int8 copy, which cost less.
_ROUNDING_OFFSET = 12582912.0
# Elements per step of the `_into` kernels. Encoding: 2**18 (a 1 MiB float32 temporary, which stays in a core's L2
# cache on the 2 MiB-L2 Xeon measured) was fastest among 2**16..2**20 on a (8, 128, 4096) float32 tensor, 1 and 2
# threads, by 1.4x over 2**20; smaller steps pay each torch operation's launch and thread wake-up more often. (On an
# earlier 2-core EPYC with a 512 KiB L2, 2**20 measured fastest.)
# Decoding needs no temporary for a float32 result and measured fastest with the largest steps tried, so its step
# only bounds the float32 temporary of a float16 / bfloat16 result: 2**22 elements, 16 MiB.
_QUANTIZE_CHUNK_ELEMENTS = 1 << 18
_DEQUANTIZE_CHUNK_ELEMENTS = 1 << 22

# Bucketing for the dynamic code: the top 16 bits of a float32 (sign, exponent, 7 mantissa bits) index a lookup
# table. A bucket is at most 2**-7 of its values wide, narrower than the spacing of the map's decision boundaries
# (>= 1% of the value: the map's finest relative steps are 0.9 / 64 near 1), so a bucket holds at most one boundary
# and one comparison finishes the search. A 65536-entry table stays in cache; tested in tests/unit/test_codec.py.
_DROPPED_BITS = 16
_BUCKETS = 1 << (32 - _DROPPED_BITS)


def dynamic_map() -> torch.Tensor:
    """The signed dynamic 8-bit quantization map: 256 distinct float32 values in [-1, 1], sorted ascending.

    Dynamic tree quantization as described by Dettmers et al. 2022: a code is 1 sign bit, then a run of e zero bits
    giving the decimal exponent 10**-e, then one indicator bit, then f = 6 - e bits of linear fraction. The fraction
    values are the centres of 2**f equal bins of [0.1, 1], so an exponent holds 2**f values and e = 0..6 give 127
    magnitudes per sign. The all-zero pattern is 0; its negative twin would repeat 0, so that code is +1 instead,
    which lets the largest element of a block decode exactly. Same values as bitsandbytes'
    `create_dynamic_map(signed=True)`: the code of a value is its index in this sorted table.
    """
    values = [np.zeros(1), np.ones(1)]
    for exponent in range(7):  # number of zero bits after the sign bit
        edges = np.linspace(0.1, 1.0, 2 ** (6 - exponent) + 1)
        centres = (edges[:-1] + edges[1:]) / 2 * 10.0**-exponent
        values += [centres, -centres]
    return torch.from_numpy(np.sort(np.concatenate(values)).astype(np.float32))


def _max_dynamic_error() -> float:
    table = dynamic_map().double()
    half_gaps = (table[1:] - table[:-1]) / 2
    # the map has +1 but not -1: a normalized -1 falls on the lowest value
    return max(float(half_gaps.max()), float(table[0] + 1), float(1 - table[-1]))


DYNAMIC_MAX_ERROR = _max_dynamic_error()  # about 0.0070313: half the top exponent's step of 0.9 / 64


@functools.lru_cache(maxsize=8)
def _dynamic_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(map, lowest candidate code per bucket, boundary per bucket): the map lives on `device` once per process."""
    table = dynamic_map()  # (256,)
    midpoints = (table[:-1] + table[1:]) / 2  # (255,) decision boundaries, as torch.bucketize sees them
    bits = np.arange(_BUCKETS, dtype=np.uint32) << _DROPPED_BITS  # (buckets,) first float32 pattern of each bucket
    first = torch.from_numpy(bits.view(np.float32))  # the bucket's end of smallest magnitude
    last = torch.from_numpy((bits | ((1 << _DROPPED_BITS) - 1)).view(np.float32))
    low = torch.minimum(first, last)  # negative buckets grow towards -inf
    high = torch.maximum(first, last)
    # buckets of inf/nan patterns give nan here; they are never looked up because inputs are finite
    low_code = torch.bucketize(low, midpoints)  # (buckets,)
    high_code = torch.bucketize(high, midpoints)
    boundary = torch.where(high_code > low_code, midpoints[low_code.clamp(max=254)], torch.tensor(float("inf")))
    return table.to(device), low_code.to(torch.uint8).to(device), boundary.to(device)


def _bucket(normalized: torch.Tensor) -> torch.Tensor:
    """Lookup-table index of each float32: its top 16 bits read as an unsigned number."""
    return (normalized.view(torch.int32) >> _DROPPED_BITS) & (_BUCKETS - 1)  # arithmetic shift, so mask the sign


def absmax(blocks: torch.Tensor) -> torch.Tensor:
    """Largest |x| per block of a float32 (blocks, block_size) tensor; nan or inf when the block holds one."""
    # amax and amin read the data without writing an |x| copy; both propagate nan
    return torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())  # (blocks,)


def quantize_linear(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear 8-bit codes of a float32 (blocks, block_size) tensor: q = round(127 * x / absmax) in [-127, 127].

    Returns (codes int8 (blocks, block_size), absmax float32 (blocks,)). A zero block has absmax 0 and codes 0.
    Error of `dequantize_linear`: |x - x'| <= absmax / 254 per block (half a step of absmax / 127).
    """
    scales = absmax(blocks)  # (blocks,)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    factor = 127 / safe  # (blocks,)
    if bool(torch.isfinite(factor).all()):
        # one multiply per element (a divide and a multiply cost 1.5x as much, measured); the block's largest
        # element lands within an ulp of +-127 and rounds to it, so constant blocks stay exact
        normalized = blocks * factor[:, None]  # (blocks, block_size) in [-127, 127]
    else:  # absmax so small (subnormal) that 127 / absmax overflows: divide first
        normalized = (blocks / safe[:, None]).mul_(127)
    codes = normalized.round_().to(torch.int8)
    return codes, scales


def dequantize_linear(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 (blocks, block_size) from int8 codes and per-block absmax: x' = q / 127 * absmax.

    Dividing first makes q = +-127 exactly +-1.0, so the block's absmax, and a constant block, come back unchanged.
    """
    return codes.to(torch.float32).div_(_one_twenty_seven(codes.device)).mul_(scales[:, None])


def _one_twenty_seven(device: torch.device) -> torch.Tensor:
    """127 as a tensor on `device`. CUDA divides by a Python number as a product with its float32 reciprocal, which
    rounds otherwise than division; by a device tensor it divides, as the CPU does: a payload decodes to the same
    bits on either device."""
    return torch.full((), 127.0, device=device)


# a block scale at least this large has a finite factor 127 / scale (at most half the float32 maximum)
_FINITE_FACTOR_SCALE = 2 * 127 / float(np.finfo(np.float32).max)


def _chunk_rows(block_size: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // block_size)


def quantize_linear_into(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    *,
    chunk_elements: int | None = None,
    fused: bool | None = None,
) -> float:
    """`quantize_linear` written into caller-owned buffers, in fewer passes: bit for bit the scales and codes that
    `quantize_linear` gives each block alone (given blocks whose factor overflows and others together, it divides
    them all first, which may round a code of the others otherwise).

    `blocks` is a contiguous float32, float16 or bfloat16 (blocks, block_size) tensor; `scales` a float32 (blocks,)
    and `codes` an int8 (blocks, block_size) tensor on the same device (views into one payload buffer, so the codec
    needs no concatenation). A non-finite element leaves a nan or inf scale and meaningless codes in its block: the
    caller checks the scales. Error bound as `quantize_linear`: |x - x'| <= absmax / 254 after `dequantize_linear`.

    On the CPU works in steps of about `chunk_elements` elements (default `_QUANTIZE_CHUNK_ELEMENTS`), so that no
    temporary as large as the input is allocated and a step's data is still in cache for its next operation; on a
    GPU in one step by default (each step's operations are kernel launches; a float32 temporary of the input's size
    is cheap there). Two passes over the steps: first |x| into the float32 temporary and its block maxima (an abs
    and an amax cost less than an amax and an amin, measured), then, after the factors 127 / absmax of all blocks at
    once, one multiply, one add of `_ROUNDING_OFFSET` and one copy into the codes, which round exactly as
    `quantize_linear` does (float32 product, then round half to even); computing the factors once instead of per
    step measured about 5% faster. Blocks whose factor overflows (absmax 0, or so
    small that 127 / absmax is inf) are redone afterwards with `quantize_linear`. Returns the largest scale (nan or
    inf for non-finite input), read from the device together with what the redo needs (one wait on a GPU).

    `fused` (default: on any device but the CPU) takes fewer passes over the data and fewer kernel launches, for
    the same scales and codes bit for bit: the block maxima in one reduction (the infinity norm of each block, which
    propagates nan as amax does) instead of |x| written to the temporary and read back, and the extremes the caller
    and the redo need from one min-and-max reduction of the scales instead of two maxima and a stack. The CPU's
    infinity norm is not vectorized (16x slower than abs then amax there, measured), so the CPU keeps the two passes.
    """
    rows, block_size = blocks.shape
    if fused is None:
        fused = blocks.device.type != "cpu"
    if chunk_elements is None:
        chunk_elements = _QUANTIZE_CHUNK_ELEMENTS if blocks.device.type == "cpu" else rows * block_size
    step = _chunk_rows(block_size, chunk_elements)
    work = torch.empty(min(step, rows), block_size, dtype=torch.float32, device=blocks.device)  # (step, block_size)
    if fused:
        torch.linalg.vector_norm(blocks, float("inf"), dim=1, dtype=torch.float32, out=scales)  # absmax per block
    else:
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            part, out = blocks[start:stop], work[: stop - start]  # (rows in step, block_size)
            # float16 / bfloat16 values are exact in float32, and multiplied in float32 as quantize_linear does
            magnitudes = torch.abs(part, out=out) if part.dtype == torch.float32 else out.copy_(part).abs_()
            torch.amax(magnitudes, dim=1, out=scales[start:stop])  # absmax; nan propagates
    factor = torch.reciprocal(scales).mul_(127)  # (blocks,) `127 / tensor` is torch's reciprocal times 127
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        out = work[: stop - start]
        torch.mul(blocks[start:stop], factor[start:stop, None], out=out).add_(_ROUNDING_OFFSET)  # see the offset
        codes[start:stop].copy_(out.view(torch.int32))  # keeps the low byte: two's complement wraps
    if fused:
        extremes = torch.empty(2, dtype=torch.float32, device=scales.device)
        torch.aminmax(scales, out=(extremes[0], extremes[1]))
        lowest, highest = extremes.tolist()
        # every factor is finite when the least scale is at least _FINITE_FACTOR_SCALE; below it (or nan), the
        # factors themselves say which blocks to redo, as in the other branch
        redo_some = not lowest >= _FINITE_FACTOR_SCALE
    else:
        if scales.device.type == "cpu":
            highest, most = float(scales.max()), float(factor.max())
        else:
            highest, most = torch.stack([scales.max(), factor.max()]).tolist()
        redo_some = not math.isfinite(most)
    if redo_some:  # inf: a zero or tiny absmax (nan: non-finite input, the caller refuses)
        redo = torch.isinf(factor).nonzero().view(-1)  # (blocks to redo,)
        codes[redo] = quantize_linear(blocks[redo].to(torch.float32))[0]
    return highest


def dequantize_linear_into(
    codes: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    chunk_elements: int = _DEQUANTIZE_CHUNK_ELEMENTS,
    fused: bool | None = None,
) -> torch.Tensor:
    """`dequantize_linear` written into `out`, bit for bit the same values, converted to `out`'s dtype; returns `out`.

    `codes` int8 (blocks, block_size), `scales` float32 (blocks,), `out` a float32, float16 or bfloat16
    (blocks, block_size) tensor, all on one device. Per step of about `chunk_elements` elements: convert, divide by
    127, multiply by the scale; a float16 / bfloat16 `out` takes each step through a float32 temporary of that size.
    `fused` (default: on any device but the CPU) converts the codes inside the division, a pass fewer over the
    data; the CPU would convert them into a temporary of the step's size anyway (a division of int8 by float32
    casts its input first there), so it keeps the copy into `out`.
    """
    if fused is None:
        fused = out.device.type != "cpu"
    rows, block_size = codes.shape
    step = _chunk_rows(block_size, chunk_elements)
    work = out if out.dtype == torch.float32 else torch.empty(min(step, rows), block_size, device=out.device)
    divisor = _one_twenty_seven(out.device)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        target = work[start:stop] if work is out else work[: stop - start]  # (rows in step, block_size)
        if fused:  # the codes converted as they are divided: one pass, the values of a copy then a division
            torch.div(codes[start:stop], divisor, out=target).mul_(scales[start:stop, None])
        else:
            target.copy_(codes[start:stop]).div_(divisor).mul_(scales[start:stop, None])
        if work is not out:
            out[start:stop].copy_(target)  # one rounding to the output dtype, as dequantize_linear(...).to(dtype)
    return out


def dynamic_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Per-block scale for the dynamic code: the block's element of largest magnitude, sign included.

    The map holds +1 but not -1, so a scale carrying the sign maps that element to +1 and decodes it exactly; |scale|
    is the block's absmax. Returns float32 (blocks,), nan or inf when the block holds one.
    """
    highest = blocks.amax(dim=1)  # (blocks,)
    lowest = blocks.amin(dim=1)
    return torch.where(highest >= -lowest, highest, lowest)


def quantize_dynamic(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic 8-bit codes of a float32 (blocks, block_size) tensor: index of the nearest `dynamic_map` value.

    code = argmin_k |x / scale - map[k]| with scale from `dynamic_scales`: the block-wise quantization of Dettmers
    et al. 2022 with their dynamic map. Deviation: the scale carries the sign of the block's largest element (they
    use absmax), which makes that element exact although the map lacks -1. Returns (codes uint8
    (blocks, block_size), scales float32 (blocks,)). Error of `dequantize_dynamic`: |x - x'| <= DYNAMIC_MAX_ERROR *
    absmax per block. Same codes as torch.bucketize on the map's midpoints, without its per-element binary search.
    """
    _, candidate, boundary = _dynamic_tables(blocks.device)
    scales = dynamic_scales(blocks)  # (blocks,)
    safe = torch.where(scales != 0, scales, torch.ones_like(scales))
    normalized = (blocks / safe[:, None]).view(-1)  # (blocks * block_size,) in [-1, 1]
    bucket = _bucket(normalized)
    codes = candidate.index_select(0, bucket)  # nearest value for the bucket's lower end
    codes += normalized > boundary.index_select(0, bucket)  # past the bucket's one boundary: next value up
    return codes.view(blocks.shape), scales


def dequantize_dynamic(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 (blocks, block_size) from uint8 codes and per-block signed scales: x' = map[q] * scale."""
    table = _dynamic_tables(codes.device)[0]
    # int32 indices: an int64 copy of a large tensor costs more than the lookup
    values = table.index_select(0, codes.view(-1).to(torch.int32))  # (blocks * block_size,)
    return values.view(codes.shape).mul_(scales[:, None])


__all__ = [
    "DYNAMIC_MAX_ERROR",
    "LINEAR_MAX_ERROR",
    "absmax",
    "dequantize_dynamic",
    "dequantize_linear",
    "dequantize_linear_into",
    "dynamic_map",
    "dynamic_scales",
    "quantize_dynamic",
    "quantize_linear",
    "quantize_linear_into",
]
