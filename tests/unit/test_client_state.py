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
