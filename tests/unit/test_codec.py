import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from nesa_node.compression.codec import CodecError, EncodedTensor, decode, encode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_is_exact(shape, dtype, seed):
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    decoded = decode(encode(tensor))
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_payload_must_match_shape():
    encoded = encode(torch.ones(2, 3))
    with pytest.raises(CodecError, match="needs 24"):
        decode(EncodedTensor("none", "float32", (2, 3), encoded.payload[:-4]))
    with pytest.raises(CodecError, match="needs"):
        decode(EncodedTensor("none", "float32", (3, 3), encoded.payload))


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


def test_huge_declared_shape_is_rejected_before_allocating():
    with pytest.raises(CodecError, match="limit"):
        decode(EncodedTensor("none", "float32", (2**31, 2**31), b""), max_elements=1 << 20)


def test_integer_tensors_cannot_be_encoded():
    with pytest.raises(CodecError):
        encode(torch.ones(3, dtype=torch.int64))
