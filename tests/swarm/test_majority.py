"""Majority verification live (client/majority.py, verify="majority:3"): three disjoint replicas per voted span,
strict majority. One cheater among three is outvoted and banned and the tokens equal the reference; two colluding
cheaters with identical output win (the honest-majority limit, asserted); two cheaters that disagree give
NoConsensusError. Cheaters come from devtools/malicious.py and announce honest records."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.config import VerifyPolicy
from nesa_node.client.majority import vote
from nesa_node.devtools.malicious import make_malicious
from nesa_node.errors import NoConsensusError, NoRouteError
from tests.support.swarm import wait_until

PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35]])
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(tiny_llama)
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


def generate(model) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


def swarm_with(module_swarm, tiny_llama, prefix: str, spans, cheats: dict[int, dict]):
    """Nodes of `spans` under `prefix`; node i cheats as cheats[i] (make_malicious keywords)."""
    nodes = [module_swarm.start_node(tiny_llama, start, end, dht_prefix=prefix) for start, end in spans]
    for index, settings in cheats.items():
        make_malicious(nodes[index], **settings)
    return nodes


def connect(module_swarm, tiny_llama, prefix: str, nodes, verify: str):
    model = DistributedModelForCausalLM.from_pretrained(
        tiny_llama,
        initial_peers=module_swarm.initial_peers,
        dht_prefix=prefix,
        compression="none",
        verify=verify,
    )
    wanted = {node.peer_id for node in nodes}
    wait_until(lambda: wanted <= {r.info.peer_id for r in model.call(model.swarm.node_records(fresh=True))}, 30)
    return model


def run_case(module_swarm, tiny_llama, prefix, spans, cheats, verify="majority:3"):
    nodes = swarm_with(module_swarm, tiny_llama, prefix, spans, cheats)
    model = connect(module_swarm, tiny_llama, prefix, nodes, verify)
    return nodes, model


def stop(module_swarm, nodes, model) -> None:
    model.close()
    for node in nodes:
        module_swarm.stop_node(node)


def test_honest_replicas_of_the_voted_span_agree_and_give_the_reference(module_swarm, tiny_llama, reference):
    spans = [(0, 2), (2, 4), (2, 4), (2, 4)]
    nodes, model = run_case(module_swarm, tiny_llama, "majority-honest", spans, {}, verify="majority:3@2:4")
    try:
        with model.inference_session(max_length=32) as session:
            assert torch.equal(generate(model), reference)
            report = session.verification
        assert report["voted_blocks"] == [[2, 4]]
        assert report["checks"] == {"agreed": NEW_TOKENS, "outvoted": 0, "no_consensus": 0}
        assert report["outvoted"] == [] and not model.swarm.banned()
    finally:
        stop(module_swarm, nodes, model)


def test_an_honest_bfloat16_replica_beside_float32_ones_is_held_to_bfloat16s_rounding(module_swarm, tiny_llama):
    """The vote's tolerance is the widest of the replicas' dtypes (their records) and the client's: an honest node
    computing in bfloat16 among float32 ones agrees with them, and is neither outvoted nor banned."""
    prefix = "majority-mixed-dtypes"
    nodes = [module_swarm.start_node(tiny_llama, 0, 4, dht_prefix=prefix) for _ in range(2)]
    nodes.append(module_swarm.start_node(tiny_llama, 0, 4, dht_prefix=prefix, dtype="bfloat16"))
    model = connect(module_swarm, tiny_llama, prefix, nodes, "majority:3")
    try:
        assert model.client.dtype == torch.float32  # the swarm's most common dtype
        with model.inference_session(max_length=32) as session:
            generate(model)
            report = session.verification
        assert report["checks"]["outvoted"] == 0 and report["outvoted"] == [], report
        assert report["checks"]["agreed"] == NEW_TOKENS and not model.swarm.banned()
    finally:
        stop(module_swarm, nodes, model)


@pytest.mark.parametrize("mode", ["perturbed", "nf4_as_announced", "skip_block", "lazy", "noisy"])
def test_one_cheater_among_three_is_outvoted_banned_and_the_tokens_are_the_reference(
    module_swarm, tiny_llama, reference, mode
):
    settings = {"mode": mode, "rate": 1.0} if mode == "noisy" else {"mode": mode}
    nodes, model = run_case(module_swarm, tiny_llama, f"majority-one-{mode}", [(0, 4)] * 3, {1: settings})
    cheat = nodes[1].peer_id
    try:
        with model.inference_session(max_length=32) as session:
            assert torch.equal(generate(model), reference)
            report = session.verification
        assert report["outvoted"] == [cheat]
        assert report["checks"]["outvoted"] == 1 and report["checks"]["no_consensus"] == 0
        assert cheat in model.swarm.banned()
    finally:
        stop(module_swarm, nodes, model)


def test_two_colluding_cheaters_with_identical_output_win(module_swarm, tiny_llama, reference):
    same = {"mode": "lazy"}  # both return their input: identical outputs, and other tokens
    nodes, model = run_case(module_swarm, tiny_llama, "majority-collude", [(0, 4)] * 3, {1: same, 2: same})
    honest = nodes[0].peer_id
    try:
        with model.inference_session(max_length=32) as session:
            produced = generate(model)
            report = session.verification
        assert not torch.equal(produced, reference)  # the colluders' tokens: majority voting assumes an honest majority
        assert report["outvoted"] == [honest]
    finally:
        stop(module_swarm, nodes, model)


def test_two_cheaters_that_disagree_give_no_consensus(module_swarm, tiny_llama):
    cheats = {1: {"mode": "perturbed", "seed": 1}, 2: {"mode": "perturbed", "seed": 2}}
    nodes, model = run_case(module_swarm, tiny_llama, "majority-split", [(0, 4)] * 3, cheats)
    try:
        with pytest.raises(NoConsensusError, match="no output has a strict majority") as raised:
            generate(model)
        assert set(raised.value.peer_ids) == {node.peer_id for node in nodes}
    finally:
        stop(module_swarm, nodes, model)


def test_too_few_disjoint_replicas_is_a_clear_no_route(module_swarm, tiny_llama):
    nodes, model = run_case(module_swarm, tiny_llama, "majority-few", [(0, 4)] * 2, {})
    try:
        with pytest.raises(NoRouteError, match="needs 3 disjoint replicas of blocks 0:4; found 2"):
            generate(model)
    finally:
        stop(module_swarm, nodes, model)


def test_the_vote_is_a_strict_majority():
    a, b, c = torch.ones(1, 1, 4), torch.full((1, 1, 4), 2.0), torch.full((1, 1, 4), 3.0)
    assert vote([a, a, b], 1e-3) == (0, [0, 1])
    assert vote([b, a, a], 1e-3) == (1, [1, 2])
    assert vote([a, b, c], 1e-3) is None
    assert vote([a, None, None], 1e-3) is None  # one of three is no majority
    assert vote([a, a, None, None], 1e-3) is None  # two of four is not more than half
    assert vote([a, a, a, b], 1e-3) == (0, [0, 1, 2])
    with pytest.raises(ValueError, match="majority:N"):
        VerifyPolicy.parse("majority:2")
    assert str(VerifyPolicy.parse("majority:3@2:4")) == "majority:3@2:4"


def test_the_gateway_reports_the_vote_in_the_answer_and_its_metrics(module_swarm, tiny_llama):
    from tests.support.gateway import complete, gateway_over, metrics_text

    prefix = "majority-gateway"
    nodes = swarm_with(module_swarm, tiny_llama, prefix, [(0, 4)] * 3, {2: {"mode": "lazy"}})
    try:
        with gateway_over(module_swarm, tiny_llama, nodes, dht_prefix=prefix, verify="majority:3") as served:
            answer = complete(served, {"model": "tiny", "prompt": "import os", "max_tokens": 4, "temperature": 0})
            report = answer["nesa"]["verification"]
            assert report["mode"] == "majority:3" and report["outvoted"] == [nodes[2].peer_id]
            assert report["checks"] == {"agreed": 3, "outvoted": 1, "no_consensus": 0}
            metrics = metrics_text(served)
            assert 'nesa_gateway_verification_checks_total{result="outvoted"} 1.0' in metrics
            assert 'nesa_gateway_verification_checks_total{result="agreed"} 3.0' in metrics
    finally:
        for node in nodes:
            module_swarm.stop_node(node)
