"""The lossless codec's short paths for host tensors (`encode` of a CPU tensor with "none", `decode` of a bytes
payload to the CPU) against the registry's general path: the same bytes out, the same tensor or the same error in,
whatever a peer declares."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.compression.codec import (
    MAX_RANK,
    CodecError,
    EncodedTensor,
    _decode_checked,
    decode,
    encode,
    encode_on_device,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WIRE_NAMES = ["float32", "float16", "bfloat16"]
ALL_WIRE = tuple(WIRE_NAMES)


def _general_bytes(tensor: torch.Tensor) -> bytes:
    """The payload the registry's path gives (`encode_on_device` keeps it as a tensor)."""
    payload = encode_on_device(tensor, "none").payload
    return payload.numpy().tobytes() if payload.numel() else b""


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=4),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    layout=st.sampled_from(["contiguous", "transposed", "strided", "grad", "inference"]),
)
def test_a_host_tensor_encodes_to_the_bytes_of_the_general_path(shape, dtype, seed, layout):
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if layout == "transposed" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, -1)
    elif layout == "strided" and tensor.dim() >= 1:
        tensor = tensor[..., ::2]
    elif layout == "grad" and dtype == torch.float32:
        tensor = tensor.clone().requires_grad_(True)
    elif layout == "inference":
        with torch.inference_mode():
            tensor = tensor * 1
    encoded = encode(tensor)
    assert encoded.payload == _general_bytes(tensor)
    assert (encoded.codec, encoded.dtype, encoded.shape, encoded.params) == (
        "none",
        WIRE_NAMES[DTYPES.index(dtype)],
        tuple(tensor.shape),
        (),
    )
    assert torch.equal(decode(encoded), tensor.detach())


def _outcome(run):
    try:
        result = run()
    except CodecError as exc:
        return ("error", str(exc))
    return ("tensor", result.dtype, tuple(result.shape), result.view(-1).view(torch.uint8).numpy().tobytes())


_dims = st.one_of(st.integers(-2, 6), st.just(1 << 40), st.booleans(), st.just(2.0), st.just("3"))


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.one_of(st.sampled_from([*WIRE_NAMES, "float64", "int8", ""]), st.integers(0, 3)),
    shape=st.one_of(st.lists(_dims, min_size=0, max_size=MAX_RANK + 2).map(tuple), st.just([2, 3]), st.just(None)),
    extra=st.integers(-3, 3),
    allowed=st.sampled_from([ALL_WIRE, ("float32",), ("float16", "bfloat16")]),
    max_elements=st.sampled_from([1, 6, 40, 1 << 26]),
    rank=st.sampled_from([None, 0, 1, 2, 3]),
    params=st.sampled_from([(), (("block_size", 64),), None, 0, False, [], {}]),
    data=st.data(),
)
def test_a_payload_from_a_peer_decodes_or_fails_as_by_the_general_path(
    dtype, shape, extra, allowed, max_elements, rank, params, data
):
    # a payload of about the size the declared shape needs (off by `extra` bytes), else of some other length
    try:
        elements = 1
        for dim in shape:
            elements *= int(dim)
        width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)
        length = max(0, min(elements * width + extra, 1 << 12))
    except (TypeError, ValueError):
        length = data.draw(st.integers(0, 64))
    payload = data.draw(st.binary(min_size=length, max_size=length))
    encoded = EncodedTensor(codec="none", dtype=dtype, shape=shape, payload=payload, params=params)
    checks = {"allowed_dtypes": allowed, "max_elements": max_elements, "rank": rank}
    fast = _outcome(lambda: decode(encoded, **checks))
    general = _outcome(lambda: _decode_checked(encoded, allowed, max_elements, rank, None))
    assert fast == general


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decoded_tensor_owns_its_memory(dtype):
    tensor = torch.arange(24, dtype=torch.float32).to(dtype).view(2, 3, 4)
    payload = encode(tensor).payload
    before = bytes(payload)
    decoded = decode(EncodedTensor(codec="none", dtype=encode(tensor).dtype, shape=(2, 3, 4), payload=payload))
    decoded.add_(1)  # writable, and writing it leaves the peer's bytes alone
    assert payload == before
    assert torch.equal(decoded, tensor + 1)


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "blockwise8", "dynamic8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_element_of_a_strided_view_encodes(codec, dtype):
    tensor = torch.tensor([1.5, -2.0], dtype=dtype)[::2]  # shape (1,), stride (2,)
    for encoded in (encode(tensor, codec), encode_on_device(tensor, codec)):
        assert decode(encoded).tolist() == [1.5]


@pytest.mark.parametrize("params", [None, 0, False, [], {}, (("block_size", 64),)])
def test_codec_parameters_other_than_none_take_the_general_way(params):
    tensor = torch.randn(2, 3)
    encoded = EncodedTensor(codec="none", dtype="float32", shape=(2, 3), payload=encode(tensor).payload, params=params)
    general = _outcome(lambda: _decode_checked(encoded, ALL_WIRE, 1 << 26, None, None))
    assert _outcome(lambda: decode(encoded)) == general
    assert general[0] == ("tensor" if params in ([], {}) else "error")
