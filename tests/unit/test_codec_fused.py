"""The blockwise8 kernels a GPU runs (`fused`: fewer passes and launches) against the CPU's, both run here on the
CPU: the same scales, codes, extremes and decoded values bit for bit, whatever the values (zeros, subnormal and tiny
blocks that need the redo, nan and inf)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.compression.codec import _extremes
from nesa_node.compression.quantize import dequantize_linear_into, quantize_linear, quantize_linear_into

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SPECIALS = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 1e-39, 3e-36, 2e-36, 1e-30, 3.4e38]


def _blocks(seed: int, rows: int, block_size: int, dtype, specials: list[tuple[int, float]], tiny_rows: list[int]):
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randn(rows, block_size, generator=generator)
    for row in tiny_rows:  # a block of tiny values: 127 / absmax overflows unless the block is redone
        blocks[row % rows] *= 1e-38
    flat = blocks.view(-1)
    for index, value in specials:
        flat[index % flat.numel()] = value
    return blocks.to(dtype)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 40),
    block_size=st.sampled_from([16, 17, 64]),
    dtype=st.sampled_from(DTYPES),
    specials=st.lists(st.tuples(st.integers(0, 5000), st.sampled_from(SPECIALS)), max_size=4),
    tiny_rows=st.lists(st.integers(0, 50), max_size=3),
    zero_rows=st.lists(st.integers(0, 50), max_size=2),
)
def test_fused_quantizing_gives_the_same_scales_codes_and_largest_scale(
    seed, rows, block_size, dtype, specials, tiny_rows, zero_rows
):
    blocks = _blocks(seed, rows, block_size, dtype, specials, tiny_rows)
    for row in zero_rows:
        blocks[row % rows] = 0
    results = []
    for fused in (True, False):
        scales = torch.empty(rows, dtype=torch.float32)
        codes = torch.empty(rows, block_size, dtype=torch.int8)
        highest = quantize_linear_into(blocks, scales, codes, fused=fused, chunk_elements=block_size * 7)
        results.append((scales, codes, highest))
    (scales, codes, highest), (scales_, codes_, highest_) = results
    assert scales.view(torch.int32).tolist() == scales_.view(torch.int32).tolist()  # nan bits included
    assert _same(highest, highest_)
    finite = torch.isfinite(scales)  # a non-finite block's codes are meaningless (the codec refuses it)
    assert torch.equal(codes[finite], codes_[finite])
    if bool(finite.all()):  # and both are quantize_linear's codes of each block
        each = [quantize_linear(row[None].to(torch.float32))[0] for row in blocks]
        assert torch.equal(codes, torch.cat(each))


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 30),
    block_size=st.sampled_from([16, 64]),
    out_dtype=st.sampled_from(DTYPES),
    chunk_rows=st.integers(1, 8),
)
def test_fused_dequantizing_gives_the_same_values(seed, rows, block_size, out_dtype, chunk_rows):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, block_size), dtype=torch.int8, generator=generator)
    scales = torch.rand(rows, generator=generator) * 10 ** torch.randint(-30, 30, (rows,), generator=generator)
    outs = [
        dequantize_linear_into(
            codes, scales, torch.empty(rows, block_size, dtype=out_dtype), chunk_elements=chunk_rows * block_size,
            fused=fused,
        )
        for fused in (True, False)
    ]  # fmt: skip
    assert torch.equal(outs[0].view(-1).view(torch.uint8), outs[1].view(-1).view(torch.uint8))


@settings(max_examples=120, deadline=None)
@given(
    scales=st.lists(st.one_of(st.floats(width=32), st.sampled_from(SPECIALS)), min_size=1, max_size=20),
    codes=st.one_of(st.none(), st.lists(st.integers(-128, 127), min_size=1, max_size=40)),
)
def test_fused_extremes_are_the_three_reductions(scales, codes):
    scale_tensor = torch.tensor(scales, dtype=torch.float32)
    code_tensor = None if codes is None else torch.tensor(codes, dtype=torch.int8)
    fused = _extremes(scale_tensor, code_tensor, fused=True)
    plain = _extremes(scale_tensor, code_tensor, fused=False)
    assert all(_same(a, b) for a, b in zip(fused, plain, strict=True)), (fused, plain)
    assert isinstance(fused[2], int)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rows", [[0], [1], [2], [3], [0, 1], [0, 2], [0, 3], [0, 1, 2, 3]])
def test_blocks_near_the_overflow_of_the_factor_quantize_as_quantize_linear_does(fused, rows):
    # 127 / absmax overflows float32 below an absmax of about 3.7e-37: such blocks (and zero blocks) are redone
    # row 3: a factor that stays finite, below the fused path's threshold (it looks for blocks to redo, finds none)
    every = torch.tensor(
        [[3e-36, -1e-36, 0.0, 2e-36], [3e-37, -1e-37, 2e-37, 0.0], [0.0, 0.0, 0.0, 0.0], [5e-37, -2.5e-37, 1e-37, 0.0]]
    )
    blocks = every[rows]
    scales, codes = torch.empty(len(rows)), torch.empty(len(rows), 4, dtype=torch.int8)
    quantize_linear_into(blocks, scales, codes, fused=fused)
    assert torch.equal(codes, torch.cat([quantize_linear(row[None])[0] for row in blocks]))  # each block's own
    expected = {0: [127, -42, 0, 85], 1: [127, -42, 85, 0], 2: [0, 0, 0, 0], 3: [127, -63, 25, 0]}
    assert codes.tolist() == [expected[row] for row in rows]


def _quantized(blocks: torch.Tensor, fused: bool | None = None):
    scales = torch.empty(blocks.shape[0], dtype=torch.float32, device=blocks.device)
    codes = torch.empty(blocks.shape, dtype=torch.int8, device=blocks.device)
    highest = quantize_linear_into(blocks, scales, codes, fused=fused)
    return scales.cpu(), codes.cpu(), highest


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("special", [None, float("nan"), float("inf")])
def test_the_gpus_fused_kernels_give_the_cpus_bytes(dtype, special):
    blocks = _blocks(7, 300, 64, dtype, [] if special is None else [(5 * 64 + 3, special)], [3, 200])
    blocks[10] = 0
    scales, codes, highest = _quantized(blocks, fused=False)
    scales_, codes_, highest_ = _quantized(blocks.cuda())  # fused, the default on a GPU
    assert scales.view(torch.int32).tolist() == scales_.view(torch.int32).tolist()
    assert _same(highest, highest_) and (special is None) == math.isfinite(highest_)
    finite = torch.isfinite(scales)
    assert torch.equal(codes[finite], codes_[finite])
    # the decoder's checks see the same least and largest scale (the codes of a nan block differ: nan's bits do)
    extremes = _extremes(scales, codes, fused=False)[:2]
    extremes_ = _extremes(scales_.cuda(), codes_.cuda(), fused=True)[:2]
    assert all(_same(a, b) for a, b in zip(extremes, extremes_, strict=True))
    if special is None:
        decoded = dequantize_linear_into(codes, scales, torch.empty(blocks.shape, dtype=dtype), fused=False)
        decoded_ = dequantize_linear_into(codes_.cuda(), scales_.cuda(), torch.empty(blocks.shape, dtype=dtype).cuda())
        assert torch.equal(decoded.view(-1).view(torch.uint8), decoded_.cpu().view(-1).view(torch.uint8))
        assert _extremes(scales, codes, fused=False) == _extremes(scales_.cuda(), codes_.cuda(), fused=True)
