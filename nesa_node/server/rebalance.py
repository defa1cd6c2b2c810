"""Live rebalancing: the node daemon moves to other blocks when the swarm needs it (eq. 3, R: S x P -> S').

Every `rebalance_period_s` (jittered by +-JITTER, from a generator seeded with the peer id, so nodes started together
do not read the DHT in step) the Rebalancer reads the swarm's NodeInfo records, builds the snapshot a client would
(swarm_view.build_snapshot, with this node's own record as it is now) and decides with the pure planners of
sharding/balancing.py:

1. A coverage hole (a block no online node serves) always counts: `cover_hole` names the one node to move.
2. Otherwise the configured trigger (topology/triggers.py: homology, load-cv or periodic) sees the snapshot; once
   it fires an episode starts, and every check asks `should_move` until a check finds no move for any node (as
   topology/life.py simulates). `off` starts no Rebalancer: the node keeps its blocks.

Agreement. Both planners are deterministic on a snapshot (nodes sorted by peer id), so nodes reading the same
records name the same mover and the others stay. A node the plan names waits a random CONFIRM share of the period
and moves only if a second read still names it, which absorbs records still propagating. While a node moves, its
record keeps the plan stable: draining with its old span (the hole planner may still pick a draining node, so it
stays the one picked), then joining with its new span, which the planners count as served (a node loading blocks
will serve them within seconds; counting it as absent would send a second node to the same blocks).

Moving is the node's own (`Node.move_to`, server/node.py): drain, release the old span, load the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import logging
import time
from dataclasses import dataclass

import numpy as np

from nesa_node.protocol.dht import fetch_node_infos
from nesa_node.protocol.records import NodeInfo, NodeState
from nesa_node.routing.snapshot import SwarmSnapshot
from nesa_node.sharding.balancing import Move, cover_hole, placement_from_snapshot, plan_moves, should_move
from nesa_node.swarm_view import build_snapshot
from nesa_node.topology.graph import swarm_graph
from nesa_node.topology.homology import diagrams
from nesa_node.topology.monitor import learn_threshold
from nesa_node.topology.triggers import HomologyTrigger, LoadVariationTrigger, PeriodicTrigger, TriggerInput

logger = logging.getLogger(__name__)
events = logging.getLogger("nesa_node.events")  # shown at the default log level

TRIGGERS = ("homology", "load-cv", "periodic", "off")
JITTER = 0.25  # share of the period each wait varies by (guess: spreads a swarm's reads over half a period)
CONFIRM = 0.25  # a planned mover re-reads within this share of the period before moving (guess, as JITTER)
CALIBRATION_SNAPSHOTS = 5  # snapshots behind the homology change threshold (10 pairs; topology/life.py uses 20)

__all__ = ["CalibratedHomologyTrigger", "Rebalancer", "TRIGGERS", "make_trigger", "planning_snapshot"]


@dataclass(frozen=True)
class CalibratedHomologyTrigger:
    """HomologyTrigger whose change threshold is learned from the first `calibration` snapshots this node takes
    (monitor.learn_threshold: repeated measurements of a swarm taken to be unchanged); it never fires before.
    State: (diagrams collected, None) while calibrating, then (HomologyTrigger, its state)."""

    calibration: int = CALIBRATION_SNAPSHOTS
    name: str = "homology"

    def start(self) -> tuple:
        return ((), None)

    def step(self, state: tuple, observation: TriggerInput) -> tuple[tuple, bool]:
        collected, monitor = state
        if monitor is not None:
            trigger, trigger_state = monitor
            trigger_state, fired = trigger.step(trigger_state, observation)
            return (collected, (trigger, trigger_state)), fired
        collected = (*collected, diagrams(swarm_graph(observation.snapshot)))
        if len(collected) < self.calibration:
            return (collected, None), False
        trigger = HomologyTrigger(learn_threshold(collected))
        trigger_state, _ = trigger.step(trigger.start(), observation)  # the reference: the snapshot of now
        return ((), (trigger, trigger_state)), False


def make_trigger(name: str, *, period_s: float):
    """The trigger policy named on the command line (`off` is not one: no Rebalancer runs). Raises ValueError."""
    if name == "homology":
        if importlib.util.find_spec("gudhi") is None:
            raise ValueError(
                "the homology rebalance trigger needs gudhi: pip install 'nesa-node[topology]', or run with "
                "--rebalance load-cv, periodic or off"
            )
        return CalibratedHomologyTrigger()
    if name == "load-cv":
        return LoadVariationTrigger()
    if name == "periodic":
        return PeriodicTrigger(period_s)
    raise ValueError(f"unknown rebalance trigger {name!r}; one of {', '.join(TRIGGERS)}")


def planning_snapshot(infos: list[NodeInfo], num_blocks: int, *, draining_serves: bool) -> SwarmSnapshot:
    """The snapshot the planners read: a joining node counts as online at its announced (new) span; with
    `draining_serves` a draining node counts as online at its old span too (throughput planning: the plan must not
    change while its mover drains; the hole planner instead sees draining nodes as serving nothing)."""
    counted = {NodeState.joining, NodeState.draining} if draining_serves else {NodeState.joining}
    views = [info.model_copy(update={"state": NodeState.online}) if info.state in counted else info for info in infos]
    return build_snapshot(views, num_blocks)


def _seed(peer_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=8).digest(), "big")


class Rebalancer:
    """Decides when the node moves; lives as a task of the node (run). `node` is the daemon (server.node.Node): this
    reads its records and calls its `move_to`, which does the moving."""

    def __init__(self, node, trigger, *, num_blocks: int, period_s: float, drain_timeout_s: float):
        self.node = node
        self.trigger = trigger
        self.trigger_state = trigger.start()
        self.num_blocks = num_blocks
        self.period_s = period_s
        self.drain_timeout_s = drain_timeout_s  # what a throughput move lets sessions take to finish (node.move_to)
        self.rng = np.random.default_rng(_seed(node.peer_id))
        self.episode = False  # the trigger fired and throughput moves are being planned
        self._stopped = asyncio.Event()
        self._started = time.monotonic()

    # ---- deciding ----------------------------------------------------------------------------------------

    async def read_swarm(self) -> list[NodeInfo]:
        """Every record under the model key, this node's own replaced by its live record."""
        node = self.node
        timeout_s = node.config.network.peer_timeout_s
        records = await asyncio.wait_for(fetch_node_infos(node.dht, node.dht_prefix), timeout_s)
        infos = [record.info for record in records if record.info.peer_id != node.peer_id]
        return [*infos, node.current_info()]

    def decide(self, infos: list[NodeInfo], now_s: float) -> tuple[Move | None, str]:
        """(the move this node should make, why: "hole" or the trigger's name), or (None, ""). Feeds the trigger."""
        peer_id = self.node.peer_id
        move = cover_hole(planning_snapshot(infos, self.num_blocks, draining_serves=False), peer_id)
        if move is not None:
            return move, "hole"
        snapshot = planning_snapshot(infos, self.num_blocks, draining_serves=True)
        observation = TriggerInput(now_s, snapshot, placement_from_snapshot(snapshot))
        try:
            self.trigger_state, fired = self.trigger.step(self.trigger_state, observation)
        except Exception as exc:  # a degenerate snapshot (no node, no link measured yet) is no evidence of change
            logger.debug("rebalance trigger %s failed on this snapshot: %r", self.trigger.name, exc)
            fired = False
        if fired and not self.episode:
            events.info("rebalance trigger %s fired", self.trigger.name)
        self.episode = self.episode or fired
        if not self.episode:
            return None, ""
        plan = plan_moves(placement_from_snapshot(snapshot))  # what should_move reads, for every node at once
        if not plan:
            self.episode = False  # no node has a move worth its margin: the episode is over
            return None, ""
        return next((move for move in plan if move.peer_id == peer_id), None), self.trigger.name

    async def check(self) -> Move | None:
        """One round: read, decide, confirm after a random delay, move. Returns the move made, if any."""
        if self.node.moving:  # a move is under way (one asked by the operator)
            return None
        now = time.monotonic() - self._started
        move, reason = await asyncio.to_thread(self.decide, await self.read_swarm(), now)  # homology: numpy/gudhi
        if move is None:
            return None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), timeout=self.rng.uniform(0.0, CONFIRM) * self.period_s)
            return None
        infos = await self.read_swarm()
        if reason == "hole":
            confirmed = cover_hole(planning_snapshot(infos, self.num_blocks, draining_serves=False), self.node.peer_id)
        else:
            confirmed = should_move(planning_snapshot(infos, self.num_blocks, draining_serves=True), self.node.peer_id)
        if confirmed is None or confirmed.to_start != move.to_start:
            logger.debug("planned move to block %d no longer holds on a second read", move.to_start)
            return None
        await self.node.move_to(confirmed.to_start, reason=reason, drain_timeout_s=self.drain_timeout_s)
        return confirmed

    async def run(self, stopped: asyncio.Event | None = None) -> None:
        """Check every period (jittered) until `stopped` is set or shutdown() is called."""
        if stopped is not None:
            self._stopped = stopped
        while not self._stopped.is_set():
            wait = self.period_s * self.rng.uniform(1.0 - JITTER, 1.0 + JITTER)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), timeout=wait)
                return
            try:
                await self.check()
            except Exception as exc:  # a DHT read that timed out, a peer gone: try again next period
                logger.warning("rebalance check failed: %r", exc)

    async def shutdown(self) -> None:
        self._stopped.set()
