"""Tags on pushed steps (protocol/push_tag.py): any change to the step or its tensor, or another key, fails the tag."""

from __future__ import annotations

import hashlib
import hmac

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


KNOWN_SEALS = (
    "207c0e28893f190c70dc2ae69173c7bf8d7e78dc17bc9aec1201f2f50d01fabb",
    "7792c7d8d41f8ce44efcfdd735f77774b46d2113c091680354f4f8ba51eebc2a",
)
KNOWN_SEALED_TAG = "bedf97bccfae02b8c28bd476abd4c33c4ebaf44f6224265c0d8ee1647f04cc49"


def sealed(keys: list[bytes], tokens: int = 1, position: int = 7) -> Step:
    return Step(step_id="s:7", position=position, seals=push_tag.seal_chain(keys, "s:7", 7, tokens))


@settings(max_examples=40, deadline=None)
@given(nodes=st.integers(1, 6), tokens=st.integers(1, 64), data=st.data())
def test_each_node_checks_its_own_seal_and_a_change_anywhere_after_it_fails_it(nodes, tokens, data):
    """Seals (push_tag.seal_chain): the node at each place takes the step whose seals start with its own; other
    tokens, another position, another key, or any seal after its own altered, and its check fails."""
    keys = [push_tag.new_key() for _ in range(nodes)]
    step = sealed(keys, tokens)
    for place, key in enumerate(keys):
        at = step.model_copy(update={"seals": step.seals[place:]})  # as the nodes before pushed it on
        assert push_tag.seal_matches(key, at, tokens)
        assert not push_tag.seal_matches(key, at, tokens + 1) and not push_tag.seal_matches(key, at, tokens - 1)
        assert not push_tag.seal_matches(key, at.model_copy(update={"position": 8}), tokens)
        assert not push_tag.seal_matches(push_tag.new_key(), at, tokens)
        assert not push_tag.seal_matches(key, at.model_copy(update={"seals": ()}), tokens)
        later = data.draw(st.integers(place, nodes - 1))
        altered = list(step.seals)
        altered[later] = altered[later].upper() if altered[later] != altered[later].upper() else "0" * 64
        assert not push_tag.seal_matches(key, at.model_copy(update={"seals": tuple(altered[place:])}), tokens)
        dropped = step.seals[place:later] + step.seals[later + 1 :]
        assert not push_tag.seal_matches(key, at.model_copy(update={"seals": dropped}), tokens)


def test_seals_and_sealed_tags_are_the_wire_format_every_node_computes():
    """Known answers: a seal (HMAC-SHA256 over the length-prefixed step id, position, tokens and later seals), and a
    pushed step's tag covering its seals, while an unsealed step's tag stays as it was."""
    from hivemind.proto import runtime_pb2

    keys = [bytes(range(32)), bytes(range(1, 33))]
    seals = push_tag.seal_chain(keys, "s1:16", 16, 2)
    assert seals == (
        push_tag.seal_of(keys[0], "s1:16", 16, 2, seals[1:]),
        push_tag.seal_of(keys[1], "s1:16", 16, 2, ()),
    )
    # the last seal, spelled out: the context, then each part after its length (8 bytes, big-endian)
    parts = [b"s1:16", (16).to_bytes(8, "big"), (2).to_bytes(8, "big")]
    spelled = b"".join(len(part).to_bytes(8, "big") + part for part in parts)
    assert seals[1] == hmac.new(keys[1], b"nesa-node step seal v1" + spelled, hashlib.sha256).hexdigest()
    assert seals == KNOWN_SEALS
    tensor = runtime_pb2.Tensor(buffer=bytes(range(16)), size=[1, 1, 4], dtype="float32")
    step = Step(step_id="s1:16", position=16, seals=seals[1:])
    assert push_tag.push_tag(keys[0], step, tensor) == KNOWN_SEALED_TAG
    assert push_tag.push_tag(keys[0], step, tensor) != push_tag.push_tag(
        keys[0], Step(step_id="s1:16", position=16), tensor
    )
