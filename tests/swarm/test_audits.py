"""Sampled audits live (verify="audit:P", client/audit.py): nodes sign a commitment per 32-token window, the client
re-executes sampled windows on other nodes stage by stage from its own inputs. Honest chains raise no false alarm
over thousands of windows across codecs; each malicious mode (devtools/malicious.py) in the middle of three stages
is caught, the right node blamed and banned, and the user's tokens equal the reference."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nesa_node.client.config import ClientConfig
from nesa_node.client.session import InferenceSession
from nesa_node.devtools.malicious import make_malicious
from nesa_node.verification.audit import audit as audit_receipts
from nesa_node.verification.audit import audit_file
from tests.support.adapters import save_random_adapter
from tests.support.models import greedy_tokens
from tests.support.swarm import client_seeing

PREFIX = "audits"
SPANS = [(0, 1), (1, 3), (3, 4)]
COPIES = 3  # per span: the chain's node, an auditor, a second auditor to confirm a failed check
PROMPT = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(3))
NEW_TOKENS = 30  # 70 positions: windows 0, 1 and 2 (a partial one)


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> str:
    return str(save_random_adapter(tiny_llama, tmp_path_factory.mktemp("audit-adapter") / "a", seed=4, r=4))


@pytest.fixture(scope="module")
def audit_swarm(module_swarm, tiny_llama, adapter):
    nodes = [
        module_swarm.start_node(tiny_llama, start, end, dht_prefix=PREFIX, adapters=(adapter,))
        for start, end in SPANS
        for _ in range(COPIES)
    ]
    yield nodes
    for node in nodes:
        module_swarm.stop_node(node)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return greedy_tokens(tiny_llama, PROMPT, NEW_TOKENS)


def connect(module_swarm, tiny_llama, nodes, **options):
    return client_seeing(module_swarm, tiny_llama, nodes, dht_prefix=PREFIX, **options)


def generate(model) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


def test_an_honest_chain_passes_every_window_and_its_receipts_check_offline(
    module_swarm, tiny_llama, audit_swarm, reference, tmp_path
):
    with connect(module_swarm, tiny_llama, audit_swarm, verify="audit:1.0", compression="none") as model:
        assert torch.equal(generate(model), reference)
        report = model.client.last_verification
        assert report["checks"] == {"passed": 9, "failed": 0, "inconclusive": 0, "unrecorded": 0}  # 3 hops x 3
        assert report["blamed"] == [] and "audited at rate 1" in report["audited"]
        assert not model.swarm.banned()
        receipts = model.client.last_receipts.save(tmp_path / "receipts.json")
    assert audit_file(receipts).ok
    good = subprocess.run(
        [sys.executable, "-m", "nesa_node.cli", "audit", str(receipts)], capture_output=True, text=True
    )
    assert good.returncode == 0, good.stdout + good.stderr
    data = bytearray(receipts.read_bytes())
    position = data.index(b'"signature": "') + 20  # a byte inside a node's signature
    data[position] = ord("0") if data[position] != ord("0") else ord("1")
    receipts.write_bytes(bytes(data))
    bad = subprocess.run(
        [sys.executable, "-m", "nesa_node.cli", "audit", str(receipts)], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stdout + bad.stderr


def cheating_chain(model, cheat, others):
    """A chain through `cheat` for the middle span (the other middle nodes left out of this one choice)."""
    return model.call(model.client.choose_chain(max_length=128, exclude=frozenset(others)))


@pytest.mark.parametrize("mode", ["perturbed", "nf4_as_announced", "skip_block", "wrong_adapter", "noisy", "lazy"])
def test_each_cheat_in_the_middle_stage_is_caught_blamed_banned_and_the_tokens_are_the_reference(
    module_swarm, tiny_llama, audit_swarm, adapter, reference, mode
):
    cheat = module_swarm.start_node(tiny_llama, 1, 3, dht_prefix=PREFIX, adapters=(adapter,))
    settings = {"rate": 0.5, "scale": 0.05} if mode == "noisy" else {}
    make_malicious(cheat, mode, seed=2, **settings)
    middle = [node.peer_id for node in audit_swarm if node.current_info().start_block == 1]
    try:
        # the cheated session has no failover: a step stalled by a loaded host (over 10x the last ones) must not end
        # it, as the adaptive deadline would; what is judged here is the audit
        options = {"verify": "audit:1.0", "compression": "none", "config": ClientConfig(step_timeout_s=60.0)}
        with connect(module_swarm, tiny_llama, audit_swarm + [cheat], **options) as model:
            client = model.client
            adapter_id = model.call(client.resolve_adapter(adapter)) if mode == "wrong_adapter" else None
            chain = cheating_chain(model, cheat, middle)
            assert chain.peer_ids[1] == cheat.peer_id

            async def cheated_run():
                session = InferenceSession(
                    client.swarm, chain, client.config, batch=1, max_length=128, adapter=adapter_id, commit=True
                )
                async with session:
                    await client.generate(PROMPT, max_new_tokens=NEW_TOKENS, session=session)
                    return await client.audit(session), session.receipts.receipts(audit_rate=1.0)

            outcome, receipts = model.call(cheated_run())
            assert [blame.peer_id for blame in outcome.blamed] == [cheat.peer_id], outcome.checks
            assert outcome.blamed[0].hop == 1 and outcome.checks["passed"] >= 1  # the first hop's windows passed
            assert cheat.peer_id in model.swarm.banned()
            assert model.swarm.distrust[cheat.peer_id] < 1.0
            assert audit_receipts(receipts).ok  # the cheater's signed records are evidence: they check offline
            if mode != "wrong_adapter":  # the user's next generation avoids the banned node: reference tokens
                assert torch.equal(generate(model), reference)
                assert model.client.last_verification["blamed"] == []
    finally:
        module_swarm.stop_node(cheat)


@pytest.mark.parametrize("records", ["withheld", "stretched"])
def test_a_node_withholding_its_records_or_signing_them_for_other_tokens_is_blamed(
    module_swarm, tiny_llama, audit_swarm, reference, records
):
    """A node that cheats must not escape its audit by keeping its signed records back (every window unrecorded) or
    by signing each for tokens far past the session's (no window complete): either is blamed and banned, and the
    user's next generation avoids it."""
    import dataclasses

    from nesa_node.protocol.channel import frame
    from nesa_node.protocol.messages import Records, RecordsRequest
    from nesa_node.protocol.tensors import bytes_to_proto

    cheat = module_swarm.start_node(tiny_llama, 1, 3, dht_prefix=PREFIX)
    make_malicious(cheat, "perturbed", seed=2)
    honest_control, signer = cheat.inference._control, cheat.inference.signer

    def control(session, message):
        if not isinstance(message, RecordsRequest):
            return honest_control(session, message)
        kept = session.window_log.take(final=message.final)
        if records == "withheld":
            kept = []
        else:
            kept = [signer.sign(dataclasses.replace(r, token_end=r.token_start + 10**6, signature=b"")) for r in kept]
        return frame(Records(count=len(kept)), [bytes_to_proto(signer.public_key)] + [bytes_to_proto(r.to_bytes())
                                                                                       for r in kept])  # fmt: skip

    cheat.inference._control = control
    middle = [node.peer_id for node in audit_swarm if node.current_info().start_block == 1]
    try:
        options = {"verify": "audit:1.0", "compression": "none", "config": ClientConfig(step_timeout_s=60.0)}
        with connect(module_swarm, tiny_llama, audit_swarm + [cheat], **options) as model:
            client = model.client
            chain = cheating_chain(model, cheat, middle)
            assert chain.peer_ids[1] == cheat.peer_id

            async def cheated_run():
                session = InferenceSession(client.swarm, chain, client.config, batch=1, max_length=128, commit=True)
                async with session:
                    await client.generate(PROMPT, max_new_tokens=NEW_TOKENS, session=session)
                    return await client.audit(session)

            outcome = model.call(cheated_run())
            assert [blame.peer_id for blame in outcome.blamed] == [cheat.peer_id], outcome.checks
            assert outcome.blamed[0].record is None and outcome.checks["passed"] == 0  # nothing re-executed
            assert cheat.peer_id in model.swarm.banned() and model.swarm.distrust[cheat.peer_id] < 1.0
            assert torch.equal(generate(model), reference)  # the user's next generation avoids it
            assert model.client.last_verification["blamed"] == []
    finally:
        module_swarm.stop_node(cheat)


@pytest.mark.parametrize("codec", ["none", "fp16", "blockwise8"])
def test_honest_nodes_raise_no_false_alarm_over_thousands_of_windows(module_swarm, tiny_llama, audit_swarm, codec):
    """7 generations of 1024 positions per codec: 32 windows x 3 hops each, 672 windows per codec, 2016 in all."""
    prompts = torch.randint(3, 1000, (7, 1, 1000), generator=torch.Generator().manual_seed(17))
    totals = {"passed": 0, "failed": 0, "inconclusive": 0, "unrecorded": 0}
    with connect(module_swarm, tiny_llama, audit_swarm, verify="audit:1.0", compression=codec) as model:
        for prompt in prompts:
            model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
            for result, count in model.client.last_verification["checks"].items():
                totals[result] += count
        assert not model.swarm.banned()
    assert totals == {"passed": 672, "failed": 0, "inconclusive": 0, "unrecorded": 0}, totals


def test_the_gateway_audits_each_answer_and_counts_the_checks(module_swarm, tiny_llama, audit_swarm):
    from tests.support.gateway import complete, gateway_over, metrics_text

    with gateway_over(module_swarm, tiny_llama, audit_swarm, dht_prefix=PREFIX, verify="audit:1.0") as served:
        answer = complete(served, {"model": "tiny", "prompt": "import os", "max_tokens": 40, "temperature": 0})
        report = answer["nesa"]["verification"]
        assert report["mode"] == "audit:1" and report["blamed"] == []
        passed = report["checks"]["passed"]
        assert passed >= 3 and report["checks"]["failed"] == 0  # every window of every hop
        metrics = metrics_text(served)
        assert f'nesa_gateway_verification_checks_total{{result="passed"}} {float(passed)}' in metrics


def test_a_generation_whose_audit_blames_a_node_is_run_again_and_returns_the_reference(
    module_swarm, tiny_llama, audit_swarm, adapter, reference
):
    """A cheater serving the middle blocks is on the generation's first chain (the honest nodes of those blocks are
    left out of that one choice: which of two equal chains routing prefers is not what this test is about); the
    audit catches it, the client blames and bans it, runs the generation again without it and returns the
    reference tokens."""
    cheat = module_swarm.start_node(tiny_llama, 1, 3, dht_prefix=PREFIX, adapters=(adapter,))
    make_malicious(cheat, "lazy")
    honest_middle = frozenset(node.peer_id for node in audit_swarm if node.current_info().start_block == 1)
    try:
        with connect(module_swarm, tiny_llama, audit_swarm + [cheat], verify="audit:1.0", compression="none") as model:
            choose_chain = model.client.choose_chain
            chosen = []

            async def first_without_the_honest_middle(*, exclude_more=frozenset(), **request):
                if not chosen:
                    exclude_more = exclude_more | honest_middle
                chain = await choose_chain(exclude_more=exclude_more, **request)
                chosen.append(chain)
                return chain

            model.client.choose_chain = first_without_the_honest_middle
            assert torch.equal(generate(model), reference)
            assert cheat.peer_id in chosen[0].peer_ids
            assert len(chosen) >= 2 and all(cheat.peer_id not in chain.peer_ids for chain in chosen[1:])
            assert model.client.last_verification["blamed"] == [cheat.peer_id]
            assert cheat.peer_id in model.swarm.banned()
    finally:
        module_swarm.stop_node(cheat)
