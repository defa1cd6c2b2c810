"""Node daemon behaviour: cache budget, identity across restarts, signed records, status, demo."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.errors import CacheBudgetError, NoRouteError
from nesa_node.protocol.dht import fetch_node_infos
from nesa_node.routing.chain import Chain, Hop
from tests.support.swarm import wait_for_chain, wait_until


def test_session_over_budget_is_refused_and_cache_returns_to_baseline(local_swarm, tiny_llama):
    # one client takes most of the cache here: the per-peer share is lifted to test the node's own budget
    # and idle sessions are not preempted within the test, so a full cache refuses
    node = local_swarm.start_node(
        tiny_llama, 0, 4, max_cache_tokens=64, max_cache_share_per_peer=1.0, preempt_idle_s=600.0, dht_prefix="budget"
    )
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="budget"
    ) as model:
        wait_for_chain(model)

        def tokens_left() -> int:
            return model.call(model.swarm.info(node.peer_id)).cache_tokens_left

        baseline = tokens_left()
        assert baseline == 64
        chain = Chain(hops=(Hop(node.peer_id, 0, 4),))
        with pytest.raises(CacheBudgetError) as refused:
            model.session_on(chain, batch=1, max_length=65)
        assert refused.value.code == "cache_budget"
        assert tokens_left() == baseline
        # routing does not pick a node whose cache cannot hold the session
        with pytest.raises(NoRouteError, match="blocks 0-3"):
            model.choose_chain(max_length=65)

        first = model.session_on(chain, batch=1, max_length=24)
        second = model.session_on(chain, batch=2, max_length=16)
        first.step(torch.randn(1, 5, 64))
        assert tokens_left() == baseline - 24 - 32
        with pytest.raises(CacheBudgetError):
            model.session_on(chain, batch=1, max_length=9)
        first.close()
        second.close()
        wait_until(lambda: tokens_left() == baseline)
        # generation still works on the freed budget
        output = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, do_sample=False)
        assert output.shape == (1, 11)
        wait_until(lambda: tokens_left() == baseline)
    assert node.sessions.sessions == {}


PROMPTS = [torch.tensor([[5 + index, 6, 7, 8]]) for index in range(4)]
LONG = 140  # new tokens: past the 128 a session reserves at open, so each grows


def generate_all(model, prompts):
    """Every prompt's generation at once on `model`'s loop (exceptions returned, not raised)."""

    async def run():
        return await asyncio.gather(
            *(model.client.generate(prompt, max_new_tokens=LONG, do_sample=False) for prompt in prompts),
            return_exceptions=True,
        )

    return model.call(run(), timeout=180)


def sdk(local_swarm, tiny_llama, prefix):
    return DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix=prefix, compression="none"
    )


def test_one_clients_sessions_outgrow_its_share_on_a_node_nobody_else_uses(local_swarm, tiny_llama):
    """Four sessions of one client (a gateway's users are one peer) open within its share (128 tokens each of 512)
    and grow past it to 144 each: the node lends what nobody else uses, and every generation is the reference (a
    growth past the share used to fail its session in the middle)."""
    node = local_swarm.start_node(tiny_llama, 0, 4, max_cache_tokens=1024, dht_prefix="lend")
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.inference_mode():
        expected = [reference.generate(p, max_new_tokens=LONG, min_new_tokens=LONG, do_sample=False) for p in PROMPTS]
    try:
        with sdk(local_swarm, tiny_llama, "lend") as model:
            wait_for_chain(model)
            peak, done = [], threading.Event()

            def watch():
                while not done.is_set():
                    peak.append(node.budget.used_bytes)
                    time.sleep(0.005)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            try:
                outputs = generate_all(model, PROMPTS)
            finally:
                done.set()
                watcher.join()
        for output, reference_tokens in zip(outputs, expected, strict=True):
            assert torch.equal(output, reference_tokens), output
        assert max(peak) > node.sessions.peer_cache_bytes  # the sessions did hold more than the share at once
        wait_until(lambda: node.budget.used_bytes == 0)
    finally:
        local_swarm.stop_node(node)


def test_a_client_within_its_share_takes_lent_cache_back_and_the_borrower_is_told_why(local_swarm, tiny_llama):
    """One client's two sessions grow to 384 tokens each: the whole node, half of it lent past the client's share.
    Another client then opens a session: it gets its room, the borrower's newest session ends with an error that says
    why (its channels close right after: the client reads the reason first), and its other session finishes with the
    reference tokens."""
    node = local_swarm.start_node(tiny_llama, 0, 4, max_cache_tokens=768, preempt_idle_s=600.0, dht_prefix="back")
    prompts, new_tokens = PROMPTS[:2], 380  # 384 tokens a session: 128 at open, then 256, then 384
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.inference_mode():
        expected = [
            reference.generate(p, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            for p in prompts
        ]

    async def borrow(model):
        return await asyncio.gather(
            *(model.client.generate(prompt, max_new_tokens=new_tokens, do_sample=False) for prompt in prompts),
            return_exceptions=True,
        )

    results = {}
    try:
        with sdk(local_swarm, tiny_llama, "back") as borrower, sdk(local_swarm, tiny_llama, "back") as other:
            wait_for_chain(borrower)
            wait_for_chain(other)
            running = threading.Thread(target=lambda: results.update(out=borrower.call(borrow(borrower), timeout=180)))
            running.start()
            wait_until(lambda: node.budget.free_bytes == 0, timeout_s=120)  # the borrower holds the whole node
            output = other.generate(torch.tensor([[9, 8, 7, 6]]), max_new_tokens=LONG, do_sample=False)
            running.join(timeout=180)
        assert output.shape == (1, 4 + LONG)
        failed = [result for result in results["out"] if isinstance(result, Exception)]
        assert len(failed) == 1, results["out"]  # the newest: the other's open needed one session's room
        assert isinstance(failed[0], NoRouteError), repr(failed[0])
        assert "ended to give another peer its share of the node's cache" in failed[0].message, failed[0].message
        for result, reference_tokens in zip(results["out"], expected, strict=True):
            if not isinstance(result, Exception):
                assert torch.equal(result, reference_tokens)
        wait_until(lambda: node.budget.used_bytes == 0)
    finally:
        local_swarm.stop_node(node)


def test_sessions_that_outgrow_their_share_with_nothing_to_borrow_fail_saying_so(local_swarm, tiny_llama):
    """One client holds half the node; another's two sessions open within its share (128 tokens each of 256) and
    must grow past it with nothing free to borrow: the growth is refused, no other node serves the blocks, and the
    error the caller gets names the share, not only a ban."""
    node = local_swarm.start_node(tiny_llama, 0, 4, max_cache_tokens=512, preempt_idle_s=600.0, dht_prefix="share")
    try:
        with sdk(local_swarm, tiny_llama, "share") as holder, sdk(local_swarm, tiny_llama, "share") as model:
            wait_for_chain(holder)
            chain = Chain(hops=(Hop(node.peer_id, 0, 4),))
            held = [holder.session_on(chain, max_length=128) for _ in range(2)]  # 256: the holder's share
            wait_for_chain(model)
            outcomes = generate_all(model, PROMPTS[:2])
            for session in held:
                session.close()
        errors = [outcome for outcome in outcomes if isinstance(outcome, Exception)]
        assert errors, "both sessions fit: the test no longer outgrows the share"
        for error in errors:
            assert isinstance(error, NoRouteError), repr(error)
            assert f"the session lost {node.peer_id[-8:]} (blocks 0:4) to: " in error.message
            assert "past its share of the node's cache (256 tokens of batch 1, of which 256 are held), and the node " \
                "has no cache to lend it now" in error.message, error.message  # fmt: skip
        wait_until(lambda: node.budget.used_bytes == 0)
    finally:
        local_swarm.stop_node(node)


def test_c_identity_file_is_owner_only_and_keeps_the_peer_id_across_restarts(local_swarm, tiny_llama, tmp_path):
    identity = str(tmp_path / "node.key")
    node = local_swarm.start_node(tiny_llama, 0, 4, identity_path=identity, dht_prefix="restart")
    first_id = node.peer_id
    assert os.stat(identity).st_mode & 0o077 == 0  # owner-only key file
    local_swarm.stop_node(node)
    node = local_swarm.start_node(tiny_llama, 0, 4, identity_path=identity, dht_prefix="restart")
    assert node.peer_id == first_id
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    input_ids = torch.tensor([[9, 8, 7, 6]])
    with torch.inference_mode():
        expected = reference.generate(input_ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="restart", compression="none"
    ) as model:
        wait_until(lambda: _online_peers(model) == {first_id}, timeout_s=30)
        output = model.generate(input_ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert model.last_chain.peer_ids == (first_id,)
    assert torch.equal(output, expected)


def _online_peers(model) -> set[str]:
    records = model.call(model.swarm.node_records())
    return {record.info.peer_id for record in records if record.info.state.value == "online"}


def test_b_records_are_signed_and_a_forged_record_is_rejected(local_swarm, tiny_llama):
    node = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix="forgery")
    other = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix="forgery")
    records = local_swarm.run(fetch_node_infos(node.dht, "forgery"))
    assert {record.info.peer_id for record in records} == {node.peer_id, other.peer_id}
    # `other` signs a record claiming to be `node`, with inflated throughput: honest peers refuse it
    forged = node.current_info().model_copy(update={"inference_tps": 1e9})
    from nesa_node.protocol.dht import store_node_info

    local_swarm.run(store_node_info(other.dht, "forgery", forged, other.peer.signature_validator, 30))
    for reader in (node, other):
        records = local_swarm.run(fetch_node_infos(reader.dht, "forgery"))
        assert {record.info.peer_id for record in records} == {node.peer_id, other.peer_id}
        assert all(record.info.inference_tps < 1e9 for record in records)
    # the forged record never reaches the storage of a node that knows the model key
    forged_subkey = forged.peer_id.encode() + other.peer.signature_validator.local_public_key
    from hivemind.dht.routing import DHTID

    from nesa_node.protocol.dht import model_key

    stored = node.dht.protocol.storage.get(DHTID.generate(source=model_key("forgery")))
    assert stored is not None and forged_subkey not in dict(stored.value.items())


@pytest.mark.cli
def test_status_command_lists_nodes_and_missing_blocks(local_swarm, tiny_llama):
    node = local_swarm.start_node(tiny_llama, 0, 3, dht_prefix="status")
    command = [sys.executable, "-m", "nesa_node.cli", "status", "--model", tiny_llama, "--dht-prefix", "status"]
    result = subprocess.run(
        [*command, "--initial-peers", *local_swarm.initial_peers], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stderr
    assert "missing blocks: 3" in result.stdout
    assert "0:3" in result.stdout and node.peer_id[:10] in result.stdout
