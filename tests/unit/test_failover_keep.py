"""Failover's choice to keep a chain that went quiet (client/failover.py): with every node still answering the
probe, the step is to be sent again (once a step) instead of replacing a node; a stream that broke is never kept."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from nesa_node.client.chain_links import LinkFailed
from nesa_node.client.failover import Failover
from nesa_node.errors import NoRouteError, PeerUnavailableError, StepFailedError
from nesa_node.protocol.channel import frame
from nesa_node.protocol.messages import ErrorReply
from nesa_node.routing.chain import Hop


class FakeSwarm:
    """The parts of Swarm that Failover uses: the short info probe, which peers in `slow` or `silent` miss; the
    longer ping, which only peers in `silent` miss; and bans."""

    def __init__(self, *, slow: set[str] = frozenset(), silent: set[str] = frozenset()):
        self.slow, self.silent, self.bans, self.request_timeout_s = set(slow), set(silent), set(), 30.0
        self.pinged: list[tuple[str, float]] = []
        self.faults: set[str] = set()

    async def info(self, peer_id: str, timeout_s: float):
        if peer_id in self.slow | self.silent:
            raise TimeoutError(peer_id)
        return SimpleNamespace(peer_id=peer_id)

    async def unreachable(self, peer_ids, *, timeout_s: float, fresh_s: float):
        self.pinged += [(peer_id, timeout_s) for peer_id in peer_ids]
        return [peer_id for peer_id in peer_ids if peer_id in self.silent]

    def ban(self, peer_id: str, *, fault: bool = False) -> float:
        self.bans.add(peer_id)
        self.faults |= {peer_id} if fault else set()
        return 15.0

    def unban(self, peer_id: str) -> bool:
        if peer_id in self.faults:
            return False
        self.bans.discard(peer_id)
        return True

    def banned(self) -> frozenset[str]:
        return frozenset(self.bans)


def chain_of(*peers: str) -> SimpleNamespace:
    links = [
        SimpleNamespace(
            peer_id=peer,
            hop=Hop(peer_id=peer, start_block=2 * index, end_block=2 * index + 2),
            closed=False,
            said=None,  # its last refusal not read yet (SessionChain.said)
        )
        for index, peer in enumerate(peers)
    ]
    return SimpleNamespace(
        links=links, batch=1, max_length=32, adapter=None, adapter_block_bytes=0.0, floor_tokens=lambda: 0
    )


async def no_route(request):
    raise NoRouteError(f"no node serves blocks {request.start_block}-{request.end_block - 1}")


def recover(failover: Failover, failure: LinkFailed, may_keep: bool = True) -> bool:
    return asyncio.run(failover.recover(failure, position=5, inputs=[], may_keep=may_keep))


def test_a_quiet_chain_whose_nodes_all_answer_is_kept_once():
    swarm = FakeSwarm()
    failover = Failover(chain_of("a", "b"), swarm, no_route, max_replacement_attempts=2, probe_timeout_s=1.0)
    quiet = LinkFailed("no answer from the chain within 1.0 s", None)
    assert recover(failover, quiet) is False
    assert [(entry["failed"], entry["kept"], entry["replacements"]) for entry in failover.recoveries] == [
        (None, True, [])
    ]
    assert not swarm.bans
    with pytest.raises(PeerUnavailableError, match="every node of the chain still answers"):
        recover(failover, quiet, may_keep=False)  # the second time in a step: an error, as before


def test_a_quiet_chain_with_a_link_the_client_closed_replaces_that_node_not_kept():
    """A node whose link the client closed while replacing its neighbour (lost too) and did not replace yet may still
    answer the probe, yet its session there is over: a step that then goes quiet replaces it, without a probe."""
    swarm = FakeSwarm()
    chain = chain_of("a", "b")
    chain.links[1].closed = True
    replacement = Hop(peer_id="c", start_block=2, end_block=4)

    async def route(request):
        return SimpleNamespace(hops=(replacement,))

    failover = Failover(chain, swarm, route, max_replacement_attempts=2, probe_timeout_s=1.0)
    probed, replaced = [], []
    answer = swarm.info

    async def info(peer_id, timeout_s):
        probed.append(peer_id)
        return await answer(peer_id, timeout_s)

    async def replace(index, hops, position, inputs):
        replaced.append((index, hops))

    swarm.info, failover._replace = info, replace
    assert recover(failover, LinkFailed("no answer from the chain within 1.0 s", None)) is True
    assert probed == [] and replaced == [(1, (replacement,))] and "b" in swarm.bans


def test_the_last_node_of_its_span_is_kept_only_if_it_answers_the_longer_probe():
    swarm = FakeSwarm(silent={"b"})
    failover = Failover(chain_of("a", "b"), swarm, no_route, max_replacement_attempts=2, probe_timeout_s=1.0)
    quiet = LinkFailed("no answer from the chain within 1.0 s", None)
    with pytest.raises(NoRouteError, match="blocks 2-3"):
        recover(failover, quiet)  # silent to the longer probe too: banned, and no route
    assert swarm.pinged == [("b", 4.0)] and swarm.bans == {"b"}
    swarm.silent, swarm.slow = set(), {"b"}
    assert recover(failover, quiet) is False  # it misses the short probe but answers the longer one: kept
    assert failover.recoveries[-1]["failed"] == "b" and failover.recoveries[-1]["kept"] and not swarm.bans


def test_a_broken_stream_or_a_second_silence_in_a_step_is_never_kept():
    swarm = FakeSwarm(silent={"b"})
    chain = chain_of("a", "b")
    failover = Failover(chain, swarm, no_route, max_replacement_attempts=2, probe_timeout_s=1.0)
    with pytest.raises(NoRouteError):
        recover(failover, LinkFailed("stream to b failed: reset", chain.links[1]))
    # a broken stream is a failure: the node is never kept; the longer ping asks whether it can be opened again
    # there (tests/swarm/test_bans.py), and silent, it is banned
    assert swarm.bans == {"b"} and swarm.pinged == [("b", 4.0)] and failover.recoveries == []
    assert swarm.faults == set()
    swarm.pinged = []
    for full in ("no cache left for the session", "a peer may have 32 streams opening at once"):
        with pytest.raises(NoRouteError):  # no room there: not opened again, not even pinged
            recover(failover, LinkFailed(f"b: {full}", chain.links[1], full=True))
    assert swarm.pinged == []
    with pytest.raises(NoRouteError):
        recover(failover, LinkFailed("node a sent hidden states with NaN", chain.links[0], fault=True))
    assert swarm.bans == {"a", "b"} and swarm.faults == {"a"} and swarm.pinged == []  # banned for its fault
    swarm.bans.clear()
    swarm.slow, swarm.pinged = {"a", "b"}, []
    with pytest.raises(NoRouteError):
        recover(failover, LinkFailed("no answer from the chain within 30 s", None), may_keep=False)
    assert swarm.bans == {"a"} and swarm.pinged == []


def test_a_quiet_node_banned_for_a_fault_meanwhile_is_not_kept():
    swarm = FakeSwarm(slow={"b"})
    swarm.faults.add("b")  # another session found it sending something wrong
    failover = Failover(chain_of("a", "b"), swarm, no_route, max_replacement_attempts=2, probe_timeout_s=1.0)
    with pytest.raises(NoRouteError):
        recover(failover, LinkFailed("no answer from the chain within 1.0 s", None))
    assert swarm.pinged == [("b", 4.0)] and swarm.bans == {"b"} and failover.recoveries == []


def test_a_replacement_is_asked_for_the_step_under_way_and_one_announcing_no_limit_held_to_the_floor():
    """The route asked for a replacement carries the rows x tokens of the step to be sent again whole and the
    session's floor, what a node announcing no step limit is held to (so it is not given a larger part)."""
    swarm, asked = FakeSwarm(silent={"b"}), []  # gone: not opened again when no route is found
    chain = chain_of("a", "b")
    chain.floor_tokens = lambda: 4

    async def route(request):
        asked.append((request.step_tokens, request.unannounced_tokens, request.start_block, request.end_block))
        return await no_route(request)

    failover = Failover(chain, swarm, route, max_replacement_attempts=2, probe_timeout_s=1.0)
    with pytest.raises(NoRouteError):
        asyncio.run(
            failover.recover(LinkFailed("b: stream reset", chain.links[1]), position=5, inputs=[], step_tokens=8)
        )
    assert asked == [(8, 4, 2, 4)]


class AccusingSwarm(FakeSwarm):
    """FakeSwarm with the client's accusation record (client/bans.py Bans.accuse)."""

    def __init__(self, **options):
        from nesa_node.client.bans import Bans

        super().__init__(**options)
        self.record = Bans()

    def accuse(self, accuser: str, accused: str) -> int:
        return self.record.accuse(accuser, accused)


def test_a_node_saying_every_next_node_took_none_of_its_pushes_is_itself_replaced():
    """Node A reports (peer_unavailable) that its next node did not take its pushes. A next node that does not answer
    a ping is the one lost; one that answers is replaced for a failure, and when A says so of a second next node
    that answers, A is the one replaced: its word cannot have every node after it banned in turn."""
    swarm = AccusingSwarm(silent={"gone"})
    chain = chain_of("A", "B", "C", "gone")
    replaced: list[str] = []

    async def route(request):
        return SimpleNamespace(
            hops=(Hop(peer_id="spare", start_block=request.start_block, end_block=request.end_block),)
        )

    async def replace(index, hops, position, inputs):
        replaced.append(chain.links[index].peer_id)

    failover = Failover(chain, swarm, route, max_replacement_attempts=1, probe_timeout_s=1.0)
    failover._replace = replace
    a, b, c, gone = chain.links
    for reporter, named in ((c, gone), (a, b), (a, c)):
        assert recover(failover, LinkFailed("next node refused: its queue is full", named, reporter=reporter))
    assert replaced == ["gone", "B", "A"]  # silent: lost indeed; B answers: replaced once; C answers too: A is
    assert swarm.bans == {"gone", "B", "A"} and not swarm.faults and "C" not in swarm.bans


def test_a_next_node_that_said_it_ended_the_session_fails_by_its_own_word_not_the_reporters():
    """The previous node reports its push channel to B ended, and B's own reply, come meanwhile, says it ended the
    session (its blocks failed the step): B is replaced by that word, which the failover's record names, and A's
    report is no accusation of B (reports against two such nodes do not turn on A)."""
    swarm = AccusingSwarm()
    chain = chain_of("A", "B", "C")
    a, b, c = chain.links
    failover = Failover(chain, swarm, no_route, max_replacement_attempts=1, probe_timeout_s=1.0)
    said = ErrorReply.of(StepFailedError("the node failed the step: RuntimeError: out of memory"), "s:7")
    for named in (b, c):
        named.said = frame(said)
        weighed = asyncio.run(failover.weigh_report(LinkFailed("push channel ended", named, reporter=a)))
        assert (weighed.link, weighed.message) == (named, said.message)
    assert swarm.record.accuse("A", "D") == 1  # A's reports above were no accusations
