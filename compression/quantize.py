"""Block-wise 8-bit quantization kernels for hidden states (pure torch: tensors in, tensors out, no I/O).

Both schemes are from Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022): the input is cut
into blocks, each block is normalized by its own absolute maximum (one float32 scale per block), and every element
becomes one byte.

- linear (`quantize_linear`): q = round(127 * x / absmax), x' = q / 127 * absmax, so |x - x'| <= absmax / 254.
- dynamic (`quantize_dynamic`): x / scale is replaced by the nearest of the 256 values of the dynamic map
  (`dynamic_map`), x' = map[q] * scale, so |x - x'| <= DYNAMIC_MAX_ERROR * absmax. The map is fine near zero and
  coarse near one, which keeps small elements of a block that also holds an outlier.

Callers flatten the input, pad it to whole blocks and check that the returned scales are finite (a non-finite scale
means non-finite input). Bounds hold up to float32 rounding of the operations (a few ulp of absmax).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

LINEAR_MAX_ERROR = 1 / 254  # |x - x'| / absmax for the linear code: half of one step of 1/127

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
    return codes.to(torch.float32).div_(127).mul_(scales[:, None])


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
    "dynamic_map",
    "dynamic_scales",
    "quantize_dynamic",
    "quantize_linear",
]
