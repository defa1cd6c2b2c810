import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.compression.codec import (
    CODECS,
    DEFAULT_CODEC,
    SMALL_CHECK_ELEMENTS,
    CodecError,
    EncodedTensor,
    all_finite,
    decode,
    encode,
    encode_on_device,
    wire_bytes,
)
from nesa_node.compression.names import AUTO_CODEC
from nesa_node.compression.quantize import (
    DYNAMIC_MAX_ERROR,
    LINEAR_MAX_ERROR,
    dequantize_dynamic,
    dequantize_linear,
    dequantize_linear_into,
    dynamic_map,
    quantize_dynamic,
    quantize_linear,
    quantize_linear_into,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LOSSY = [codec for codec in CODECS if codec != "none"]
BLOCK_CODECS = ["blockwise8", "dynamic8"]
BLOCK_BOUND = {"blockwise8": LINEAR_MAX_ERROR, "dynamic8": DYNAMIC_MAX_ERROR}
FLOAT32_ROUNDING = 4 * torch.finfo(torch.float32).eps  # a few roundings of the normalize / scale steps
FEW = settings(max_examples=50, deadline=None)

shapes = st.lists(st.integers(0, 5), min_size=1, max_size=4)
seeds = st.integers(0, 2**16)
block_sizes = st.sampled_from([16, 17, 64, 100])
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)  # subnormals and float32 max included


def _randn(shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _block_absmax(tensor: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-element absmax of the element's block, shaped like the flattened tensor."""
    flat = tensor.to(torch.float32).reshape(-1)
    blocks = -(-flat.numel() // block_size)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_size - flat.numel()))
    return padded.view(blocks, block_size).abs().amax(dim=1).repeat_interleave(block_size)[: flat.numel()]


def _assert_block_bound(tensor, decoded, codec, block_size):
    absmax = _block_absmax(tensor, block_size)
    error = (decoded.to(torch.float32) - tensor.to(torch.float32)).abs().reshape(-1)
    # a float16 / bfloat16 result adds one rounding of the decoded value, itself at most absmax
    rounding = FLOAT32_ROUNDING if tensor.dtype == torch.float32 else torch.finfo(tensor.dtype).eps
    assert bool((error <= absmax * (BLOCK_BOUND[codec] + rounding)).all()), float((error / absmax).nan_to_num().max())


@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=seeds)
def test_roundtrip_is_exact(shape, dtype, seed):
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    decoded = decode(encode(tensor))
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


@FEW
@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=seeds, codec=st.sampled_from(["fp16", "bf16"]))
def test_half_codecs_round_once_and_restore_the_dtype(shape, dtype, seed, codec):
    tensor = _randn(shape, seed, dtype, scale=100.0)
    wire_dtype = torch.float16 if codec == "fp16" else torch.bfloat16
    decoded = decode(encode(tensor, codec))
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor.to(wire_dtype).to(dtype))


@FEW
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    seed=seeds,
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]),
    codec=st.sampled_from(BLOCK_CODECS),
    block_size=block_sizes,
)
def test_block_codecs_stay_within_the_per_block_bound(shape, dtype, seed, scale, codec, block_size):
    tensor = _randn(shape, seed, dtype, scale)
    decoded = decode(encode(tensor, codec, block_size=block_size))
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    _assert_block_bound(tensor, decoded, codec, block_size)


@FEW
@given(values=st.lists(finite32, min_size=1, max_size=300), codec=st.sampled_from(BLOCK_CODECS), block_size=block_sizes)
def test_block_bound_holds_for_any_float32(values, codec, block_size):
    tensor = torch.tensor(values, dtype=torch.float32)
    _assert_block_bound(tensor, decode(encode(tensor, codec, block_size=block_size)), codec, block_size)


def test_block_bounds_are_reached():
    # a dense grid in [-1, 1] with one block scale of 1 must come close to the stated bound, and not exceed it
    grid = torch.linspace(-1, 1, 64 * 4001)
    grid.view(-1, 64)[:, 0] = 1.0  # every block's absmax is 1
    for codec, bound in BLOCK_BOUND.items():
        error = (decode(encode(grid, codec)) - grid).abs().max().item()
        assert 0.98 * bound <= error <= bound * (1 + 1e-5), (codec, error, bound)


def test_error_bounds_have_their_values():
    assert LINEAR_MAX_ERROR == 1 / 254
    assert DYNAMIC_MAX_ERROR == pytest.approx(0.9 / 64 / 2, rel=1e-5)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_are_exact(codec, dtype):
    tensor = torch.zeros(3, 100, dtype=dtype)
    decoded = decode(encode(tensor, codec))
    assert decoded.dtype == dtype and torch.equal(decoded, tensor)


@FEW
@given(
    constants=st.lists(finite32.filter(lambda value: value != 0), min_size=1, max_size=6),
    codec=st.sampled_from(BLOCK_CODECS),
    block_size=block_sizes,
)
def test_constant_blocks_are_exact(constants, codec, block_size):
    tensor = torch.tensor(constants, dtype=torch.float32).repeat_interleave(block_size)  # one constant per block
    assert torch.equal(decode(encode(tensor, codec, block_size=block_size)), tensor)


@pytest.mark.parametrize("codec", BLOCK_CODECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_constant_half_blocks_are_exact(codec, dtype):
    tensor = torch.tensor([-3.5, 0.0, 2.0**-20, 1000.0], dtype=dtype).repeat_interleave(64).view(4, 64)
    assert torch.equal(decode(encode(tensor, codec)), tensor)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (2, 0, 5), (0, 4096)])
def test_empty_tensors_roundtrip(codec, dtype, shape):
    encoded = encode(torch.empty(shape, dtype=dtype), codec)
    assert encoded.payload == b"" and wire_bytes(codec, shape, dtype) == 0
    decoded = decode(encoded)
    assert decoded.shape == shape and decoded.dtype == dtype


@pytest.mark.parametrize("codec", BLOCK_CODECS)
def test_scalar_and_partial_block_shapes_restore(codec):
    assert torch.equal(decode(encode(torch.tensor(-2.5), codec)), torch.tensor(-2.5))
    tensor = torch.arange(1.0, 131.0).view(2, 5, 13)  # 130 elements: two blocks of 64 and a block of 2
    decoded = decode(encode(tensor, codec))
    assert decoded.shape == tensor.shape
    _assert_block_bound(tensor, decoded, codec, 64)
    assert torch.equal(decoded.view(-1)[-1], tensor.view(-1)[-1])  # the last block's absmax is exact


@FEW
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    seed=seeds,
    bad=st.sampled_from([math.nan, math.inf, -math.inf]),
    codec=st.sampled_from(LOSSY),
    dtype=st.sampled_from(DTYPES),
)
def test_lossy_codecs_refuse_non_finite_input(shape, seed, bad, codec, dtype):
    tensor = _randn(shape, seed, dtype)
    tensor.view(-1)[seed % tensor.numel()] = bad
    with pytest.raises(CodecError, match="nan or inf"):
        encode(tensor, codec)


def test_none_passes_non_finite_values_through():
    tensor = torch.tensor([1.0, math.nan, math.inf])
    decoded = decode(encode(tensor, "none"))
    assert not all_finite(decoded) and torch.equal(decoded.isnan(), tensor.isnan()) and decoded[2] == math.inf


@pytest.mark.parametrize(("codec", "value"), [("fp16", 65520.0), ("fp16", -1e6), ("bf16", 3.4e38)])
def test_half_codecs_refuse_values_beyond_their_range(codec, value):
    with pytest.raises(CodecError, match="range"):
        encode(torch.tensor([1.0, value]), codec)
    assert torch.equal(decode(encode(torch.tensor([65504.0]), "fp16")), torch.tensor([65504.0]))


def test_all_finite_is_exact_even_when_a_sum_overflows():
    assert all_finite(torch.full((8,), 3e38)) and all_finite(torch.full((100,), 60000.0, dtype=torch.float16))
    assert all_finite(torch.empty(0))
    for bad in (math.nan, math.inf, -math.inf):
        assert not all_finite(torch.tensor([1.0, bad, 2.0]))
        assert not all_finite(torch.tensor([1.0, bad], dtype=torch.bfloat16))


@settings(max_examples=60, deadline=None)
@given(
    size=st.sampled_from([1, 7, 512, SMALL_CHECK_ELEMENTS, SMALL_CHECK_ELEMENTS + 1]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    bad=st.sampled_from([None, math.nan, math.inf, -math.inf]),
    where=st.floats(0, 1, exclude_max=True),
    strided=st.booleans(),
    grad=st.booleans(),
)
def test_all_finite_agrees_with_an_elementwise_check_on_every_path(size, dtype, bad, where, strided, grad):
    """Small CPU tensors are checked by numpy, others by torch: both give torch.isfinite(...).all(), on views with
    strides and on tensors that require grad too."""
    tensor = torch.linspace(-1e4, 1e4, 2 * size, dtype=torch.float64).to(dtype)
    if bad is not None:
        tensor[int(where * 2 * size)] = bad
    tensor = tensor[::2] if strided else tensor[:size]  # a strided view sees the even elements only
    if grad:
        tensor = tensor.clone().requires_grad_(True)
    assert all_finite(tensor) == bool(torch.isfinite(tensor.detach()).all())


def test_all_finite_on_every_bfloat16_value_agrees_with_torch():
    """bfloat16, which numpy does not hold, is checked on its bits: every one of the 65,536 values alone."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = torch.isfinite(every).tolist()
    assert [all_finite(every[index : index + 1]) for index in range(every.numel())] == finite
    assert finite.count(False) == 2 * (1 << 7)  # +-inf and every nan: the all-ones exponent with any mantissa


def test_payload_must_match_shape():
    encoded = encode(torch.ones(2, 3))
    with pytest.raises(CodecError, match="needs 24"):
        decode(EncodedTensor("none", "float32", (2, 3), encoded.payload[:-4]))
    with pytest.raises(CodecError, match="needs"):
        decode(EncodedTensor("none", "float32", (3, 3), encoded.payload))


@pytest.mark.parametrize("codec", LOSSY)
def test_payload_length_of_lossy_codecs_is_checked(codec):
    encoded = encode(torch.ones(3, 70), codec)
    for payload in (encoded.payload[:-1], encoded.payload + b"\0", b""):
        with pytest.raises(CodecError, match="needs"):
            decode(EncodedTensor(codec, "float32", (3, 70), payload, encoded.params))
    with pytest.raises(CodecError, match="needs"):
        decode(EncodedTensor(codec, "float32", (3, 71), encoded.payload, encoded.params))


def test_limits_rank_and_dtypes_are_enforced():
    encoded = encode(torch.ones(4, 4))
    with pytest.raises(CodecError, match="limit"):
        decode(encoded, max_elements=15)
    with pytest.raises(CodecError, match="rank 3"):
        decode(encoded, rank=3)
    with pytest.raises(CodecError, match="not allowed"):
        decode(encoded, allowed_dtypes=("float16",))
    with pytest.raises(CodecError, match="not allowed"):
        decode(EncodedTensor("none", "int64", (1,), b"\0" * 8))
    with pytest.raises(CodecError, match="unknown codec"):
        decode(EncodedTensor("zip", "float32", (1,), b"\0" * 4))
    with pytest.raises(CodecError, match="negative"):
        decode(EncodedTensor("none", "float32", (-1, -4), b""))


@pytest.mark.parametrize("codec", LOSSY)
def test_peer_limits_apply_to_every_codec(codec):
    encoded = encode(torch.ones(4, 16), codec)
    with pytest.raises(CodecError, match="limit"):
        decode(encoded, max_elements=63)
    with pytest.raises(CodecError, match="rank 3"):
        decode(encoded, rank=3)
    with pytest.raises(CodecError, match="not allowed"):
        decode(encoded, allowed_dtypes=("float16",))
    with pytest.raises(CodecError, match="not allowed"):
        decode(EncodedTensor(codec, "int8", encoded.shape, encoded.payload, encoded.params))
    with pytest.raises(CodecError, match="negative"):
        decode(EncodedTensor(codec, "float32", (-4, -16), encoded.payload, encoded.params))
    with pytest.raises(CodecError, match="limit"):
        decode(EncodedTensor(codec, "float32", (2**31, 2**31), b"", encoded.params), max_elements=1 << 20)
    with pytest.raises(CodecError, match="integers"):
        decode(EncodedTensor(codec, "float32", (4.0, 16), encoded.payload, encoded.params))


def test_huge_declared_shape_is_rejected_before_allocating():
    with pytest.raises(CodecError, match="limit"):
        decode(EncodedTensor("none", "float32", (2**31, 2**31), b""), max_elements=1 << 20)


@pytest.mark.parametrize(
    ("codec", "params", "match"),
    [
        ("blockwise8", (("block_size", 15),), "outside"),
        ("dynamic8", (("block_size", 4097),), "outside"),
        ("blockwise8", (("block_size", "64"),), "integer"),
        ("blockwise8", (("block_size", 64.0),), "integer"),
        ("dynamic8", (("block_size", True),), "integer"),
        ("blockwise8", (("block_size", 64), ("block_size", 64)), "twice"),
        ("dynamic8", (("bits", 4),), "no parameter"),
        ("none", (("block_size", 64),), "no parameter"),
        ("fp16", ((1, 2),), "no parameter"),
        ("blockwise8", (("block_size",),), "pairs"),
        ("blockwise8", 64, "pairs"),
    ],
)
def test_bad_codec_parameters_are_rejected(codec, params, match):
    encoded = encode(torch.ones(2, 64), codec)
    with pytest.raises(CodecError, match=match):
        decode(EncodedTensor(codec, "float32", (2, 64), encoded.payload, params))


def test_encode_rejects_unknown_codecs_and_parameters():
    tensor = torch.ones(2, 64)
    with pytest.raises(CodecError, match="unknown codec"):
        encode(tensor, "zip")
    with pytest.raises(CodecError, match="outside"):
        encode(tensor, "blockwise8", block_size=8)
    with pytest.raises(CodecError, match="no parameter"):
        encode(tensor, "fp16", block_size=64)
    with pytest.raises(CodecError, match="no parameter"):
        encode(tensor, "dynamic8", blocksize=64)


def test_parameters_are_recorded_and_used():
    tensor = _randn((3, 1000), 1)
    encoded = encode(tensor, "dynamic8", block_size=128)
    assert encoded.params == (("block_size", 128),)
    assert len(encoded.payload) == 3000 + 4 * 24
    assert encode(tensor, "blockwise8").params == (("block_size", 64),) and encode(tensor).params == ()
    # a mapping from a peer works like pairs; missing parameters take their defaults
    as_mapping = EncodedTensor("dynamic8", "float32", (3, 1000), encoded.payload, {"block_size": 128})
    assert torch.equal(decode(as_mapping), decode(encoded))
    default = encode(tensor, "blockwise8")
    assert torch.equal(decode(EncodedTensor("blockwise8", "float32", (3, 1000), default.payload)), decode(default))


def _with_scale(encoded: EncodedTensor, scale: float) -> EncodedTensor:
    payload = struct.pack("<f", scale) + encoded.payload[4:]
    return EncodedTensor(encoded.codec, encoded.dtype, encoded.shape, payload, encoded.params)


@pytest.mark.parametrize("codec", BLOCK_CODECS)
def test_bad_scales_from_a_peer_are_rejected(codec):
    encoded = encode(torch.ones(2, 64), codec)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(CodecError, match="finite"):
            decode(_with_scale(encoded, bad))
    half = encode(torch.ones(2, 64, dtype=torch.float16), codec)
    with pytest.raises(CodecError, match="range"):
        decode(_with_scale(half, 1e6))
    assert torch.equal(decode(_with_scale(half, 2.0))[0], torch.full((64,), 2.0, dtype=torch.float16))


def test_scale_signs():
    blockwise = encode(torch.ones(64), "blockwise8")
    with pytest.raises(CodecError, match=">= 0"):
        decode(_with_scale(blockwise, -1.0))
    # dynamic8 scales carry the sign of the block's largest element
    dynamic = encode(torch.full((64,), -2.0), "dynamic8")
    assert struct.unpack("<f", dynamic.payload[:4])[0] == -2.0
    assert torch.equal(decode(_with_scale(dynamic, 3.0)), torch.full((64,), 3.0))


def test_linear_code_minus_128_is_rejected():
    encoded = encode(torch.ones(64), "blockwise8")
    payload = encoded.payload[:4] + b"\x80" + encoded.payload[5:]
    with pytest.raises(CodecError, match="-128"):
        decode(EncodedTensor("blockwise8", "float32", (64,), payload, encoded.params))


@FEW
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    codec=st.sampled_from(CODECS),
    block_size=block_sizes,
)
def test_wire_bytes_matches_the_payload(shape, dtype, codec, block_size):
    params = {"block_size": block_size} if codec in BLOCK_CODECS else {}
    encoded = encode(torch.ones(shape, dtype=dtype), codec, **params)
    assert wire_bytes(codec, tuple(shape), dtype, **params) == len(encoded.payload)
    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    assert wire_bytes(codec, tuple(shape), name, **params) == len(encoded.payload)


def test_wire_bytes_validates():
    with pytest.raises(CodecError, match="unknown codec"):
        wire_bytes("zip", (4,))
    with pytest.raises(CodecError, match="negative"):
        wire_bytes("none", (-1,))
    with pytest.raises(CodecError, match="cannot be sent"):
        wire_bytes("none", (4,), "int64")
    with pytest.raises(CodecError, match="outside"):
        wire_bytes("blockwise8", (4,), block_size=1)


def test_block_codecs_shrink_a_hidden_state():
    shape = (1, 1, 4096)
    sizes = {codec: len(encode(_randn(shape, 0), codec).payload) for codec in CODECS}
    assert sizes == {"none": 16384, "fp16": 8192, "bf16": 8192, "blockwise8": 4352, "dynamic8": 4352}
    assert sizes["none"] / sizes["blockwise8"] > 3.7 and sizes["fp16"] / sizes["blockwise8"] > 1.85
    assert DEFAULT_CODEC == "auto" and AUTO_CODEC in CODECS


def test_dynamic_map_golden_values():
    table = dynamic_map()
    assert table.dtype == torch.float32 and table.shape == (256,)
    assert bool((table[1:] > table[:-1]).all())
    assert table[0].item() == pytest.approx(-0.99296875) and table[-1].item() == 1.0 and table[127].item() == 0.0
    assert table[128].item() == pytest.approx(0.55e-6) and table[126].item() == pytest.approx(-0.55e-6)
    assert table[129].item() == pytest.approx(3.25e-6) and table[-2].item() == pytest.approx(0.99296875)
    # 64 values per sign in [0.1, 1), then 32, 16, ... 1 per lower decade: 7 exponents, 127 magnitudes
    positive = table[table > 0][:-1].double()
    counts = [int(((positive >= 10.0 ** -(e + 1)) & (positive < 10.0**-e)).sum()) for e in range(7)]
    assert counts == [64, 32, 16, 8, 4, 2, 1]
    assert torch.equal(table[:127], -positive.flip(0).float())
    assert float(table.double().sum()) == pytest.approx(1.0, abs=1e-6)


def test_dynamic_map_matches_bitsandbytes():
    functional = pytest.importorskip("bitsandbytes.functional")
    reference = functional.create_dynamic_map(signed=True).cpu().float()
    torch.testing.assert_close(dynamic_map(), reference, rtol=1e-6, atol=0.0)


def _nearest_reference(values: torch.Tensor) -> torch.Tensor:
    table = dynamic_map()
    return torch.bucketize(values, (table[:-1] + table[1:]) / 2)


def test_dynamic_codes_are_the_nearest_map_value():
    table = dynamic_map()
    midpoints = (table[:-1] + table[1:]) / 2
    edges = torch.cat(
        [
            table,
            midpoints,
            torch.nextafter(midpoints, torch.tensor(2.0)),
            torch.nextafter(midpoints, torch.tensor(-2.0)),
            torch.linspace(-1, 1, 64 * 300),
            torch.logspace(-9, 0, 2000),
            -torch.logspace(-9, 0, 2000),
            torch.tensor([0.0, -0.0, 1e-45, -1e-45, -1.0]),
        ]
    )
    edges = edges[edges.abs() <= 1]
    blocks = torch.nn.functional.pad(edges, (0, -edges.numel() % 63)).view(-1, 63)
    blocks = torch.cat([torch.ones(blocks.shape[0], 1), blocks], dim=1)  # scale 1: the codes see the values as is
    codes, scales = quantize_dynamic(blocks)
    assert bool((scales == 1).all())
    assert torch.equal(codes.long(), _nearest_reference(blocks))
    assert torch.equal(dequantize_dynamic(codes, scales), table[codes.long()])


@FEW
@given(values=st.lists(st.floats(-1, 1, width=32), min_size=1, max_size=200))
def test_dynamic_codes_match_bucketize_for_any_value(values):
    blocks = torch.tensor([1.0, *values]).view(1, -1)
    codes, _ = quantize_dynamic(blocks)
    assert torch.equal(codes.long(), _nearest_reference(blocks))


def test_decode_to_a_device_argument():
    tensor = _randn((2, 100), 3)
    for codec in CODECS:
        decoded = decode(encode(tensor, codec), device="cpu")
        assert decoded.device.type == "cpu" and decoded.shape == tensor.shape


@FEW
@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=seeds, codec=st.sampled_from(CODECS), block_size=block_sizes)
def test_a_payload_kept_on_the_device_is_the_wire_payload(shape, dtype, seed, codec, block_size):
    tensor = _randn(shape, seed, dtype, scale=3.0)
    params = {"block_size": block_size} if codec in BLOCK_CODECS else {}
    on_device, wire = encode_on_device(tensor, codec, **params), encode(tensor, codec, **params)
    assert isinstance(on_device.payload, torch.Tensor) and on_device.payload.dtype == torch.uint8
    assert on_device.payload.numpy().tobytes() == wire.payload
    assert (on_device.codec, on_device.dtype, on_device.shape, on_device.params) == (
        wire.codec,
        wire.dtype,
        wire.shape,
        wire.params,
    )
    decoded = decode(on_device, device=tensor.device)
    assert decoded.dtype == tensor.dtype and torch.equal(decoded, decode(wire))
    if codec == "none" and tensor.numel():  # the payload may view the tensor; the decoded tensor never does
        assert decoded.data_ptr() != tensor.data_ptr()


def test_a_payload_tensor_is_checked_like_bytes():
    encoded = encode_on_device(torch.ones(2, 64), "blockwise8")
    for bad in (encoded.payload.view(2, -1), encoded.payload.to(torch.int8), encoded.payload[::2], encoded.payload[1:]):
        with pytest.raises(CodecError):
            decode(EncodedTensor("blockwise8", "float32", (2, 64), bad, encoded.params))
    payload = encoded.payload.clone()
    payload[:4] = torch.tensor([math.nan]).view(torch.uint8)
    with pytest.raises(CodecError, match="finite"):
        decode(EncodedTensor("blockwise8", "float32", (2, 64), payload, encoded.params))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", CODECS)
def test_a_payload_stays_on_the_gpu_and_decodes_there(codec):
    tensor = _randn((8, 128, 512), 6, scale=3.0).cuda()
    on_device = encode_on_device(tensor, codec)
    assert on_device.payload.is_cuda
    assert on_device.payload.cpu().numpy().tobytes() == encode(tensor.cpu(), codec).payload
    decoded = decode(on_device, device="cuda")
    assert decoded.is_cuda and torch.equal(decoded.cpu(), decode(encode(tensor.cpu(), codec)))
    if codec in BLOCK_CODECS:  # the checks of a payload on the GPU (one transfer of its extremes)
        payload = on_device.payload.clone()
        payload[:4] = torch.tensor([math.inf]).view(torch.uint8).cuda()
        with pytest.raises(CodecError, match="finite"):
            decode(EncodedTensor(codec, on_device.dtype, on_device.shape, payload, on_device.params), device="cuda")
    if codec == "blockwise8":
        payload = on_device.payload.clone()
        payload[4 * (tensor.numel() // 64)] = 0x80  # the first code: -128
        with pytest.raises(CodecError, match="-128"):
            decode(EncodedTensor(codec, on_device.dtype, on_device.shape, payload, on_device.params), device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", CODECS)
def test_cuda_encodes_like_the_cpu(codec):
    tensor = _randn((4, 1000), 5, scale=3.0)
    on_gpu = encode(tensor.cuda(), codec)
    on_cpu = encode(tensor, codec)
    assert on_gpu.shape == on_cpu.shape and on_gpu.params == on_cpu.params
    decoded = decode(on_gpu, device="cuda")
    assert decoded.is_cuda
    assert torch.allclose(decoded.cpu(), decode(on_cpu), rtol=0, atol=1e-6)


def test_integer_tensors_cannot_be_encoded():
    with pytest.raises(CodecError):
        encode(torch.ones(3, dtype=torch.int64))


# The blockwise8 codec runs `quantize_linear_into` / `dequantize_linear_into`; `quantize_linear` /
# `dequantize_linear` are the reference they must match bit for bit.
chunk_sizes = st.sampled_from([1, 17, 64, 1000, 1 << 20])


def _quantize_fast(blocks: torch.Tensor, chunk_elements: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(blocks.shape, dtype=torch.int8)
    scales = torch.empty(blocks.shape[0], dtype=torch.float32)
    highest = quantize_linear_into(blocks, scales, codes, chunk_elements=chunk_elements)
    expected = float(scales.max())  # the largest scale it returns, nan included
    assert highest == expected or (math.isnan(highest) and math.isnan(expected)), (highest, expected)
    return codes, scales


def _quantize_each_block(blocks: torch.Tensor) -> torch.Tensor:
    """Reference codes computed one block at a time (quantize_linear picks its divide-first path per call)."""
    return torch.cat([quantize_linear(row[None].to(torch.float32))[0] for row in blocks])


@FEW
@given(
    rows=st.integers(1, 40),
    block_size=block_sizes,
    dtype=st.sampled_from(DTYPES),
    seed=seeds,
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]),
    chunk_elements=chunk_sizes,
)
def test_fast_linear_kernels_match_the_reference(rows, block_size, dtype, seed, scale, chunk_elements):
    # rows of very different magnitudes, so that blocks of one step do not share a scale
    magnitudes = torch.logspace(-3, 3, rows)[torch.randperm(rows, generator=torch.Generator().manual_seed(seed))]
    limit = torch.finfo(dtype).max / 2  # float16 values stay finite
    blocks = (_randn((rows, block_size), seed) * magnitudes[:, None] * scale).clamp(-limit, limit).to(dtype)
    codes, scales = _quantize_fast(blocks, chunk_elements)
    reference_codes, reference_scales = quantize_linear(blocks.to(torch.float32))
    assert torch.equal(scales, reference_scales) and torch.equal(codes, reference_codes)
    out = torch.empty(blocks.shape, dtype=dtype)
    assert dequantize_linear_into(codes, scales, out, chunk_elements=chunk_elements) is out
    assert torch.equal(out, dequantize_linear(reference_codes, reference_scales).to(dtype))


@pytest.mark.parametrize("chunk_elements", [1, 64, 1 << 20])
def test_fast_linear_kernel_handles_zero_tiny_and_extreme_blocks(chunk_elements):
    blocks = _randn((9, 64), 7)
    blocks[1] = 0.0  # zero block: absmax 0, codes 0
    blocks[2] *= 1e-40  # subnormal absmax: 127 / absmax overflows, the divide-first path takes it
    blocks[3] = 0.0
    blocks[3, 5] = -1e-45  # the smallest subnormal alone
    blocks[4] = 3.4e38  # float32 max, constant
    blocks[5] = -2.5  # negative constant
    blocks[6, ::2] = 0.0
    blocks[7] = torch.tensor([127.0, 0.5, 1.5, -0.5, -2.5, 64.5, -64.5, 126.5] * 8)  # ties of x * 127 / absmax
    codes, scales = _quantize_fast(blocks, chunk_elements)
    assert torch.equal(scales, blocks.abs().amax(dim=1))
    assert torch.equal(codes, _quantize_each_block(blocks))
    assert codes[7, :8].tolist() == [127, 0, 2, 0, -2, 64, -64, 126]  # round half to even, as torch.round
    assert not bool(codes[1].any()) and torch.equal(dequantize_linear(codes, scales)[4:6], blocks[4:6])


def test_fast_linear_kernel_leaves_non_finite_scales_for_the_caller():
    blocks = _randn((3, 64), 1)
    blocks[0, 3], blocks[2, 9] = math.nan, -math.inf
    _, scales = _quantize_fast(blocks, chunk_elements=64)
    assert scales[0].isnan() and scales[1].isfinite() and scales[2] == math.inf


@FEW
@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=seeds, block_size=block_sizes)
def test_blockwise8_payload_layout_is_unchanged(shape, dtype, seed, block_size):
    # scales (float32 little-endian), then one int8 code per element, no padding: built here from the reference kernel
    tensor = _randn(shape, seed, dtype, scale=10.0)
    flat = tensor.to(torch.float32).reshape(-1)
    blocks = -(-flat.numel() // block_size)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_size - flat.numel())).view(blocks, block_size)
    codes, scales = quantize_linear(padded)
    expected = scales.numpy().tobytes() + codes.view(-1)[: flat.numel()].numpy().tobytes()
    assert encode(tensor, "blockwise8", block_size=block_size).payload == expected
