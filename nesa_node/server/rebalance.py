"""Live rebalancing: the node daemon moves to other blocks when the swarm needs it (eq. 3, R: S x P -> S').

Every `rebalance_period_s` (jittered by +-JITTER, from a generator seeded with the peer id, so nodes started together
do not read the DHT in step) the Rebalancer reads the swarm's NodeInfo records, builds the snapshot a client would
(swarm_view.build_snapshot, with this node's own record as it is now) and decides with the pure planners of
sharding/balancing.py:

1. A coverage hole (a block no online node serves) always counts: `cover_hole` names the one node to move.
2. Otherwise the configured trigger (topology/triggers.py: homology, load-cv or periodic) sees the snapshot; once
   it fires an episode starts, and every check asks `should_move` until a check finds no move for any node (as
   topology/life.py simulates). `off` starts no Rebalancer: the node keeps its blocks.
3. With a schema book (`--schema-book`, Nesa sec. 2.7.1; topology/schemas.py) the classifier reads every snapshot
   too, and the policy of topology/adoption.py decides: when the swarm's topology class changes, or the trigger
   fires, and the class's stored assignment beats the current bottleneck throughput by its margin, the swarm moves
   toward that assignment (`balancing.plan_toward`: a few nodes per round, every block keeps an online node that is
   not moving) while it still does. A snapshot further than the book's radius from every class is a class the book
   does not know: that change starts an episode of step 2, whose plan is recomputed from the snapshot. Every node
   needs the same book (its digest is logged at start) for the nodes to agree on one plan.

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
from collections import deque
from dataclasses import dataclass

import numpy as np

from nesa_node.protocol.dht import fetch_node_infos
from nesa_node.protocol.records import NodeInfo, NodeState
from nesa_node.routing.snapshot import SwarmSnapshot
from nesa_node.schema_book import book_digest, load_book
from nesa_node.sharding.balancing import (
    Move,
    cover_hole,
    placement_from_snapshot,
    plan_moves,
    plan_toward,
    should_move,
)
from nesa_node.swarm_view import build_snapshot
from nesa_node.topology.adoption import FAR, BookState, follow_book
from nesa_node.topology.graph import swarm_graph
from nesa_node.topology.homology import diagrams, features
from nesa_node.topology.monitor import learn_threshold
from nesa_node.topology.schemas import Assignment, SchemaBook, apply_schema
from nesa_node.topology.triggers import HomologyTrigger, LoadVariationTrigger, PeriodicTrigger, TriggerInput

logger = logging.getLogger(__name__)
events = logging.getLogger("nesa_node.events")  # shown at the default log level

TRIGGERS = ("homology", "load-cv", "periodic", "off")
JITTER = 0.25  # share of the period each wait varies by (guess: spreads a swarm's reads over half a period)
CONFIRM = 0.25  # a planned mover re-reads within this share of the period before moving (guess, as JITTER)
CALIBRATION_SNAPSHOTS = 5  # snapshots behind the homology change threshold (10 pairs; topology/life.py uses 20)

__all__ = [
    "CalibratedHomologyTrigger",
    "Rebalancer",
    "TRIGGERS",
    "load_schema_book",
    "make_trigger",
    "planning_snapshot",
    "schema_plan",
]


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


def load_schema_book(config, num_blocks: int) -> SchemaBook | None:
    """The book `config.schema_book` (a RebalanceConfig) names, or None. Raises SchemaBookError for a file that is not
    a book of this model, ValueError when rebalancing is off or gudhi is missing."""
    if config.schema_book is None:
        return None
    if config.trigger == "off":
        raise ValueError("--schema-book decides where to move, and --rebalance off never moves: drop one of them")
    if importlib.util.find_spec("gudhi") is None:
        raise ValueError("a schema book classifies the swarm's topology with gudhi: pip install 'nesa-node[topology]'")
    book = load_book(config.schema_book, num_blocks=num_blocks)
    events.info(
        "schema book %s (%s): %d topology classes, radius %.1f",
        config.schema_book,
        book_digest(book),
        len(book.schemas),
        book.radius,
    )
    return book


def planning_snapshot(infos: list[NodeInfo], num_blocks: int, *, draining_serves: bool) -> SwarmSnapshot:
    """The snapshot the planners read: a joining node counts as online at its announced (new) span; with
    `draining_serves` a draining node counts as online at its old span too (throughput planning: the plan must not
    change while its mover drains; the hole planner instead sees draining nodes as serving nothing)."""
    counted = {NodeState.joining, NodeState.draining} if draining_serves else {NodeState.joining}
    views = [info.model_copy(update={"state": NodeState.online}) if info.state in counted else info for info in infos]
    return build_snapshot(views, num_blocks)


def _seed(peer_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=8).digest(), "big")


SCHEMA = "schema"  # the reason of a move toward a schema book's assignment (Node.moves, logs)
CLASS_HISTORY = 100  # topology class changes a rebalancer remembers (for operators and tests)


def _serving(placement, infos: list[NodeInfo]) -> np.ndarray:
    """(n,) bool in the placement's node order: the node's record says online (not draining, not joining)."""
    online = {info.peer_id for info in infos if info.state == NodeState.online}
    return np.array([peer_id in online for peer_id in placement.peer_ids], bool)


def schema_plan(
    snapshot: SwarmSnapshot, infos: list[NodeInfo], assignment: Assignment, book: SchemaBook, *, margin: float
) -> tuple[Move, ...]:
    """The moves toward `assignment` (apply_schema of `snapshot`, the planning snapshot of `infos`)."""
    placement = placement_from_snapshot(snapshot, book.demand)
    if placement.peer_ids != assignment.placement.peer_ids:  # both sort the same nodes by peer id
        raise RuntimeError("the schema's assignment is of other nodes than the snapshot")
    return plan_toward(placement, assignment.placement.start, serving=_serving(placement, infos), margin=margin)


class Rebalancer:
    """Decides when the node moves; lives as a task of the node (run). `node` is the daemon (server.node.Node): this
    reads its records and calls its `move_to`, which does the moving."""

    def __init__(
        self,
        node,
        trigger,
        *,
        num_blocks: int,
        period_s: float,
        drain_timeout_s: float,
        book: SchemaBook | None = None,
    ):
        self.node = node
        self.trigger = trigger
        self.trigger_state = trigger.start()
        self.num_blocks = num_blocks
        self.period_s = period_s
        self.drain_timeout_s = drain_timeout_s  # what a throughput move lets sessions take to finish (node.move_to)
        self.book = book
        self.rng = np.random.default_rng(_seed(node.peer_id))
        self.episode = False  # the trigger fired and throughput moves are being planned
        self.book_state = BookState()  # the class of the last snapshot, and the one being adopted
        self.classes: deque[tuple[float, int, float]] = deque(maxlen=CLASS_HISTORY)  # (s since start, class, distance)
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
        """(the move this node should make, why: "hole", "schema LABEL" or the trigger's name), or (None, ""). Feeds
        the trigger, and the book's classifier when there is a book."""
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
        if self.book is not None:
            decided = self._toward_schema(snapshot, infos, fired, now_s)
            if decided is not None:
                return decided
        self.episode = self.episode or fired
        if not self.episode:
            return None, ""
        plan = plan_moves(placement_from_snapshot(snapshot))  # what should_move reads, for every node at once
        if not plan:
            self.episode = False  # no node has a move worth its margin: the episode is over
            return None, ""
        return next((move for move in plan if move.peer_id == peer_id), None), self.trigger.name

    @property
    def topology_class(self) -> int | None:
        """The book's class of the last snapshot checked (FAR: none of its classes); None without a book or yet."""
        return self.book_state.topology_class

    def assign(self, snapshot: SwarmSnapshot) -> Assignment | None:
        """The book's assignment for the snapshot (None without a book or for a snapshot with no graph yet)."""
        if self.book is None:
            return None
        try:
            vector = features(diagrams(swarm_graph(snapshot)))
            return apply_schema(snapshot, self.book, feature_vector=vector)
        except Exception as exc:  # no serving node, no link measured yet: no evidence of a class
            logger.debug("classifying the snapshot failed: %r", exc)
            return None

    def _toward_schema(
        self, snapshot: SwarmSnapshot, infos: list[NodeInfo], fired: bool, now_s: float
    ) -> tuple[Move | None, str] | None:
        """Step 3 of the module docstring (topology/adoption.py): (move or None, reason) when the book decides this
        check, None when the trigger's own planning does (a class the book does not know, or a schema that would
        leave a gap)."""
        assignment = self.assign(snapshot)
        if assignment is None:
            return None
        placement = placement_from_snapshot(snapshot, self.book.demand)
        self.book_state, step = follow_book(
            self.book_state, assignment, placement, serving=_serving(placement, infos), fired=fired
        )
        label = self.book_state.topology_class
        if step.changed:
            self.classes.append((now_s, label, assignment.distance))
            if label == FAR:
                events.info("topology: far from every class of the schema book (distance %.1f, radius %.1f): "
                            "recomputing", assignment.distance, self.book.radius)  # fmt: skip
            else:
                events.info("topology: class %d (distance %.1f of radius %.1f)", label, assignment.distance,
                            self.book.radius)  # fmt: skip
        if step.recompute:
            self.episode = True
        if step.finished:
            events.info("topology: adoption of class %d's schema ended", label)
        if step.moves is None:
            return None
        self.episode = False  # the book plans for this class; the trigger's episode is over
        if step.started:
            events.info("topology: moving toward class %d's schema (%d moves this round)", label, len(step.moves))
        move = next((move for move in step.moves if move.peer_id == self.node.peer_id), None)
        return move, (f"{SCHEMA} {label}" if step.moves else "")

    def confirm(self, infos: list[NodeInfo], reason: str) -> Move | None:
        """The move a second read still names for this node, by the rule that planned it (`reason`)."""
        peer_id = self.node.peer_id
        if reason == "hole":
            return cover_hole(planning_snapshot(infos, self.num_blocks, draining_serves=False), peer_id)
        snapshot = planning_snapshot(infos, self.num_blocks, draining_serves=True)
        if not reason.startswith(SCHEMA):
            return should_move(snapshot, peer_id)
        assignment = self.assign(snapshot)
        if assignment is None or assignment.recomputed or f"{SCHEMA} {assignment.label}" != reason:
            return None
        plan = schema_plan(snapshot, infos, assignment, self.book, margin=0.0)
        return next((move for move in plan if move.peer_id == peer_id), None)

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
        confirmed = await asyncio.to_thread(self.confirm, await self.read_swarm(), reason)
        if confirmed is None or confirmed.to_start != move.to_start:
            logger.debug("planned move to block %d no longer holds on a second read", move.to_start)
            return None
        if self._stopped.is_set():  # the node began to stop during the second read
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
