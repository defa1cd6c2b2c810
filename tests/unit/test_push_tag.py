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
