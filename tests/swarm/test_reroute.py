"""Routing when the DHT holds no record of a live node (its announcements missed the replicas read, or a frozen
replica slows every read): the client asks the nodes it saw lately for the blocks directly, over libp2p."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import msgpack
import pytest
import torch
from hivemind.utils import get_dht_time
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.config import ClientConfig
from nesa_node.client.swarm import RECENT_RECORD_S
from nesa_node.devtools.chaos import AfterTokens
from nesa_node.devtools.launcher import ProcessGroup
from nesa_node.errors import NoRouteError
from nesa_node.protocol import push_tag
from nesa_node.protocol.dht import NodeRecord
from nesa_node.routing.chain import Chain, Hop
from tests.support.swarm import wait_for_chain, wait_until

pytestmark = pytest.mark.serial  # measures time: run alone, after the parallel pass (Makefile)

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])


def test_a_live_node_missing_from_the_dht_is_asked_directly(local_swarm, tiny_llama):
    # the node announces under another DHT prefix: the client's reads never return its record
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="announced-elsewhere")
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="read-here", compression="none"
    ) as model:
        with pytest.raises(NoRouteError, match="nodes seen for blocks 0:4: none"):
            model.choose_chain(max_length=32)  # a node the client never saw is not found
        # a record seen longer ago than the horizon: not asked
        model.swarm.hold([NodeRecord(info=node.current_info(), expiration_time=get_dht_time() - RECENT_RECORD_S - 5)])
        with pytest.raises(NoRouteError):
            model.choose_chain(max_length=32)
        # the same record, expired 30 s ago: the client asks the node, which answers with its live NodeInfo
        model.swarm.hold([NodeRecord(info=node.current_info(), expiration_time=get_dht_time() - 30)])
        chain = model.choose_chain(max_length=32)
        assert [(hop.peer_id, hop.start_block, hop.end_block) for hop in chain.hops] == [(node.peer_id, 0, 4)]
        output = model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False
    )
    assert torch.equal(output, reference)


def test_nodes_gone_or_frozen_without_a_goodbye_are_routed_around_at_open(local_swarm, tiny_llama):
    """One node process killed outright and one stopped (SIGSTOP), both with their p2pd: they announced nothing, so
    their records stay until they expire, and opening a libp2p stream to the killed one then waits out p2pd's dial
    timeout (20 s measured). The client pings a chain's nodes before opening on them (a dead node's lane port
    refuses at once, a frozen one stays silent for the probe timeout): both are banned and the session opens on the
    live node within seconds."""
    live = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="gone")
    with ProcessGroup() as group:
        args = ["run", "--model", tiny_llama, "--blocks", "0:4", "--initial-peers", *local_swarm.initial_peers]
        args += ["--dht-prefix", "gone", "--no-measure", "--rebalance", "off"]
        processes = [group.start(name, args) for name in ("gone", "frozen")]
        for process, address_file in processes:
            group.wait_address(process, address_file)
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="gone", compression="none"
        ) as model:
            seen = lambda: {record.info.peer_id for record in model.call(model.swarm.node_records())}  # noqa: E731
            wait_until(lambda: len(seen()) == 3, timeout_s=30)
            for peer_id in seen():  # the client's p2pd holds a connection to each, as after sessions
                model.call(model.swarm.info(peer_id))
            gone, frozen = (group_peer_id(group, process) for process, _ in processes)
            os.killpg(processes[0][0].pid, signal.SIGKILL)  # the node and its p2pd, no goodbye
            processes[0][0].wait(timeout=10)
            os.killpg(processes[1][0].pid, signal.SIGSTOP)
            try:
                correct = model.router.chain_selector

                def dead_first(snapshot, request):  # as if routing ranked the dead nodes first
                    for peer_id in (gone, frozen):
                        if peer_id not in request.exclude:
                            return Chain((Hop(peer_id, 0, 4),))
                    return correct(snapshot, request)

                model.router.chain_selector = dead_first
                started = time.monotonic()
                output = model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False)
                elapsed = time.monotonic() - started
            finally:
                os.killpg(processes[1][0].pid, signal.SIGCONT)
            assert {gone, frozen} <= model.swarm.banned() and model.last_chain.peer_ids == (live.peer_id,)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False
    )
    assert torch.equal(output, reference)
    assert elapsed < 8.0, elapsed  # a dial to the dead node would take 20 s; the frozen one costs the probe's 1 s


@contextlib.contextmanager
def one_node_process(local_swarm, path: str, prefix: str, config: ClientConfig | None = None):
    """A node process serving every block under `prefix`, and a client that sees its record: (process, its peer id,
    the client)."""
    with ProcessGroup() as group:
        args = ["run", "--model", path, "--blocks", "0:4", "--initial-peers", *local_swarm.initial_peers]
        process, address_file = group.start(prefix, [*args, "--dht-prefix", prefix, "--rebalance", "off"])
        group.wait_address(process, address_file)
        peer_id = group_peer_id(group, process)
        with DistributedModelForCausalLM.from_pretrained(
            path, initial_peers=local_swarm.initial_peers, dht_prefix=prefix, compression="none", config=config
        ) as model:
            seen = lambda: {record.info.peer_id for record in model.call(model.swarm.node_records())}  # noqa: E731
            wait_until(lambda: seen() == {peer_id}, timeout_s=30)
            yield process, peer_id, model


def test_the_last_node_of_a_span_that_misses_the_short_ping_is_asked_longer_not_banned(local_swarm, tiny_llama):
    """The only node for the blocks is stalled (SIGSTOP, as a host busy starting processes stalls a node) for 2.5 s
    when a session opens: it misses the 1 s ping, and with no other chain left the client pings it again with a
    longer timeout before banning it. It answers once it runs again: the session opens on it and the tokens equal
    single-process generation (banned, the session would end in NoRouteError)."""
    config = ClientConfig(max_pinged_candidates=0)  # the open's ping is the probe's alone
    with one_node_process(local_swarm, tiny_llama, "stalled", config) as (process, stalled, model):
        os.killpg(process.pid, signal.SIGSTOP)
        resume = threading.Timer(2.5, os.killpg, (process.pid, signal.SIGCONT))
        resume.start()
        try:
            started = time.monotonic()
            output = model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            elapsed = time.monotonic() - started
        finally:
            resume.cancel()
            os.killpg(process.pid, signal.SIGCONT)
        assert model.last_chain.peer_ids == (stalled,) and stalled not in model.swarm.banned()
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False
    )
    assert torch.equal(output, reference)
    assert elapsed > 2.0, elapsed  # it did wait for the stalled node


def test_the_last_node_of_a_span_that_goes_quiet_mid_generation_is_kept_not_banned(local_swarm, tiny_llama):
    """The only node for the blocks stalls for 3.5 s mid-generation (SIGSTOP, as a flood of DHT stores or a busy host
    stalls a node): the decode step's deadline passes and the node misses the short probe, no other node serves its
    blocks, so the client asks it again with a longer probe. It answers once it runs again: it is kept (not banned,
    no replay), the step is sent again under the same step id, and the tokens equal single-process generation
    (banned, the generation would end in NoRouteError)."""
    with one_node_process(local_swarm, tiny_llama, "quiet") as (process, quiet, model):
        # the step's 1 s deadline and the 1 s probe pass while it is stopped; the 4 s probe outlasts the stall
        resume = threading.Timer(3.5, os.killpg, (process.pid, signal.SIGCONT))

        def stall() -> None:
            os.killpg(process.pid, signal.SIGSTOP)
            resume.start()

        try:
            with model.inference_session(max_length=32) as session:
                # after 9 tokens the deadline counts decode steps alone (the last 8)
                output = model.generate(
                    PROMPT, max_new_tokens=12, min_new_tokens=12, do_sample=False, streamer=AfterTokens(9, stall)
                )
        finally:
            resume.cancel()
            os.killpg(process.pid, signal.SIGCONT)
        assert [(entry["failed"], entry["kept"]) for entry in session.failovers] == [(quiet, True)]
        assert session.failovers[0]["replacements"] == [] and quiet not in model.swarm.banned()
        assert model.last_chain.peer_ids == (quiet,)
        assert max(timing.wall_s for timing in session.timings) > 3.0  # the kept step waited for the stalled node
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=12, min_new_tokens=12, do_sample=False
    )
    assert torch.equal(output, reference)


def group_peer_id(group: ProcessGroup, process) -> str:
    for line in group.log_path(process).read_text(errors="replace").splitlines():
        if line.startswith("peer id "):
            return line.split()[-1]
    raise AssertionError(f"node {process.pid} printed no peer id")


def spoiled(output: torch.Tensor, fault: str) -> torch.Tensor:
    """A node's output as a lying node sends it: NaN, a token short, or in another dtype than it announces."""
    if fault == "nan":
        return torch.full_like(output, float("nan"))
    if fault == "shape":
        return output[:, :0]
    return output.to(torch.float16)  # the nodes announce float32


@pytest.mark.parametrize("fault", ["nan", "shape", "dtype"])
def test_a_node_sending_bad_hidden_states_is_banned_and_its_span_rerouted(local_swarm, tiny_llama, fault):
    """The last node of the chain answers NaN, a token short, or float16 where it announces float32: the client
    checks every answer's shape, dtype and values, treats the node as failed (banned, its span re-routed to a spare,
    whose cache is rebuilt), and the tokens equal single-process generation."""
    prefix = f"bad-output-{fault}"
    local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    liar = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    honest_run = liar.compute.run

    async def lying_run(hidden, cache, position, blocks, adapter=None):
        output, seconds = await honest_run(hidden, cache, position, blocks, adapter)
        if position >= PROMPT.shape[1] + 2:  # after a few honest steps, so the client has history to replay
            output = spoiled(output, fault)
        return output, seconds

    liar.compute.run = lying_run
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix=prefix, compression="none"
    ) as model:

        def two_hops() -> bool:
            try:
                return len(model.choose_chain(max_length=32).hops) == 2
            except NoRouteError:  # the records are not out yet
                return False

        wait_until(two_hops, timeout_s=30)
        with model.inference_session(max_length=32) as session:
            assert session.chain.hops[1].peer_id == liar.peer_id  # the only server of 2:4 when the session opened
            spare = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
            output = model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert [entry["failed"] for entry in session.failovers] == [liar.peer_id]
        assert session.failovers[0]["position"] >= PROMPT.shape[1] + 2  # failed by its lie, not by anything before
        assert liar.peer_id in session.failovers[0]["banned"]
        assert liar.peer_id in model.swarm.faulty() and model.swarm.second_chance([liar.peer_id]) == []
        assert session.chain.hops[1].peer_id == spare.peer_id
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False
    )
    assert torch.equal(output, reference)


@pytest.mark.parametrize("fault", ["nan", "short", "extra", "seals"])
def test_a_middle_node_pushing_bad_hidden_states_is_the_one_banned(local_swarm, tiny_llama, fault):
    """In a direct chain the first node pushes NaN, a token short, a token more (which an honest next node would
    compute, and its answer's shape would have it blamed) or another seal than the client's to the next: the next
    node refuses the step, the client fails the node that pushed it (not the one that refused), re-routes its span
    to a spare, and the tokens equal single-process generation. The refused step comes back under the pusher's own
    tag (protocol/push_tag.py), with the client's seals of its position and tokens: what it shows is the pusher's
    fault, a ban never lifted early."""
    prefix = f"bad-push-{fault}"
    liar = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    honest = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    honest_run, honest_push = liar.compute.run, liar.inference.push.push

    async def lying_run(hidden, cache, position, blocks, adapter=None):
        output, seconds = await honest_run(hidden, cache, position, blocks, adapter)
        if position >= PROMPT.shape[1] + 2 and fault != "seals":
            spoiled = {"nan": torch.full_like(output, float("nan")), "short": output[:, :0]}
            output = spoiled.get(fault, torch.cat([output, output], dim=1))
        return output, seconds

    async def lying_push(session, step, tensors):
        if fault == "seals" and step.position >= PROMPT.shape[1] + 2:  # another seal, under its own valid tag
            seals = ("0" * 64,)
            tag = push_tag.tag_of(session.push_key, step.step_id, step.position, step.codec, tensors[0], seals)
            step = step.model_copy(update={"seals": seals, "tag": tag})
        await honest_push(session, step, tensors)

    liar.compute.run, liar.inference.push.push = lying_run, lying_push
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix=prefix, compression="none"
    ) as model:
        wait_until(lambda: _hops(model) == 2, timeout_s=30)
        with model.inference_session(max_length=32) as session:
            assert session.chain.peer_ids == (liar.peer_id, honest.peer_id)
            spare = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
            output = model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert [entry["failed"] for entry in session.failovers] == [liar.peer_id]
        assert session.failovers[0]["position"] >= PROMPT.shape[1] + 2  # failed by its lie, not by anything before
        assert liar.peer_id in model.swarm.banned() and liar.peer_id in model.swarm.faulty()  # under its own tag
        assert honest.peer_id not in model.swarm.banned()
        assert session.chain.peer_ids == (spare.peer_id, honest.peer_id)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False
    )
    assert torch.equal(output, reference)


def _hops(model) -> int:
    try:
        return len(model.choose_chain(max_length=32).hops)
    except NoRouteError:  # the records are not out yet
        return 0


@pytest.mark.parametrize(
    "metadata",
    [
        {"kind": "step_result", "step_id": ["not", "text"], "position": "0", "compute_s": {}},  # wrong types
        {"kind": "step_result", "step_id": "x", "position": 0, "compute_s": 0.0, "codec": "none", "extra": 1},
        "a bare string",
    ],
    ids=["wrong-types", "unknown-field", "not-a-map"],
)
def test_a_node_answering_hostile_metadata_is_banned_and_its_span_rerouted(local_swarm, tiny_llama, metadata):
    """The last node answers a step with metadata of the wrong types, an unknown field, or no map at all: the
    client fails it like a node sending NaN (banned, span re-routed to a spare) and the tokens are unchanged."""
    prefix = "bad-metadata"
    local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    liar = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    honest_send = liar.inference._send_output
    answered = []

    async def lying_send(session, output):
        answered.append(output)
        if len(answered) > 3:  # after a few honest answers, so the client has history to replay
            output.metadata = msgpack.packb(metadata)
        await honest_send(session, output)

    liar.inference._send_output = lying_send
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix=prefix, compression="none"
    ) as model:
        wait_until(lambda: _hops(model) == 2, timeout_s=30)
        with model.inference_session(max_length=32) as session:
            assert session.chain.hops[1].peer_id == liar.peer_id
            spare = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
            output = model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert [entry["failed"] for entry in session.failovers] == [liar.peer_id]
        assert session.chain.hops[1].peer_id == spare.peer_id
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False
    )
    assert torch.equal(output, reference)


def test_a_node_whose_blocks_fail_a_step_ends_the_session_saying_so_and_is_replaced(local_swarm, tiny_llama):
    """A torch error in a node's blocks (out of device memory, say) is no refusal of the client's input: the node
    ends the session with a typed `step_failed` reply naming the error, the client replaces it like a lost node (not
    banned for a fault), and the tokens equal single-process generation."""
    prefix = "step-failed"
    local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    failing = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    honest_run = failing.compute.run

    async def failing_run(hidden, cache, position, blocks, adapter=None):
        if position >= PROMPT.shape[1] + 2:  # after a few steps, so the replacement has a history to rebuild
            raise RuntimeError("CUDA out of memory (as a test's blocks say it)")
        return await honest_run(hidden, cache, position, blocks, adapter)

    failing.compute.run = failing_run
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix=prefix, compression="none"
    ) as model:
        wait_for_chain(model, hops=2, max_length=32, timeout_s=30)
        with model.inference_session(max_length=32) as session:
            assert session.chain.hops[1].peer_id == failing.peer_id  # the only server of 2:4 when the session opened
            spare = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
            output = model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert [entry["failed"] for entry in session.failovers] == [failing.peer_id]
        reason = session.failovers[0]["reason"]
        assert "the node failed the step: RuntimeError: CUDA out of memory" in reason, reason
        assert failing.peer_id not in model.swarm.faulty()  # a failure, not a fault
        assert session.chain.hops[1].peer_id == spare.peer_id
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False
    )
    assert torch.equal(output, reference)
