"""Hidden-state codecs through real swarms: negotiation with the nodes, and bytes on the wire."""

from __future__ import annotations

import pytest
import torch

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.session import InferenceSession
from nesa_node.compression.codec import wire_bytes
from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model
from nesa_node.errors import BadRequestError
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import frame, read
from nesa_node.protocol.messages import FORWARD_ANSWERS, ErrorReply, ForwardRequest
from nesa_node.protocol.tensors import WireCodec, tensor_to_proto
from nesa_node.routing.snapshot import Chain, Hop
from tests.support.swarm import client_seeing, wait_for_chain

WIDE = TinyModelSpec(layers=2, hidden=1024, heads=8, kv_heads=8, intermediate=256, vocab=512, seed=3)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """Hidden size 1024, so one token's hidden states (4 KB in float32) dominate a step's message."""
    return str(init_tiny_model(tmp_path_factory.mktemp("wide") / "wide-llama", WIDE))


def step_bytes(model: DistributedModelForCausalLM, codec: str) -> tuple[int, int]:
    """Serialized bytes the client sent and received for one decode step of batch 1 with `codec`."""
    chain = model.choose_chain(max_length=8)
    config = model.client.config.replace(compression=WireCodec.of(codec))
    session = InferenceSession(model.swarm, chain, config, batch=1, max_length=8)
    model.call(session.open())
    try:
        model.call(session.step(torch.randn(1, 4, WIDE.hidden)))  # prefill
        model.call(session.step(torch.randn(1, 1, WIDE.hidden)))  # one decode step
    finally:
        model.call(session.close())
    last = session.timings[-1]
    return last.bytes_sent, last.bytes_received


def test_quantized_codecs_cut_the_bytes_of_a_decode_step(module_swarm, wide_model):
    module_swarm.start_node(wide_model, 0, 1, dht_prefix="wide")
    module_swarm.start_node(wide_model, 1, 2, dht_prefix="wide")
    with DistributedModelForCausalLM.from_pretrained(
        wide_model, initial_peers=module_swarm.initial_peers, dht_prefix="wide", compression="none"
    ) as model:
        wait_for_chain(model, hops=2)
        measured = {codec: step_bytes(model, codec) for codec in ("none", "fp16", "blockwise8", "dynamic8")}
    print({codec: sizes for codec, sizes in measured.items()})
    for codec in ("blockwise8", "dynamic8"):
        # payload alone: 1 byte per element + a float32 scale per 64 elements = 3.76x fewer than float32
        assert wire_bytes("none", (1, 1, WIDE.hidden)) / wire_bytes(codec, (1, 1, WIDE.hidden)) > 3.7
        for direction in (0, 1):  # request to the first node, answer from the last one
            # whole serialized messages, ids and metadata included
            assert measured["none"][direction] / measured[codec][direction] > 3.3
            assert measured["fp16"][direction] / measured[codec][direction] > 1.7


def test_node_refuses_a_codec_it_does_not_accept(module_swarm, tiny_llama):
    node = module_swarm.start_node(tiny_llama, 0, 4, dht_prefix="plain-only", codecs=("none",))
    assert node.current_info().codecs == ("none",)
    hidden = torch.randn(1, 3, 64)
    codec = WireCodec.of("blockwise8")
    request = frame(ForwardRequest(start_block=0, end_block=4, codec=codec), [tensor_to_proto(hidden, codec)])
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix="plain-only"
    ) as model:
        wait_for_chain(model)
        answer = read(model.call(model.swarm.unary(node.peer_id, rpc.FORWARD, request)), FORWARD_ANSWERS)
        assert isinstance(answer, ErrorReply) and answer.code == "bad_request"
        with pytest.raises(BadRequestError, match="not accepted"):
            raise answer.error()


def test_client_falls_back_to_none_for_nodes_without_its_codec(module_swarm, tiny_llama):
    """The client asks for dynamic8, but these nodes accept only none: the wire stays lossless."""
    module_swarm.start_node(tiny_llama, 0, 2, dht_prefix="fallback", codecs=("none",))
    module_swarm.start_node(tiny_llama, 2, 4, dht_prefix="fallback", codecs=("none",))
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        expected = reference.generate(input_ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix="fallback", compression="dynamic8"
    ) as model:
        wait_for_chain(model, hops=2)
        assert all(hop.codecs == ("none",) for hop in model.choose_chain().hops)
        output = model.generate(input_ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(output, expected)


@pytest.mark.parametrize("mode", ["direct", "relay"])
def test_values_beyond_fp16_go_lossless_instead_of_failing_the_step(module_swarm, tiny_llama, mode):
    """With compression="fp16", the first node's outputs grow past fp16's range (finite: an honest model's large
    activations): the node, and in relay mode the client, send those steps lossless and say so; nobody is refused,
    replaced or banned."""
    prefix = f"beyond-fp16-{mode}"
    first = module_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    honest_run = first.compute.run

    async def large(hidden, cache, position, blocks, adapter=None):
        output, seconds = await honest_run(hidden, cache, position, blocks, adapter)
        return output * 1e6, seconds  # past 65504 for every |value| above 0.07

    first.compute.run = large
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix=prefix, compression="fp16", mode=mode
    ) as model:
        wait_for_chain(model, hops=2)
        with model.inference_session(max_length=32) as session:
            output = model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=6, min_new_tokens=6)
        assert output.shape == (1, 11) and session.failovers == [] and not model.swarm.banned()
        assert all(len(timing.hop_codecs) == (2 if mode == "relay" else 1) for timing in session.timings)
        assert session.step_codecs == [timing.hop_codecs[0] for timing in session.timings] and set(
            session.step_codecs
        ) == {"fp16"}  # the first node's inputs: the client's embeddings, within fp16's range
        if mode == "relay":  # the client's own sends to the second node (those that fit fp16 keep it)
            assert "none" in [timing.hop_codecs[1] for timing in session.timings], session.timings


def test_a_replacement_is_replayed_what_the_lost_node_decoded(module_swarm, tiny_llama):
    """With a lossy codec on the wire each node decodes values a little off what its sender computed. A replacement
    rebuilds its cache from the inputs the client kept (the first node's span) or the history the node before it
    keeps: both are exactly what the lost node decoded, or the replacement's cache, and the tokens after it, would
    differ from the run without a fault (RELIABILITY.md A1)."""
    prefix = "lossy-replay"
    nodes = [module_swarm.start_node(tiny_llama, start, end, dht_prefix=prefix) for start, end in ((0, 2), (2, 4))]
    decoded: list[list[torch.Tensor]] = [[], []]  # each node's inputs, as it read them
    for node, seen in zip(nodes, decoded, strict=True):
        read_hidden = node.compute.read_hidden

        def reading(*args, _read=read_hidden, _seen=seen, **kwargs):
            _seen.append(_read(*args, **kwargs))
            return _seen[-1]

        node.compute.read_hidden = reading
    try:
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix=prefix, compression="blockwise8"
        ) as model:
            chain = wait_for_chain(model, hops=2)
            with model.session_on(chain, batch=1, max_length=16) as session:
                sent = [torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))]
                output = session.step(sent[0])
                for _ in range(3):
                    sent.append(output[:, -1:] * 3)
                    output = session.step(sent[-1])
                inner = session.session
                assert inner.step_codecs == ["blockwise8"] * 4
                assert inner.output_codecs[nodes[0].peer_id] == "blockwise8"
                history = model.call(inner.links.history(inner.links.links[0], 7))
        first_saw, second_saw = (torch.cat(seen, dim=1) for seen in decoded)
        assert not torch.equal(first_saw, torch.cat(sent, dim=1))  # the codec is lossy
        assert torch.equal(torch.cat(inner._inputs[0], dim=1), first_saw)
        assert torch.equal(history, second_saw)
    finally:
        for node in nodes:
            module_swarm.stop_node(node)


def test_a_replacement_that_takes_no_lossy_codec_gets_pushes_it_can_read(module_swarm, tiny_llama):
    """The node before a lost one pushes with the codec chosen for the lost one (blockwise8). Its replacement takes
    only "none": the retarget that points the node at it also names the codec it takes, so the session goes on
    through the replacement, which is neither refused nor banned."""
    prefix = "recode"
    first = module_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    lost = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    plain = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix, codecs=("none",))
    nodes = [first, lost, plain]
    try:
        with client_seeing(module_swarm, tiny_llama, nodes, dht_prefix=prefix, compression="blockwise8") as model:
            hops = tuple(Hop(node.peer_id, start, 4 if start else 2, node.current_info().codecs) for node, start in (
                (first, 0), (lost, 2)
            ))  # fmt: skip
            with model.session_on(Chain(hops=hops), batch=1, max_length=16) as session:
                output = session.step(torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1)))
                output = session.step(output[:, -1:])
                assert session.session.output_codecs[first.peer_id] == "blockwise8"
                module_swarm.stop_node(lost)
                nodes.remove(lost)
                for _ in range(3):
                    output = session.step(output[:, -1:])
                assert output.shape == (1, 1, 64) and torch.isfinite(output).all()
                assert [hop.peer_id for hop in session.session.chain.hops] == [first.peer_id, plain.peer_id]
                assert session.session.output_codecs[first.peer_id] == "none"
                assert len(session.session.failovers) == 1, session.session.failovers
                assert plain.peer_id not in session.session.failovers[0]["banned"]
    finally:
        for node in nodes:
            module_swarm.stop_node(node)
