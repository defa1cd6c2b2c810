"""Generation through real local swarms equals single-process transformers generation."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.errors import BadRequestError
from nesa_node.protocol import rpc
from nesa_node.routing.chain import Chain, Hop
from tests.support.models import ARCHES
from tests.support.swarm import wait_for_chain

SPLITS = {
    1: [(0, 4)],
    2: [(0, 2), (2, 4)],
    3: [(0, 1), (1, 3), (3, 4)],
    4: [(0, 1), (1, 2), (2, 3), (3, 4)],
}
# chain lengths per family: every length for llama; for mistral one node holding every block, and for both others the
# lengths the tests below use (a hop boundary passes the same hidden states whatever the family)
HOPS = {"llama": (1, 2, 3, 4), "mistral": (1, 2), "qwen2": (2, 3)}
OVERLAPPING = [(0, 3), (2, 4)]  # a chain through both uses one of them for part of its span
PROMPT_LENGTH, NEW_TOKENS = 16, 64
GREEDY_WITH_LOGITS = dict(
    max_new_tokens=NEW_TOKENS,
    min_new_tokens=NEW_TOKENS,
    do_sample=False,
    output_logits=True,
    return_dict_in_generate=True,
)


def prompt(seed: int = 0, length: int = PROMPT_LENGTH) -> torch.Tensor:
    return torch.randint(3, 1000, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def swarm(module_swarm, tiny_models):
    """Per architecture and chain length k (HOPS): k nodes splitting the 4 blocks, under DHT prefix '<arch>-k<k>'."""
    assert set(HOPS) == set(ARCHES)
    for arch, path in tiny_models.items():
        for hops in HOPS[arch]:
            for start, end in SPLITS[hops]:
                module_swarm.start_node(path, start, end, dht_prefix=f"{arch}-k{hops}", announce_period_s=5.0)
    for start, end in OVERLAPPING:
        module_swarm.start_node(tiny_models["llama"], start, end, dht_prefix="llama-overlap", announce_period_s=5.0)
    return module_swarm


@pytest.fixture(scope="module")
def references(tiny_models):
    """Single-process greedy generation per architecture: sequences and the logits of every step."""
    results = {}
    for arch, path in tiny_models.items():
        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.inference_mode():
            results[arch] = model.generate(prompt(), **GREEDY_WITH_LOGITS)
    return results


def connect(swarm, path: str, prefix: str, **kwargs) -> DistributedModelForCausalLM:
    kwargs.setdefault("compression", "none")  # exact equality with one process needs a lossless wire
    return DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=swarm.initial_peers, dht_prefix=prefix, **kwargs
    )


@pytest.mark.parametrize(("arch", "hops"), [(arch, hops) for arch in ARCHES for hops in HOPS[arch]])
def test_greedy_generation_equals_single_process(swarm, tiny_models, references, arch, hops):
    with connect(swarm, tiny_models[arch], f"{arch}-k{hops}") as model:
        chain = wait_for_chain(model, hops=hops, max_length=PROMPT_LENGTH + NEW_TOKENS)
        assert [(hop.start_block, hop.end_block) for hop in chain.hops] == SPLITS[hops]
        output = model.generate(prompt(), **GREEDY_WITH_LOGITS)
    reference = references[arch]
    assert output.sequences.shape == (1, PROMPT_LENGTH + NEW_TOKENS)
    assert torch.equal(output.sequences, reference.sequences)
    torch.testing.assert_close(output.logits[-1], reference.logits[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(output.logits[0], reference.logits[0], atol=1e-4, rtol=0)


def test_client_relayed_mode_equals_direct(swarm, tiny_models, references):
    with connect(swarm, tiny_models["llama"], "llama-k3", mode="relay") as model:
        wait_for_chain(model, hops=3)
        output = model.generate(prompt(), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(output, references["llama"].sequences)


def test_sampling_with_a_seed_equals_single_process(swarm, tiny_models):
    path = tiny_models["qwen2"]
    reference_model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(7)
    with torch.inference_mode():
        reference = reference_model.generate(prompt(3), max_new_tokens=24, do_sample=True, temperature=1.5, top_k=0)
    with connect(swarm, path, "qwen2-k2") as model:
        wait_for_chain(model, hops=2)
        torch.manual_seed(7)
        output = model.generate(prompt(3), max_new_tokens=24, do_sample=True, temperature=1.5, top_k=0)
    assert torch.equal(output, reference)


def test_inference_session_is_shared_by_generate_calls(swarm, tiny_models, references):
    reference = references["mistral"].sequences
    with connect(swarm, tiny_models["mistral"], "mistral-k2") as model:
        wait_for_chain(model, hops=2)
        with model.inference_session(max_length=PROMPT_LENGTH + NEW_TOKENS) as session:
            first = model.generate(prompt(), max_new_tokens=20, min_new_tokens=20, do_sample=False)
            assert session.position == PROMPT_LENGTH + 19  # the last token is not yet in the caches
            # only new tokens are given: the session puts its own tokens in front
            second = model.generate(
                reference[:, first.shape[1] : first.shape[1] + 4], max_new_tokens=10, min_new_tokens=10, do_sample=False
            )
    assert torch.equal(first, reference[:, : PROMPT_LENGTH + 20])
    assert torch.equal(second, reference[:, : PROMPT_LENGTH + 34])


def test_two_clients_at_once_get_their_reference_tokens(swarm, tiny_models):
    path = tiny_models["llama"]
    reference_model = AutoModelForCausalLM.from_pretrained(path)
    prompts = [prompt(11), prompt(12, length=9)]
    with torch.inference_mode():
        expected = [reference_model.generate(p, max_new_tokens=40, min_new_tokens=40, do_sample=False) for p in prompts]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def client(index: int) -> None:
        try:
            with connect(swarm, path, "llama-k2") as model:
                wait_for_chain(model, hops=2)
                barrier.wait(timeout=60)
                results[index] = model.generate(prompts[index], max_new_tokens=40, min_new_tokens=40, do_sample=False)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors
    for index in range(2):
        assert torch.equal(results[index], expected[index])


@pytest.mark.parametrize("lanes", [True, False], ids=["data-lanes", "libp2p"])
def test_forward_without_session_matches_full_model(swarm, tiny_models, lanes):
    path = tiny_models["qwen2"]
    reference_model = AutoModelForCausalLM.from_pretrained(path)
    input_ids = torch.randint(3, 1000, (3, 20), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = reference_model(input_ids).logits
    with connect(swarm, path, "qwen2-k3") as model:
        chain = wait_for_chain(model, hops=3)
        if not lanes:  # as a client of nodes without data lanes sees them
            model.swarm.use_lanes = False
        with torch.inference_mode():
            logits = model(input_ids).logits
            again = model(input_ids).logits  # on the lanes kept open, when there are lanes
        held = set(model.swarm._forward_lanes)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(again, expected, atol=1e-4, rtol=0)
    assert held == ({hop.peer_id for hop in chain.hops} if lanes else set())


@pytest.mark.parametrize("lanes", [True, False], ids=["data-lanes", "libp2p"])
def test_a_forward_larger_than_a_unary_call_is_carried_whole(swarm, tiny_models, lanes):
    """Hidden states of 9 x 1900 tokens (4.4 MB in float32) are over p2pd's 4 MiB bound on a unary call: without a
    data lane the forward goes on a libp2p stream of its own, and both ways give the single process's logits."""
    path = tiny_models["llama"]
    prefix = f"llama-wide-{'lanes' if lanes else 'libp2p'}"
    node = swarm.start_node(path, 0, 4, dht_prefix=prefix, max_tokens_per_step=32768)
    try:
        input_ids = torch.randint(3, 1000, (9, 1900), generator=torch.Generator().manual_seed(8))
        with torch.inference_mode():
            expected = AutoModelForCausalLM.from_pretrained(path)(input_ids).logits
        with connect(swarm, path, prefix) as model:
            wait_for_chain(model, hops=1)
            model.swarm.use_lanes = lanes
            assert input_ids.numel() * model.config.hidden_size * 4 > rpc.MAX_UNARY_BYTES
            with torch.inference_mode():
                logits = model(input_ids).logits
            assert set(model.swarm._forward_lanes) == ({node.peer_id} if lanes else set())
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    finally:
        swarm.stop_node(node)


def test_a_chain_may_use_part_of_a_nodes_span(swarm, tiny_models, references):
    with connect(swarm, tiny_models["llama"], "llama-overlap") as model:
        chain = wait_for_chain(model, hops=2, max_length=PROMPT_LENGTH + NEW_TOKENS)
        spans = [(hop.start_block, hop.end_block) for hop in chain.hops]
        assert spans in ([(0, 3), (3, 4)], [(0, 2), (2, 4)])  # blocks 2 run once, on one of the two nodes
        output = model.generate(prompt(), **GREEDY_WITH_LOGITS)
        # blocks outside a node's span are refused with a typed error
        second = next(node for node in swarm.nodes if node.peer_id == chain.hops[1].peer_id)
        outside = Hop(second.peer_id, 0, 2)
        with pytest.raises(BadRequestError, match=r"serves blocks 2\.\.3, not 0\.\.1"):
            model.call(model.swarm.forward(outside, torch.zeros(1, 2, model.config.hidden_size)))
    assert torch.equal(output.sequences, references["llama"].sequences)
    torch.testing.assert_close(output.logits[-1], references["llama"].logits[-1], atol=1e-4, rtol=0)


def test_a_node_refusing_blocks_it_no_longer_serves_is_routed_around(swarm, tiny_models, references):
    """A record can be stale (its node moved to other blocks): the wrong_blocks refusal at open makes the client ban
    that node and choose again, and the tokens are unchanged."""
    moved = next(node for node in swarm.nodes if (node.start_block, node.end_block) == (1, 3))  # from llama-k3
    with connect(swarm, tiny_models["llama"], "llama-k2") as model:
        wait_for_chain(model, hops=2, max_length=PROMPT_LENGTH + NEW_TOKENS)
        correct = model.router.chain_selector
        stale_used = []

        def stale_first(snapshot, request):
            if moved.peer_id in request.exclude:
                return correct(snapshot, request)
            stale_used.append(True)  # as if its record still said blocks 0:4
            return Chain((Hop(moved.peer_id, 0, 4),))

        model.router.chain_selector = stale_first
        output = model.generate(prompt(), **GREEDY_WITH_LOGITS)
        assert stale_used and moved.peer_id in model.swarm.banned()
        assert moved.peer_id not in model.last_chain.peer_ids
    assert torch.equal(output.sequences, references["llama"].sequences)
