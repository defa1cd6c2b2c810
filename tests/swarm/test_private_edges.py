"""Client-held edge blocks live (client/private_edges.py): with private_edges=(a, b) the client runs blocks [0, a)
and [L-b, L) itself and a real swarm the middle. Greedy tokens equal one process's; a tap on every tensor the
nodes decode shows that nodes receive only floating hidden states of the model's width (never token ids or anything
vocabulary-sized), that the first node receives exactly the state after block a, and that boundary noise reaches
the nodes at the asked scale."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.devtools.chaos import AfterTokens
from nesa_node.server import compute
from tests.support.swarm import wait_for_chain, wait_until

PREFIX = "private-edges"
PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35]])
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def swarm_of_two(module_swarm, tiny_llama):
    """Two nodes: blocks 0:2 and 2:4 of the tiny Llama."""
    nodes = [
        module_swarm.start_node(tiny_llama, 0, 2, dht_prefix=PREFIX),
        module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=PREFIX),
    ]
    yield module_swarm
    for node in nodes:
        if node in module_swarm.nodes:  # a test may have stopped it already
            module_swarm.stop_node(node)


@pytest.fixture
def tap(monkeypatch):
    """Every tensor a node of this process decodes from the wire, in order."""
    seen: list[torch.Tensor] = []
    decode = compute.tensor_from_proto

    def recording(*args, **kwargs):
        tensor = decode(*args, **kwargs)
        seen.append(tensor.detach().clone())
        return tensor

    monkeypatch.setattr(compute, "tensor_from_proto", recording)
    return seen


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """One process's greedy tokens and its hidden states of the prompt after each block (index 0: embeddings)."""
    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(tiny_llama)
        tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        states = model(PROMPT, output_hidden_states=True).hidden_states
    return tokens, states, model.config.vocab_size


def connect(swarm, tiny_llama, **options):
    return DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=swarm.initial_peers, dht_prefix=PREFIX, compression="none", **options
    )


@pytest.mark.parametrize("edges", [(1, 0), (1, 1), (2, 1)])
def test_tokens_equal_one_process_and_nodes_see_only_the_middle(swarm_of_two, tiny_llama, reference, tap, edges):
    tokens, states, vocab = reference
    front, back = edges
    with connect(swarm_of_two, tiny_llama, private_edges=edges) as model:
        assert model.client.swarm_blocks == (front, 4 - back)
        wait_for_chain(model)
        chain = model.choose_chain(max_length=32)
        assert (chain.hops[0].start_block, chain.hops[-1].end_block) == (front, 4 - back)
        tap.clear()
        produced = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(produced, tokens)
    assert tap, "the tap saw nothing: the nodes decoded no tensor"
    for tensor in tap:
        assert tensor.is_floating_point(), f"a node received a {tensor.dtype} tensor"
        assert tensor.dim() == 3 and tensor.shape[-1] == states[0].shape[-1] != vocab
        assert vocab not in tensor.shape
    # the first tensor a node decodes is the prompt after block `front`, computed by the client: never the embeddings
    prompt_state = next(tensor for tensor in tap if tensor.shape[1] == PROMPT.shape[1])
    torch.testing.assert_close(prompt_state, states[front], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(prompt_state, states[0], atol=1e-3)


def test_forward_without_a_session_runs_the_edges_too(swarm_of_two, tiny_llama, reference):
    with torch.inference_mode():
        logits = AutoModelForCausalLM.from_pretrained(tiny_llama)(PROMPT).logits
    with connect(swarm_of_two, tiny_llama, private_edges=(1, 1)) as model:
        wait_for_chain(model)
        torch.testing.assert_close(model(PROMPT).logits, logits, rtol=1e-4, atol=1e-4)


def test_boundary_noise_reaches_the_nodes_at_the_asked_scale(swarm_of_two, tiny_llama, reference, tap):
    _, states, _ = reference
    sigma = 0.5
    with connect(swarm_of_two, tiny_llama, private_edges=(1, 0), boundary_noise=sigma) as model:
        wait_for_chain(model)
        tap.clear()
        model.generate(PROMPT, max_new_tokens=1, do_sample=False)
    received = next(tensor for tensor in tap if tensor.shape[1] == PROMPT.shape[1])
    clean = states[1]
    noise = received - clean
    ratio = noise.pow(2).mean(-1).sqrt() / clean.pow(2).mean(-1).sqrt()  # (1, tokens): per token, about sigma
    assert 0.5 * sigma < float(ratio.mean()) < 1.5 * sigma


@pytest.mark.parametrize("edges", [(2, 2), (-1, 0), (1,)])
def test_edges_that_leave_the_swarm_nothing_are_refused_before_joining(tiny_llama, edges):
    with pytest.raises(ValueError, match="private_edges"):
        DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=["/ip4/127.0.0.1/tcp/1"], private_edges=edges
        )


def test_a_middle_node_lost_mid_generation_is_replaced_for_the_middle_blocks_only(swarm_of_two, tiny_llama, reference):
    tokens, _, _ = reference
    spare = swarm_of_two.start_node(tiny_llama, 2, 4, dht_prefix=PREFIX)
    try:
        with connect(swarm_of_two, tiny_llama, private_edges=(1, 1)) as model:
            wait_for_chain(model)
            wait_until(lambda: len(model.call(model.swarm.node_records())) == 3, timeout_s=30)
            with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
                lost = session.chain.hops[-1]
                victim = next(node for node in swarm_of_two.nodes if node.peer_id == lost.peer_id)
                produced = model.generate(
                    PROMPT,
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    streamer=AfterTokens(3, lambda: swarm_of_two.stop_node(victim)),
                )
        assert torch.equal(produced, tokens)
        assert [failover["blocks"] for failover in session.failovers] == [[2, 3]]
    finally:
        # the spare stays when the module's own node for blocks 2:4 was the one stopped: later tests need them served
        if spare in swarm_of_two.nodes and len([n for n in swarm_of_two.nodes if n.start_block == 2]) > 1:
            swarm_of_two.stop_node(spare)


def test_an_adapter_with_blocks_run_here_is_refused_not_run_without_it(swarm_of_two, tiny_llama, tmp_path):
    """Blocks the client runs itself (private_edges) run the base weights: a LoRA adapter, as the model's or a call's,
    is an AdapterError rather than tokens that silently differ from the adapter's; boundary noise alone runs no
    block here and keeps the adapter."""
    from nesa_node.errors import AdapterError
    from tests.support.adapters import save_random_adapter

    folder = save_random_adapter(tiny_llama, tmp_path / "lora", seed=4, r=2, target_modules=["q_proj", "v_proj"])
    with pytest.raises(AdapterError, match="private_edges"):
        connect(swarm_of_two, tiny_llama, private_edges=(1, 1), adapter=str(folder))
    with connect(swarm_of_two, tiny_llama, private_edges=(1, 0)) as model:
        wait_for_chain(model)
        with pytest.raises(AdapterError, match="private_edges"):
            model.generate(PROMPT, max_new_tokens=2, do_sample=False, adapter=str(folder))
        assert model.generate(PROMPT, max_new_tokens=2, do_sample=False).shape == (1, PROMPT.shape[1] + 2)
    with connect(swarm_of_two, tiny_llama, boundary_noise=0.01, adapter=str(folder)) as model:
        assert model.client.adapter is not None
