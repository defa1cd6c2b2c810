"""A long-running client's memory of the swarm stays bounded by the swarm it sees now (client/swarm.py `hold`,
client/bans.py): identities that come and go are forgotten once they are long gone."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hivemind.utils import get_dht_time

from nesa_node.client.bans import FORGET_AFTER_S, PRUNE_AT, Bans
from nesa_node.client.swarm import FORGET_RECORD_S, RECENT_RECORD_S, Swarm
from nesa_node.protocol.dht import NodeRecord
from nesa_node.protocol.records import NodeInfo, NodeState


def record(peer: str, expires_in_s: float) -> NodeRecord:
    info = NodeInfo(peer_id=peer, state=NodeState.online, start_block=0, end_block=4, dtype="float32")
    return NodeRecord(info, expiration_time=get_dht_time() + expires_in_s)


def test_records_expired_long_ago_are_dropped_with_when_their_nodes_were_first_seen():
    swarm = Swarm(SimpleNamespace(p2p=None, dht=None), dht_prefix="test")
    swarm.hold([record(f"gone{index}", -FORGET_RECORD_S - 10) for index in range(1000)])
    swarm.hold([record("recent", -RECENT_RECORD_S / 2), record("live", 60.0)])
    assert set(swarm._records) == {"recent", "live"}  # recently expired: still a candidate to probe
    assert set(swarm._first_seen) == {"recent", "live"}
    assert [held.info.peer_id for held in swarm.records_at_hand()] == ["live"]


def test_bans_over_for_an_hour_are_forgotten_once_there_are_many():
    bans = Bans()
    long_ago = time.monotonic() - FORGET_AFTER_S - 1
    bans._bans = {f"gone{index}": (long_ago, 15.0) for index in range(PRUNE_AT)}
    bans.ban("recent")
    assert set(bans._bans) == {"recent"}
    bans.ban("fault", fault=True)
    assert "fault" in bans.banned() and "fault" in bans.faulty()


def test_a_ban_is_at_least_its_own_kinds_length_and_never_shortens_one_under_way():
    """A blame's hour-long ban after a failure's 15 s one is an hour, not the 30 s that doubling the last ban would
    give; a failure's ban while a longer ban runs leaves it running to its end; repeated failures still double."""
    bans = Bans()
    assert bans.ban("cheat") == 15.0  # a step it refused: a failure
    assert bans.ban("cheat", base_s=3600.0, max_s=3600.0, fault=True) == 3600.0  # then caught: blamed
    until = bans._bans["cheat"][0]
    assert until >= time.monotonic() + 3590.0
    bans.ban("cheat")  # failing again meanwhile (600 s at most for a failure) ends no sooner
    assert bans._bans["cheat"][0] >= until and "cheat" in bans.banned()
    assert [bans.ban("flaky") for _ in range(4)] == [15.0, 30.0, 60.0, 120.0]


def test_routing_asks_a_bounded_number_of_recent_nodes_the_freshest_first_a_few_at_once():
    import asyncio

    from nesa_node.client import swarm as swarm_module

    swarm = Swarm(SimpleNamespace(p2p=None, dht=None), dht_prefix="test")
    swarm.hold([record(f"made-up{index:04d}", -RECENT_RECORD_S / 2) for index in range(500)])
    swarm.hold([record("live", 60.0), record("fresh", 30.0)])
    candidates = swarm.recent_nodes(0, 4)
    assert candidates[:2] == ["live", "fresh"] and len(candidates) == 502
    asked, running, most = [], 0, 0

    async def info(peer_id: str, *, timeout_s: float) -> NodeInfo:
        nonlocal running, most
        asked.append(peer_id)
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.001)
        running -= 1
        return NodeInfo(peer_id=peer_id, state=NodeState.online, start_block=0, end_block=4, dtype="float32")

    swarm.info = info
    answered = asyncio.run(swarm.probe_nodes(candidates, timeout_s=1.0))
    assert answered == len(asked) == swarm_module.MAX_PROBED_NODES and asked[:2] == ["live", "fresh"]
    assert most == swarm_module.PROBES_AT_ONCE


def test_an_accusers_word_counts_distinct_nodes_within_the_hour_not_those_found_faulty_since():
    bans = Bans()
    assert bans.accuse("accuser", "a") == 1
    assert bans.accuse("accuser", "a") == 1  # the same node again: still one
    assert bans.accuse("accuser", "b") == 2
    bans.ban("b", fault=True)  # b turned out faulty: the accuser was right about it
    assert bans.accuse("accuser", "a") == 1
    long_ago = time.monotonic() - FORGET_AFTER_S - 1
    bans._accusations["accuser"] = {"old": long_ago, "a": time.monotonic()}
    assert bans.accuse("accuser", "c") == 2  # "old" is over an hour ago: a and c count
    assert bans.accuse("other", "a") == 1  # each accuser its own count
