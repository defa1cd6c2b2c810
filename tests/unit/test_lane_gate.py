"""The data lane gate (server/lane_gate.py): caps on connections before their hello, descriptor headroom."""

from __future__ import annotations

import logging

import pytest

from nesa_node.server.config import NetworkConfig
from nesa_node.server.lane_gate import FdHeadroom, LaneGate, required_free_fds, source_of

CAPS = NetworkConfig(max_pending_lanes=8, max_pending_lanes_per_host=3, max_lanes=4)


class Transport:
    """What the gate needs of a connection's transport: abort."""

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def roomy() -> FdHeadroom:
    return FdHeadroom(soft_limit=lambda: 100_000, count=lambda: 10)


def test_one_source_holds_at_most_its_share_of_pending_connections():
    gate = LaneGate(CAPS, roomy())
    held = [gate.admit(("10.0.0.1", port)) for port in range(5)]
    assert [admission is not None for admission in held] == [True, True, True, False, False]
    assert gate.admit(("10.0.0.2", 1)) is not None  # another source is not held back
    held[0].release()
    assert gate.admit(("10.0.0.1", 9)) is not None  # a finished hello makes room
    assert gate.refused == 2


def test_at_the_global_cap_the_oldest_pending_connection_makes_room():
    gate = LaneGate(CAPS, roomy())
    transports = [Transport() for _ in range(10)]
    admissions = [gate.admit((f"10.0.0.{index}", 1), transport) for index, transport in enumerate(transports)]
    assert all(admission is not None for admission in admissions)
    assert len(gate.pending) == CAPS.max_pending_lanes
    assert [transport.aborted for transport in transports] == [True, True] + [False] * 8
    admissions[0].release()  # the evicted connection's handler ends later: counted once only
    assert len(gate.pending) == CAPS.max_pending_lanes and sum(gate.pending_by_source.values()) == 8


def test_established_lanes_are_capped_and_leave_the_pending_count():
    gate = LaneGate(CAPS, roomy())
    admissions = [gate.admit((f"10.0.0.{index}", 1)) for index in range(4)]
    for admission in admissions:
        admission.authenticated()
    assert (len(gate.pending), gate.established) == (0, 4)
    assert gate.admit(("10.0.0.9", 1)) is None  # max_lanes open
    admissions[0].release()
    admissions[0].release()  # released twice (a handler's finally after an eviction): counted once
    assert gate.established == 3
    assert gate.admit(("10.0.0.9", 1)) is not None


def test_new_connections_are_refused_when_descriptors_run_short():
    open_fds = [700]
    now = [0.0]
    headroom = FdHeadroom(soft_limit=lambda: 1024, count=lambda: open_fds[0], clock=lambda: now[0])
    gate = LaneGate(NetworkConfig(), headroom)
    assert required_free_fds(1024) == 256
    admitted = [gate.admit((f"10.0.{index // 200}.{index % 200}", 1)) for index in range(100)]
    # 1024 - 256 = 768 descriptors may be in use: 68 more than counted, those admitted since the count included
    assert sum(admission is not None for admission in admitted) == 68
    open_fds[0], now[0] = 500, 1.0  # closed elsewhere meanwhile: noticed at the next count
    assert gate.admit(("10.1.0.1", 1)) is not None


def test_headroom_never_refuses_where_descriptors_cannot_be_counted():
    assert FdHeadroom(soft_limit=lambda: None, count=lambda: 10**9).admit()
    assert FdHeadroom(soft_limit=lambda: 1024, count=lambda: None).admit()
    assert not FdHeadroom(soft_limit=lambda: 1024, count=lambda: 1000).admit()


@pytest.mark.parametrize(
    "peername, source",
    [
        (("192.0.2.7", 4000), "192.0.2.7"),
        (("::ffff:192.0.2.7", 4000, 0, 0), "192.0.2.7"),
        (("2001:db8:1:2:aaaa::1", 4000, 0, 0), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:bbbb::9", 4000, 0, 0), "2001:db8:1:2::/64"),
        (None, "None"),
    ],
)
def test_sources_are_addresses_and_ipv6_hosts_count_by_their_64(peername, source):
    assert source_of(peername) == source


def test_refusals_are_logged_at_debug_at_most_once_per_period(caplog):
    now = [0.0]
    gate = LaneGate(CAPS, roomy(), clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="nesa_node.server.lane_gate"):
        for port in range(500):
            gate.admit(("10.0.0.1", port))
        now[0] = 10.0
        gate.admit(("10.0.0.1", 9999))
    lines = [record for record in caplog.records if record.name == "nesa_node.server.lane_gate"]
    assert [record.levelno for record in lines] == [logging.DEBUG, logging.DEBUG]
    assert lines[0].getMessage().startswith("closed 1 lane connection(s) unread since the last report")
    assert lines[1].getMessage().startswith("closed 497 lane connection(s)")  # 3 of the 501 were admitted
    assert all(record.exc_info is None for record in lines)
