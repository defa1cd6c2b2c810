"""The tensor wire format: codecs named in messages, tensor protos, per-hop codec choice."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.proto import runtime_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.client.codec_choice import codec_for
from nesa_node.compression.codec import MAX_RANK, CodecError, EncodedTensor
from nesa_node.compression.codec import decode as decode_tensor
from nesa_node.errors import BadRequestError
from nesa_node.protocol.messages import TO_SESSION, Step, decode, encode
from nesa_node.protocol.tensors import NO_CODEC, WireCodec, tensor_from_proto, tensor_to_proto, tensor_to_wire
from nesa_node.routing.chain import Hop


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "blockwise8", "dynamic8"])
def test_codec_named_in_metadata_round_trips_a_tensor(name):
    codec = WireCodec.of(name)
    named = decode(encode(Step(step_id="s:0", position=0, codec=codec)), TO_SESSION).codec
    assert named == codec
    hidden = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    proto = runtime_pb2.Tensor.FromString(tensor_to_proto(hidden, codec).SerializeToString())
    decoded = tensor_from_proto(proto, allowed_dtypes=("float32",), max_elements=10_000, rank=3, codec=codec)
    assert decoded.shape == hidden.shape and decoded.dtype == hidden.dtype
    tolerance = {"none": 0.0, "fp16": 1e-3, "bf16": 1e-2, "blockwise8": 0.02, "dynamic8": 0.03}[name]
    assert (decoded - hidden).abs().max().item() <= tolerance * hidden.abs().max().item()


def test_block_size_travels_with_the_codec():
    codec = WireCodec.of("blockwise8", block_size=128)
    assert codec.to_metadata() == {"name": "blockwise8", "block_size": 128}
    assert WireCodec.from_metadata(codec.to_metadata()).params == (("block_size", 128),)
    hidden = torch.randn(1, 1, 256)
    proto = tensor_to_proto(hidden, codec)
    assert len(proto.buffer) == 256 + 2 * 4  # one byte per element, one float32 scale per 128 elements
    with pytest.raises(BadRequestError, match="bytes"):  # decoded with the wrong block size: payload mismatch
        tensor_from_proto(proto, allowed_dtypes=("float32",), max_elements=1000, codec=WireCodec.of("blockwise8"))


@pytest.mark.parametrize(
    "value, message",
    [
        ({"name": "zstd"}, "unknown codec"),
        ({"name": 7}, "unknown codec"),
        ("blockwise8", "small map"),
        ({"name": "blockwise8", "block_size": 3}, "bad codec parameters"),
        ({"name": "blockwise8", "block_size": True}, "bad codec parameters"),
        ({"name": "blockwise8", "window": 64}, "bad codec parameters"),
        ({"name": "blockwise8", **{f"k{i}": 1 for i in range(8)}}, "small map"),
    ],
)
def test_malformed_codec_from_a_peer_is_a_typed_error(value, message):
    with pytest.raises(BadRequestError, match=message) as error:
        WireCodec.from_metadata(value)
    assert error.value.code == "bad_request"


def test_codec_outside_the_accepted_list_is_refused():
    assert WireCodec.from_metadata(None, accepted=("none",)) == NO_CODEC
    with pytest.raises(BadRequestError, match="not accepted"):
        WireCodec.from_metadata({"name": "dynamic8"}, accepted=("none", "fp16"))


def test_non_finite_tensor_under_a_lossy_codec_is_a_typed_error():
    hidden = torch.tensor([[[1.0, float("nan")]]])
    with pytest.raises(BadRequestError, match="cannot encode"):
        tensor_to_proto(hidden, WireCodec.of("blockwise8"))


def test_values_a_codec_cannot_carry_go_lossless_and_say_so():
    """Finite values beyond fp16's range go with codec "none" (named in the message, taken by every peer), exactly;
    values fp16 carries keep it; nan or inf stay an error."""
    large = torch.tensor([[[1.0, 1e6]]])
    proto, codec = tensor_to_wire(large, WireCodec.of("fp16"))
    assert codec == NO_CODEC
    assert torch.equal(tensor_from_proto(proto, allowed_dtypes=("float32",), max_elements=8, codec=codec), large)
    small = torch.tensor([[[1.0, 2.0]]])
    assert tensor_to_wire(small, WireCodec.of("fp16"))[1] == WireCodec.of("fp16")
    with pytest.raises(BadRequestError, match="cannot encode"):
        tensor_to_wire(torch.tensor([[[1.0, float("inf")]]]), WireCodec.of("fp16"))


def test_hivemind_compression_field_is_not_trusted():
    proto = tensor_to_proto(torch.zeros(1, 1, 4))
    proto.compression = runtime_pb2.CompressionType.FLOAT16
    with pytest.raises(BadRequestError, match="hivemind tensor compression"):
        tensor_from_proto(proto, allowed_dtypes=("float32",), max_elements=100)


def test_each_hop_gets_the_preferred_codec_only_when_both_ends_accept_it():
    preferred = WireCodec.of("dynamic8")
    everything = Hop("a", 0, 1, codecs=("none", "fp16", "dynamic8"))
    plain = Hop("b", 1, 2, codecs=("none",))
    assert codec_for(None, everything, preferred) == preferred  # client -> node
    assert codec_for(everything, None, preferred) == preferred  # node -> client
    assert codec_for(everything, plain, preferred) == NO_CODEC  # the receiver cannot decode it
    assert codec_for(plain, everything, preferred) == NO_CODEC  # the sender will not produce it
    assert codec_for(None, plain, NO_CODEC) == NO_CODEC


# a dimension as a tensor protobuf holds it (uint32): small, zero, or a power of two less one up to 2**32 - 1
DIMENSIONS = st.one_of(st.integers(0, 8), st.integers(0, 32).map(lambda bits: (1 << bits) - 1))


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(DIMENSIONS, max_size=12), max_elements=st.sampled_from([1, 64, 4096]))
def test_any_declared_shape_decodes_or_is_a_bad_request(shape, max_elements):
    """A shape a peer declares is decoded exactly or refused with BadRequestError; never torch's RuntimeError (a
    zero-element shape like (0, 2**32 - 1, 2**32 - 1) overflowed torch's stride computation)."""
    extent = math.prod(max(dim, 1) for dim in shape)
    valid = len(shape) <= MAX_RANK and extent <= max_elements
    elements = math.prod(shape) if valid else 0
    proto = runtime_pb2.Tensor(buffer=bytes(4 * elements), size=shape, dtype="float32")
    try:
        decoded = tensor_from_proto(proto, allowed_dtypes=("float32",), max_elements=max_elements)
    except BadRequestError:
        assert not valid
    else:
        assert valid and list(decoded.shape) == shape


@pytest.mark.parametrize(
    "shape, message",
    [
        ([0, (1 << 32) - 1, (1 << 32) - 1], "exceeds the limit of 4096 elements"),
        ([(1 << 32) - 1, 0], "exceeds the limit of 4096 elements"),
        ([0, 1 << 31, 1 << 31, 1 << 31], "exceeds the limit of 4096 elements"),
        ([0] * (MAX_RANK + 1), f"at most {MAX_RANK} dimensions"),
    ],
)
def test_empty_tensors_with_impossible_dimensions_are_bad_requests(shape, message):
    proto = runtime_pb2.Tensor(buffer=b"", size=shape, dtype="float32")
    with pytest.raises(BadRequestError, match=message):
        tensor_from_proto(proto, allowed_dtypes=("float32",), max_elements=4096)


@given(shape=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=10))
def test_codec_shapes_beyond_the_wire_types_are_refused_too(shape):
    """The codec itself (which other callers feed shapes that never were protobuf) refuses negative and huge
    dimensions with CodecError before torch sees them."""
    try:
        decoded = decode_tensor(EncodedTensor("none", "float32", tuple(shape), b""), max_elements=4096)
    except CodecError:
        return
    assert decoded.numel() == 0 and list(decoded.shape) == shape
