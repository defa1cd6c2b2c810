"""Failover mid-generation (RELIABILITY.md A1-A4, A6): node processes killed or stopped by pid while a client
generates."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.session_chain import SessionChain
from nesa_node.devtools.chaos import AfterTokens
from nesa_node.devtools.launcher import ProcessGroup
from nesa_node.errors import NoRouteError, PeerUnavailableError
from nesa_node.protocol.channel import frame
from nesa_node.protocol.messages import ErrorReply
from nesa_node.protocol.records import NodeState
from tests.support.swarm import wait_for_chain, wait_until

pytestmark = pytest.mark.serial  # measures time: run alone, after the parallel pass (Makefile)

SPANS = [(0, 1), (1, 3), (3, 4)]
# nodes per span: enough for every test below to kill (or stop) one and still find a replacement
COPIES = {(0, 1): 3, (1, 3): 7, (3, 4): 3}
PROMPT = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(5))
NEW_TOKENS, KILL_AFTER = 128, 64
# RELIABILITY.md A1's target is 2 s from the failed step to the next good one; bench/failover.py reports the figure.
# Here 13 node processes share the machine, so the test holds a sanity bound three times the target.
RECOVERY_LIMIT_S = 6.0
STEP_TIMEOUT_S = 5.0  # the nodes' --step-timeout: a stopped node must free a stale session's cache within it


class FailoverSwarm:
    def __init__(self, group: ProcessGroup, peers: list[str], nodes: dict[str, object], spans: dict[str, tuple]):
        self.group, self.initial_peers = group, peers
        self.nodes, self.spans = nodes, spans  # peer id -> process, peer id -> (start, end)

    def kill(self, peer_id: str) -> None:
        """SIGKILL the node's whole process group (its p2pd too): a crash, not a goodbye."""
        process = self.nodes.pop(peer_id)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _peer_id(group: ProcessGroup, process) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in group.log_path(process).read_text(errors="replace").splitlines():
            if line.startswith("peer id "):
                return line.split()[-1]
        time.sleep(0.1)
    raise RuntimeError(f"node {process.pid} printed no peer id")


@pytest.fixture(scope="module")
def failover_swarm(tiny_llama):
    with ProcessGroup() as group:
        bootstrap, address_file = group.start("dht", ["dht"])
        peers = group.wait_address(bootstrap, address_file)
        launched = []
        for start, end in SPANS:
            for copy in range(COPIES[start, end]):
                args = ["run", "--model", tiny_llama, "--blocks", f"{start}:{end}", "--initial-peers", *peers]
                args += ["--no-measure", "--announce-period", "1", "--dht-prefix", "failover"]
                args += ["--step-timeout", str(STEP_TIMEOUT_S)]
                launched.append((group.start(f"node{start}-{end}-{copy}", args), (start, end)))
        nodes, spans = {}, {}
        for (process, node_address), span in launched:
            group.wait_address(process, node_address, timeout_s=120)
            peer_id = _peer_id(group, process)
            nodes[peer_id], spans[peer_id] = process, span
        yield FailoverSwarm(group, peers, nodes, spans)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.inference_mode():
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


def generate_with_fault(model, after: int, action) -> torch.Tensor:
    """The reference generation, with `action` (a kill, a stop...) run once `after` new tokens were produced."""
    return model.generate(
        PROMPT,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        streamer=AfterTokens(after, action),
    )


def connect(swarm: FailoverSwarm, path: str, mode: str = "direct") -> DistributedModelForCausalLM:
    return DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=swarm.initial_peers, dht_prefix="failover", compression="none", mode=mode
    )


def kill_the_middle_node(swarm: FailoverSwarm, path: str, mode: str = "direct"):
    """The reference generation with the chain's middle node killed after KILL_AFTER new tokens: (output tokens, the
    closed session, the lost hop)."""
    with connect(swarm, path, mode) as model:
        wait_for_chain(model, hops=len(SPANS), max_length=16 + NEW_TOKENS)
        with model.inference_session(max_length=16 + NEW_TOKENS) as session:
            lost = session.chain.hops[1]
            output = generate_with_fault(model, KILL_AFTER, lambda: swarm.kill(lost.peer_id))
    return output, session, lost


@pytest.mark.parametrize(
    "victim, kill_after",
    [(1, KILL_AFTER), (0, KILL_AFTER), (2, KILL_AFTER), (0, 0)],
    ids=["a1-middle", "a2-first", "a2-last", "a2-first-before-prefill"],
)
def test_a1_a2_node_killed_mid_generation_tokens_unchanged(failover_swarm, tiny_llama, reference, victim, kill_after):
    """Each case kills a node whose span still has a spare (see COPIES), so the cases can share one swarm."""
    with connect(failover_swarm, tiny_llama) as model:
        wait_for_chain(model, hops=len(SPANS), max_length=16 + NEW_TOKENS)
        with model.inference_session(max_length=16 + NEW_TOKENS) as session:
            lost = session.chain.hops[victim]
            output = generate_with_fault(model, kill_after, lambda: failover_swarm.kill(lost.peer_id))
        assert torch.equal(output, reference)
        assert len(session.failovers) == 1, session.failovers
        failover = session.failovers[0]
        assert failover["failed"] == lost.peer_id and failover["blocks"] == [lost.start_block, lost.end_block]
        assert failover["position"] == (0 if kill_after == 0 else 16 + kill_after - 1)  # tokens replayed
        recovery_s = max(timing.wall_s for timing in session.timings)  # the failed step, retried included
        print(f"\nrecovery: failed step to next good step {recovery_s:.3f} s (rebuild {failover['seconds']:.3f} s)")
        assert recovery_s < RECOVERY_LIMIT_S
        assert lost.peer_id in failover["banned"]
        assert not set(failover["replacements"]) & set(failover["banned"])  # the healthy replacement is not banned
        assert session.chain.hops[victim].peer_id in failover["replacements"]


def test_a2_replacement_killed_during_replay(failover_swarm, tiny_llama, reference, monkeypatch):
    """The middle node dies; its first replacement dies as the client starts rebuilding its cache: the client bans
    it too, picks another node for the same span, replays again, and the tokens are unchanged."""
    replayed: list[str] = []
    replay = SessionChain.replay

    async def replay_into_a_dying_node(self, links, history):
        if not replayed:
            failover_swarm.kill(links[0].hop.peer_id)
        replayed.append(links[0].hop.peer_id)
        return await replay(self, links, history)

    monkeypatch.setattr(SessionChain, "replay", replay_into_a_dying_node)
    output, session, lost = kill_the_middle_node(failover_swarm, tiny_llama)
    assert torch.equal(output, reference)
    first, second = replayed
    assert first != second and lost.peer_id not in replayed
    assert [(entry["failed"], entry["replacements"]) for entry in session.failovers] == [(lost.peer_id, [second])]
    banned = set(session.failovers[0]["banned"])
    assert {lost.peer_id, first} <= banned and second not in banned
    assert session.chain.hops[1].peer_id == second
    print(f"\nrecovery with a second replacement: {max(timing.wall_s for timing in session.timings):.3f} s")


def test_a1_stale_reports_of_the_lost_node_do_not_end_the_recovery(failover_swarm, tiny_llama, reference, monkeypatch):
    """The middle node dies; while the client opens and replays its replacement, the first node's reports that its
    next node is gone keep arriving (a push retried, a lane reset): they are the failure being recovered from, not a
    failure of the replacement, and the generation goes on with unchanged tokens."""
    reported: list[str] = []
    open_segment, replay = SessionChain.open_segment, SessionChain.replay

    def report(chain: SessionChain, stage: str) -> None:
        first = chain.links[0]  # the lost node's previous node, still in the chain
        stale = PeerUnavailableError(f"next node {chain.links[1].peer_id} did not take the step ({stage})")
        chain.answers.put_nowait((first, frame(ErrorReply.of(stale))))
        reported.append(stage)

    async def open_with_a_stale_report(self, hops, upstream, downstream):
        if self.links:  # a replacement, not the session's first open
            report(self, "open")
        return await open_segment(self, hops, upstream, downstream)

    async def replay_with_a_stale_report(self, links, history):
        report(self, "replay")
        return await replay(self, links, history)

    monkeypatch.setattr(SessionChain, "open_segment", open_with_a_stale_report)
    monkeypatch.setattr(SessionChain, "replay", replay_with_a_stale_report)
    output, session, lost = kill_the_middle_node(failover_swarm, tiny_llama)
    assert torch.equal(output, reference)
    # one open and one replay (a replacement that is dead itself, its record not yet expired, adds an open)
    assert reported[0] == "open" and reported[-1] == "replay" and set(reported) == {"open", "replay"}, reported
    assert [entry["failed"] for entry in session.failovers] == [lost.peer_id]


def test_a1_relay_mode_middle_node_killed_tokens_unchanged(failover_swarm, tiny_llama, reference):
    """Client-relayed mode: the client holds every span's inputs, replays the lost one's into the replacement."""
    output, session, lost = kill_the_middle_node(failover_swarm, tiny_llama, mode="relay")
    assert torch.equal(output, reference)
    assert [(entry["failed"], entry["position"]) for entry in session.failovers] == [
        (lost.peer_id, 16 + KILL_AFTER - 1)
    ]
    assert lost.peer_id in session.failovers[0]["banned"]
    assert not set(session.failovers[0]["replacements"]) & set(session.failovers[0]["banned"])
    print(f"\nrelay-mode recovery: {max(timing.wall_s for timing in session.timings):.3f} s")


def test_a3_stopped_node_client_reroutes_and_the_stale_node_frees_its_cache(failover_swarm, tiny_llama, reference):
    """SIGSTOP the last node (its p2pd too) mid-generation: the client's step deadline passes, it re-routes, and the
    tokens are unchanged; after SIGCONT the stale node frees that session's cache within its step timeout."""
    with connect(failover_swarm, tiny_llama) as model:
        wait_for_chain(model, hops=len(SPANS), max_length=16 + NEW_TOKENS)
        baseline = {
            peer: model.call(model.swarm.info(peer)).cache_tokens_left
            for peer, span in failover_swarm.spans.items()
            if span == (3, 4) and peer in failover_swarm.nodes
        }
        with model.inference_session(max_length=16 + NEW_TOKENS) as session:
            stopped = session.chain.hops[2].peer_id
            process = failover_swarm.nodes[stopped]
            try:
                output = generate_with_fault(model, KILL_AFTER, lambda: os.killpg(process.pid, signal.SIGSTOP))
            finally:
                os.killpg(process.pid, signal.SIGCONT)
            resumed = time.monotonic()
            assert torch.equal(output, reference)
            assert [entry["failed"] for entry in session.failovers] == [stopped]
            assert session.failovers[0]["seconds"] < 15, session.failovers[0]["phases"]
            assert stopped in session.failovers[0]["banned"], session.failovers
            # still inside the client's session: only the stale node's own timeouts or stream ends can free it
            wait_until(
                lambda: model.call(model.swarm.info(stopped)).cache_tokens_left == baseline[stopped], STEP_TIMEOUT_S
            )
            freed_s = time.monotonic() - resumed
        print(f"\nstale node freed the session's cache {freed_s:.2f} s after SIGCONT")
        recovery_s = max(timing.wall_s for timing in session.timings)
        print(f"recovery from a stopped node: {recovery_s:.3f} s, phases {session.failovers[0]['phases']}")


def test_a1_gateway_stream_survives_a_killed_node_and_counts_the_failover(failover_swarm, tiny_llama):
    """A request streamed through a `nesa-node gateway` process; the middle node of its chain (read from the
    dashboard's live chains) is killed mid-stream: the streamed text equals one process's, and the gateway's
    /metrics count one failover with its recovery time."""
    group = failover_swarm.group
    args = ["gateway", "--model", tiny_llama, "--initial-peers", *failover_swarm.initial_peers, "--port", "0"]
    gateway, address_file = group.start("gateway", [*args, "--dht-prefix", "failover", "--compression", "none"])
    (url,) = group.wait_address(gateway, address_file, timeout_s=120)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt, new_tokens = "import os and sys", 200
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        output = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
            ids, max_new_tokens=new_tokens, do_sample=False
        )
    expected = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    wait_until(lambda: len(swarm_document(url)["coverage"]) == 4 and not swarm_document(url)["gaps"], timeout_s=60)
    pieces, killed = [], []
    stream = client.completions.create(
        model=Path(tiny_llama).resolve().name, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if not killed:
            (chain,) = swarm_document(url)["chains"]
            killed.append(chain[1])
            failover_swarm.kill(chain[1])
    assert "".join(pieces) == expected
    assert len(pieces) > 20  # the kill came early in the stream
    metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    assert "nesa_gateway_failovers_total 1.0" in metrics, metrics
    assert "nesa_gateway_failover_recovery_seconds_count 1.0" in metrics, metrics
    (recovery_s,) = [float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("nesa_gateway_failover_recovery_seconds_sum")]  # fmt: skip
    print(f"\ngateway stream: failover recovered in {recovery_s:.3f} s")
    assert 0 < recovery_s < 15


def swarm_document(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/api/swarm", timeout=10).read())


def test_a4_no_replacement_names_the_missing_blocks(failover_swarm, tiny_llama):
    with connect(failover_swarm, tiny_llama) as model:
        wait_for_chain(model, hops=len(SPANS), max_length=64)
        for peer_id in [peer for peer in failover_swarm.nodes if failover_swarm.spans[peer] == (3, 4)]:
            failover_swarm.kill(peer_id)  # the last span and its spare: their records linger until they expire
        started = time.monotonic()
        with pytest.raises(NoRouteError, match="blocks 3"):
            model.generate(PROMPT, max_new_tokens=8, do_sample=False)
        elapsed = time.monotonic() - started
        print(f"\nno-route error after {elapsed:.2f} s")
        assert elapsed < 10.0


def record_announcements(node) -> list:
    """The DHT records `node` writes from now on, in order: (the state announced, whether a peer stored it). The
    state is the node's when the record is made (a periodic announcement may end after a state change)."""
    announced = []
    announce = node.announce

    async def recorded_announce():
        state = node.state
        stored = await announce()
        announced.append((state, stored))
        return stored

    node.announce = recorded_announce
    return announced


def test_a6_graceful_drain_clients_reroute(local_swarm, tiny_llama, reference):
    """SIGTERM path (Node.shutdown): the node announces draining, refuses new sessions, ends its sessions after
    their queued steps; the generating client re-routes to the spare and its tokens are unchanged."""
    for span in ((0, 2), (2, 4), (2, 4)):  # the last span has a spare
        local_swarm.start_node(tiny_llama, *span, dht_prefix="drain")
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="drain", compression="none"
    ) as model:
        wait_for_chain(model, hops=2, max_length=16 + NEW_TOKENS)
        with model.inference_session(max_length=16 + NEW_TOKENS) as session:
            draining = next(node for node in local_swarm.nodes if node.peer_id == session.chain.hops[1].peer_id)
            states, announced = [], record_announcements(draining)

            def drain() -> None:
                local_swarm.stop_node(draining)
                states.append(draining.state)

            output = generate_with_fault(model, KILL_AFTER, drain)
        assert torch.equal(output, reference)
        assert [failover["failed"] for failover in session.failovers] == [draining.peer_id]
        assert states == [NodeState.offline] and draining.sessions.draining
        # draining at once (a session is open), again when its sessions are ended, then offline
        stopping = [entry for entry in announced if entry[0] != NodeState.online]
        assert stopping == [(NodeState.draining, True), (NodeState.draining, True), (NodeState.offline, True)]
        assert not draining.sessions.sessions


def test_an_idle_node_that_stops_announces_offline_at_once(local_swarm, tiny_llama):
    """Node.shutdown with no session open: nothing to drain, so its first announcement is offline (clients and the
    planners stop counting it at once) and it never announces draining."""
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="leave")
    announced = record_announcements(node)
    local_swarm.stop_node(node)
    assert [entry for entry in announced if entry[0] != NodeState.online] == [(NodeState.offline, True)] * 2
    assert node.sessions.draining and node.training.draining
