"""Hours of swarm life on the routing simulator (routing/simulate.py): churn, outages, joins, and block moves.

At every announce tick: nodes that came back or joined pick their span with the joining rule
(sharding/balancing.join_span) and load it; the trigger under test looks at the snapshot the nodes announced (with
the moved spans); once it fires, the swarm runs rebalancing rounds (balancing.plan_moves, a few nodes per round)
until a round finds no move worth its margin. The same joining rule, planner and margins serve every trigger, so
the comparison is of the triggers alone. With a schema book the nodes also follow it (adoption.follow_book, as a
node daemon given `--schema-book` does): a class change moves the swarm toward the class's stored assignment, and a
snapshot far from every class starts the trigger's planning.

Measured on the truth, not on the announced figures:
- throughput: the swarm's bottleneck throughput (balancing.swarm_throughput) of the nodes that are online and not
  loading blocks, at their true load, tokens/s; 0 while a block has no server.
- moves: block moves ordered by rebalancing (joins are not counted: every policy does the same for them).
- failed requests: a node that moves drops its sessions. With requests arriving at `request_rate_per_s` and each
  holding a session for `session_s`, a node carries the share tps_i / served_b of block b's traffic, so a move
  drops request_rate * session_s * mean over its span of that share (expected count).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nesa_node.routing.simulate import Simulator
from nesa_node.sharding.balancing import (
    MARGIN,
    join_span,
    placement_from_snapshot,
    plan_moves,
    served_throughput,
    swarm_throughput,
)
from nesa_node.topology.adoption import SCHEMA_MARGIN, BookState, follow_book
from nesa_node.topology.graph import swarm_graph
from nesa_node.topology.homology import diagrams, features
from nesa_node.topology.monitor import ChangeThreshold, learn_threshold
from nesa_node.topology.schemas import SchemaBook, apply_schema
from nesa_node.topology.triggers import TriggerInput

LOAD_GBPS = 1.0  # GB/s a node reads weights from its local disk into the GPU (guess: NVMe, fp16 safetensors)
STARTUP_S = 20.0  # a node's restart, DHT announce and warm-up after loading (guess)
REQUEST_RATE_PER_S = 1.0  # requests arriving at the swarm (guess: a modest public swarm)
SESSION_S = 60.0  # mean session length (guess: 128 new tokens at a few tokens/s plus the prefill)
CALIBRATION_SNAPSHOTS = 20  # repeated measurements behind the change threshold (190 pairs)

__all__ = ["LifeConfig", "LifeResult", "calibrate", "simulate_life"]


@dataclass(frozen=True)
class LifeConfig:
    margin: float = MARGIN  # hysteresis of the planner
    schema_margin: float = SCHEMA_MARGIN  # hysteresis of adopting a schema book's assignment
    max_moves: int | None = None  # per rebalancing round; None: balancing.MAX_MOVES_SHARE of the nodes
    request_rate_per_s: float = REQUEST_RATE_PER_S
    session_s: float = SESSION_S
    load_gbps: float = LOAD_GBPS
    startup_s: float = STARTUP_S


@dataclass(frozen=True, eq=False)
class LifeResult:
    trigger: str
    times_s: np.ndarray  # (ticks,)
    throughput_tps: np.ndarray  # (ticks,) true bottleneck throughput, tokens/s
    moves: int
    failed_requests: float  # expected requests dropped by moving nodes
    firings: int  # times the trigger fired
    rounds: int  # rebalancing rounds run
    schema_moves: int = 0  # of `moves`, those toward a schema book's assignment
    class_changes: int = 0  # times the book's class of the snapshot changed (far from every class included)

    def summary(self) -> dict:
        return {
            "trigger": self.trigger,
            "mean_throughput_tps": float(self.throughput_tps.mean()),
            "p10_throughput_tps": float(np.percentile(self.throughput_tps, 10)),
            "ticks_without_full_coverage": int((self.throughput_tps <= 0).sum()),
            "moves": self.moves,
            "failed_requests": self.failed_requests,
            "firings": self.firings,
            "rounds": self.rounds,
            "schema_moves": self.schema_moves,
            "class_changes": self.class_changes,
        }


def calibrate(simulator: Simulator, time_s: float = 0.0, count: int = CALIBRATION_SNAPSHOTS) -> ChangeThreshold:
    """Change threshold from `count` repeated measurements of the swarm at `time_s` (monitor.learn_threshold)."""
    repeated = [diagrams(swarm_graph(simulator.snapshot(time_s, remeasure_seed=seed))) for seed in range(count)]
    return learn_threshold(repeated)


def simulate_life(
    simulator: Simulator, trigger, config: LifeConfig = LifeConfig(), *, book: SchemaBook | None = None
) -> LifeResult:
    """Run the scenario's whole duration, one step per announce period, under `trigger` (triggers.py), following
    `book` too when given (the module docstring). Raises ValueError for a book of another model."""
    if book is not None and book.num_blocks != simulator.scenario.model.num_blocks:
        raise ValueError(
            f"the book is for {book.num_blocks} blocks, the model has {simulator.scenario.model.num_blocks}"
        )
    scenario = simulator.scenario
    period = scenario.announce_period_s
    ticks = int(scenario.duration_s // period)
    start = simulator.start.copy()
    length = simulator.end - simulator.start
    capacity = 1000.0 / (simulator.decode_ms * length)  # tokens/s through the span when idle
    load_s = length * scenario.model.block_gb / config.load_gbps + config.startup_s
    busy_until = np.zeros(simulator.num_nodes)
    was_online = np.zeros(simulator.num_nodes, bool)
    demand = np.ones(scenario.model.num_blocks)
    state = trigger.start()
    book_state = BookState()
    episode = False
    moves = firings = rounds = schema_moves = class_changes = 0
    failed = 0.0
    throughput = np.zeros(ticks)
    for tick in range(ticks):
        now = tick * period
        online = simulator.online(now)
        tps = capacity * (1.0 - simulator.load_at(now))
        if tick > 0:  # nodes that came back or joined take the joining rule; the first tick keeps the initial spans
            staying = online & was_online
            served, _ = served_throughput(scenario.model.num_blocks, start[staying], length[staying], tps[staying])
            for node in np.flatnonzero(online & ~was_online):
                start[node] = join_span(served, demand, int(length[node]))
                busy_until[node] = now + load_s[node]
                served[start[node] : start[node] + length[node]] += tps[node]  # so joiners of one tick spread out
        was_online = online
        serving = online & (busy_until <= now)
        served, _ = served_throughput(scenario.model.num_blocks, start[serving], length[serving], tps[serving])
        throughput[tick] = swarm_throughput(served, demand)
        snapshot = simulator.snapshot(now, starts=start)
        placement = placement_from_snapshot(snapshot, demand)
        index = np.array([int(peer[4:]) for peer in placement.peer_ids], np.int64)  # "node000123"
        placement = type(placement)(
            placement.num_blocks,
            placement.start,
            placement.length,
            placement.throughput,
            busy_until[index] <= now,
            placement.demand,
            placement.peer_ids,
        )
        state, fired = trigger.step(state, TriggerInput(now, snapshot, placement))
        firings += int(fired)
        planned = None
        if book is not None:
            assignment = apply_schema(snapshot, book, feature_vector=features(diagrams(swarm_graph(snapshot))))
            book_state, step = follow_book(
                book_state,
                assignment,
                placement,
                serving=placement.movable,
                fired=fired,
                margin=config.schema_margin,
                max_moves=config.max_moves,
            )
            class_changes += int(step.changed)
            episode = episode or step.recompute
            if step.moves is not None:  # the book decides
                episode = False
                planned = step.moves
                rounds += int(bool(planned))
                schema_moves += len(planned)
        if planned is None:
            episode = episode or fired
            if not episode:
                continue
            rounds += 1
            planned = plan_moves(placement, margin=config.margin, max_moves=config.max_moves)
            if not planned:
                episode = False
        for move in planned:
            node = int(index[move.node])
            if serving[node]:
                span = slice(start[node], start[node] + length[node])
                share = float(np.mean(tps[node] / np.maximum(served[span], 1e-12)))
                failed += config.request_rate_per_s * config.session_s * min(share, 1.0)
            start[node] = move.to_start
            busy_until[node] = now + load_s[node]
            moves += 1
    name = trigger.name if book is None else f"{trigger.name}+book"
    return LifeResult(
        name, np.arange(ticks) * period, throughput, moves, failed, firings, rounds, schema_moves, class_changes
    )
