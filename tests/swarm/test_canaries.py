"""Known-answer canaries live (verify="canary:P", client/canaries.py): honest nodes pass every canary; each cheat of
devtools/malicious.py is caught, the node banned; and the only node of a span, which no audit can judge, is checked
too: caught, the user gets an error rather than its tokens, and with an honest node back the reference."""

from __future__ import annotations

import json
import random
import urllib.request

import pytest
import torch

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.canaries import RESULTS, CanaryChecker
from nesa_node.client.config import ClientConfig
from nesa_node.devtools.malicious import make_malicious
from nesa_node.errors import CanaryFileError, NoRouteError, PeerUnavailableError
from nesa_node.routing.snapshot import Chain, Hop
from nesa_node.verification.canaries import FORMAT, build_canaries
from nesa_node.verification.commitment import commit_window, compare, tolerance_for
from tests.support.models import greedy_tokens
from tests.support.swarm import client_seeing, step_held_up, wait_until

PREFIX = "canaries"
SPANS = [(0, 2), (2, 4)]
PROMPT = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(5))
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def canary_file(tiny_llama, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("canaries") / "canaries.safetensors"
    build_canaries(tiny_llama, count=6, tokens=24, seed=11).write(path)
    return str(path)


@pytest.fixture(scope="module")
def honest_nodes(module_swarm, tiny_llama):
    nodes = [module_swarm.start_node(tiny_llama, *span, dht_prefix=PREFIX) for span in SPANS for _ in range(2)]
    yield nodes
    for node in nodes:
        module_swarm.stop_node(node)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return greedy_tokens(tiny_llama, PROMPT, NEW_TOKENS)


def connect(module_swarm, tiny_llama, nodes, prefix=PREFIX, **options):
    return client_seeing(module_swarm, tiny_llama, nodes, dht_prefix=prefix, compression="none", **options)


def generate(model) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


def hop_of(node) -> Hop:
    info = node.current_info()
    return Hop(node.peer_id, info.start_block, info.end_block)


def test_honest_nodes_pass_every_canary_and_the_generation_is_the_reference(
    module_swarm, tiny_llama, honest_nodes, canary_file, reference
):
    with connect(module_swarm, tiny_llama, honest_nodes, verify="canary:1.0", canaries=canary_file) as model:
        assert torch.equal(generate(model), reference)
        report = model.client.last_verification
        assert report["mode"] == "canary:1"
        assert report["checks"] == {"passed": 2, "failed": 0, "inconclusive": 0, "skipped": 0, "unanswered": 0}
        assert report["blamed"] == [] and "2 of 2 nodes" in report["checked"]
        # canaries through every node, for its whole span and each of its blocks as a chain may use them: no alarm
        checker = CanaryChecker(model.client, 1.0, model.client.canary_checker.canaries, random.Random(1))
        passed = 0
        for node in honest_nodes:
            whole = hop_of(node)
            parts = [Hop(node.peer_id, block, block + 1) for block in range(whole.start_block, whole.end_block)]
            for hop in [whole, whole, *parts]:
                outcome = model.call(checker.check(Chain(hops=(hop,)), max_length=64, prompt_tokens=5))
                assert outcome.checks == {**dict.fromkeys(RESULTS, 0), "passed": 1} and outcome.clean, outcome
                passed += 1
        assert passed == 4 * len(honest_nodes)
        # at rate P, each node of a chain is sampled with chance P, and each sampled node counts once
        sampling = CanaryChecker(model.client, 0.5, model.client.canary_checker.canaries, random.Random(4))
        chain = Chain(hops=tuple(hop_of(node) for node in honest_nodes[::2]))
        outcomes = [model.call(sampling.check(chain)) for _ in range(8)]
        assert {outcome.nodes for outcome in outcomes} == {2}
        assert 0 < sum(outcome.sampled for outcome in outcomes) < 16
        assert all(sum(outcome.checks.values()) == outcome.sampled == outcome.checks["passed"] for outcome in outcomes)
        assert not model.swarm.banned()


def test_a_node_held_up_for_a_moment_mid_canary_still_answers_it(module_swarm, tiny_llama, honest_nodes, canary_file):
    """A canary session has one node and no failover: a step the node's busy machine holds up past a generation's
    adaptive deadline (10x the recent steps, at least 1 s) must not make an honest node unanswered."""
    node = honest_nodes[0]
    # the prompt and 8 one-token steps fast, so the adaptive deadline would be 1 s, then the 10th held up
    with step_held_up(node, at=10, seconds=1.5) as held:
        with connect(module_swarm, tiny_llama, honest_nodes, verify="canary:1.0", canaries=canary_file) as model:
            checker = CanaryChecker(model.client, 1.0, model.client.canary_checker.canaries, random.Random(3))
            outcome = model.call(checker.check(Chain(hops=(hop_of(node),)), max_length=64, prompt_tokens=5))
            assert outcome.checks == {**dict.fromkeys(RESULTS, 0), "passed": 1} and outcome.clean, outcome
            assert held.steps > 10  # the held-up step and the canary's steps after it


def test_honest_nodes_in_bfloat16_pass_within_the_files_measured_rounding(module_swarm, tiny_llama, canary_file):
    """A bfloat16 node and a client sending bfloat16 (the swarm's dtype, by default): rounding errs several times
    the float32 tolerance, and the file's calibration keeps it from being taken for a cheat, not a cheat from being
    caught."""
    prefix = "canaries-bf16"
    nodes = [module_swarm.start_node(tiny_llama, 0, 4, dht_prefix=prefix, dtype="bfloat16")]
    try:
        with connect(module_swarm, tiny_llama, nodes, prefix, verify="canary:1.0", canaries=canary_file) as model:
            assert model.client.dtype == torch.bfloat16
            canaries = model.client.canary_checker.canaries
            checker = CanaryChecker(model.client, 1.0, canaries, random.Random(5))
            for _ in range(6):
                outcome = model.call(checker.check(Chain(hops=(hop_of(nodes[0]),)), max_length=40))
                assert outcome.checks["passed"] == 1, outcome
            # the same outputs held to float32's tolerance would fail: the widening is what passes them
            given, answer = canaries.case(0, 0, 4)
            with torch.inference_mode():
                output = model.call(model.client.remote_forward(given.to(torch.bfloat16)))
            strict = compare(commit_window(answer), output.float(), tolerance_for("float32", "float32"))
            assert not strict.matches
            assert compare(
                commit_window(answer), output.float(), canaries.tolerance(0, 4, "bfloat16", "bfloat16")
            ).matches
            generate(model)
            assert model.client.last_verification["checks"]["passed"] == 1
            # the widened bound still catches a bfloat16 node skipping a block
            cheat = module_swarm.start_node(tiny_llama, 0, 4, dht_prefix=prefix, dtype="bfloat16")
            nodes.append(cheat)
            make_malicious(cheat, "skip_block", seed=3)
            wait_until(lambda: cheat.peer_id in {r.info.peer_id for r in model.call(model.swarm.node_records(True))})
            outcome = model.call(checker.check(Chain(hops=(hop_of(cheat),))))
            assert [blame.peer_id for blame in outcome.blamed] == [cheat.peer_id], outcome
    finally:
        for node in nodes:
            module_swarm.stop_node(node)


def test_the_gateway_checks_each_answer_with_canaries_and_counts_the_checks(
    module_swarm, tiny_llama, honest_nodes, canary_file
):
    from tests.support.gateway import complete, gateway_over, metrics_text

    options = {"verify": "canary:1.0", "canaries": canary_file}
    with gateway_over(module_swarm, tiny_llama, honest_nodes, dht_prefix=PREFIX, **options) as served:
        answer = complete(served, {"model": "tiny", "prompt": "import os", "max_tokens": 6, "temperature": 0})
        report = answer["nesa"]["verification"]
        assert report["mode"] == "canary:1" and report["blamed"] == []
        assert report["checks"]["passed"] == 2 and report["checks"]["failed"] == 0  # each node of the chain
        metrics = metrics_text(served)
        assert 'nesa_gateway_verification_checks_total{result="passed"} 2.0' in metrics
        assert 'nesa_gateway_verification_checks_total{result="unanswered"} 0.0' in metrics
        # a streamed answer ends without waiting for its checks, which run on and are counted
        body = {"model": "tiny", "prompt": "import os", "max_tokens": 6, "temperature": 0, "stream": True}
        request = urllib.request.Request(
            served.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.read().endswith(b"data: [DONE]\n\n")
        passed = 'nesa_gateway_verification_checks_total{result="passed"} 4.0'
        wait_until(lambda: passed in metrics_text(served), timeout_s=60)


@pytest.mark.parametrize("mode", ["perturbed", "nf4_as_announced", "skip_block", "noisy", "lazy"])
def test_each_cheat_fails_its_canaries_and_is_banned(module_swarm, tiny_llama, honest_nodes, canary_file, mode):
    cheat = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=PREFIX)
    make_malicious(cheat, mode, seed=3, **({"rate": 0.5, "scale": 0.05} if mode == "noisy" else {}))
    try:
        options = {"verify": "canary:1.0", "canaries": canary_file, "config": ClientConfig(step_timeout_s=60.0)}
        with connect(module_swarm, tiny_llama, honest_nodes + [cheat], **options) as model:
            checker = CanaryChecker(model.client, 1.0, model.client.canary_checker.canaries, random.Random(2))
            honest = next(node for node in honest_nodes if node.current_info().start_block == 0)
            outcome = model.call(checker.check(Chain(hops=(hop_of(honest), hop_of(cheat)))))
            assert [blame.peer_id for blame in outcome.blamed] == [cheat.peer_id]
            assert outcome.checks == {**dict.fromkeys(RESULTS, 0), "passed": 1, "failed": 1}
            assert all("canary" in reason for reason in outcome.blamed[0].reasons)
            assert set(model.swarm.banned()) == {cheat.peer_id}
    finally:
        module_swarm.stop_node(cheat)


def test_the_only_node_of_a_span_is_checked_where_no_audit_can_be(module_swarm, tiny_llama, canary_file, reference):
    prefix = "canaries-solo"
    first = module_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    cheat = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    make_malicious(cheat, "skip_block", seed=3)
    spare = None
    try:
        # an audit needs another node of the span to re-execute it: with none, it concludes nothing
        with connect(module_swarm, tiny_llama, [first, cheat], prefix, verify="audit:1.0") as model:
            assert not torch.equal(generate(model), reference)  # the cheat's tokens go through unseen
            assert model.client.last_verification["checks"]["inconclusive"] > 0
            assert model.client.last_verification["blamed"] == []
        options = {"verify": "canary:1.0", "canaries": canary_file, "config": ClientConfig(step_timeout_s=60.0)}
        with connect(module_swarm, tiny_llama, [first, cheat], prefix, **options) as model:
            with pytest.raises((NoRouteError, PeerUnavailableError)):  # blamed, banned: no node left for 2:4
                generate(model)
            assert model.client.last_verification["blamed"] == [cheat.peer_id]
            assert cheat.peer_id in model.swarm.banned()
            spare = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
            wait_until(lambda: spare.peer_id in {r.info.peer_id for r in model.call(model.swarm.node_records(True))})
            assert torch.equal(generate(model), reference)
            assert (
                model.client.last_verification["blamed"] == []
                and not model.client.last_verification["checks"]["failed"]
            )
    finally:
        for node in (first, cheat, spare):
            if node is not None:
                module_swarm.stop_node(node)


def test_canary_settings_are_checked_before_joining(tiny_llama, tmp_path, canary_file):
    with pytest.raises(CanaryFileError, match="nesa-node model canaries"):
        DistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[], verify="canary:0.5")
    other = tmp_path / "other.safetensors"
    build_canaries(tiny_llama, count=1, tokens=4, seed=1).write(other)
    data = bytearray(other.read_bytes())
    data[data.index(FORMAT.encode()) + len(FORMAT) - 1] = ord("9")  # another format version
    other.write_bytes(bytes(data))
    with pytest.raises(CanaryFileError, match="not a canary file"):
        DistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[], verify="canary:0.5", canaries=other)
    with pytest.raises(ValueError, match="canary"):
        DistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[], canaries=canary_file)
