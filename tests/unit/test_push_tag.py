"""Tags on pushed steps (protocol/push_tag.py): any change to the step or its tensor, or another key, fails the tag."""

from __future__ import annotations

import torch

from nesa_node.protocol import push_tag
from nesa_node.protocol.messages import Step
from nesa_node.protocol.tensors import WireCodec, tensor_to_proto


def tagged(key: bytes, step: Step, tensor) -> Step:
    return step.model_copy(update={"tag": push_tag.push_tag(key, step, tensor)})


def test_a_tag_holds_for_its_step_and_tensor_under_its_key_only():
    key, other = push_tag.new_key(), push_tag.new_key()
    hidden = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0))
    tensor = tensor_to_proto(hidden)
    step = tagged(key, Step(step_id="s:5", position=5), tensor)
    assert push_tag.tag_matches(key, step, tensor)
    assert not push_tag.tag_matches(other, step, tensor)
    assert not push_tag.tag_matches(key, step.model_copy(update={"tag": None}), tensor)
    changed = hidden.clone()
    changed[0, 1, 2] += 1e-6
    assert not push_tag.tag_matches(key, step, tensor_to_proto(changed))  # one value
    assert not push_tag.tag_matches(key, step, tensor_to_proto(hidden[:, :2]))  # a token short
    assert not push_tag.tag_matches(key, step, tensor_to_proto(hidden.to(torch.float16)))  # another dtype
    for field, value in (("step_id", "s:6"), ("position", 6), ("codec", WireCodec("blockwise8"))):
        assert not push_tag.tag_matches(key, step.model_copy(update={field: value}), tensor)
    received = type(tensor).FromString(tensor.SerializeToString())  # as the next node and the client parse it
    assert push_tag.tag_matches(key, step, received)


def test_tags_are_the_wire_format_every_node_computes():
    """Known answers (HMAC-SHA256 over the length-prefixed fields, protocol/push_tag.py): a node of another release
    checks the tags of this one, and `tag_of` (the pushing node's) gives what `push_tag` gives."""
    from hivemind.proto import runtime_pb2

    key = bytes(range(32))
    tensor = runtime_pb2.Tensor(buffer=bytes(range(16)), size=[1, 1, 4], dtype="float32")
    expected = {
        "none": "6b2809315a4647361213f4359f7c4fc1895cd0bddde7f6044ff0ca302780dd49",
        "blockwise8": "08d151f650812f3b93ad265be9eeff4f42b3cefe4aada6cd126f9f53b13520ea",
    }
    for codec in (WireCodec(), WireCodec.of("blockwise8", block_size=64)):
        step = Step(step_id="s1:16", position=16, codec=codec)
        assert push_tag.push_tag(key, step, tensor) == expected[codec.name]
        assert push_tag.tag_of(key, "s1:16", 16, codec, tensor) == expected[codec.name]
