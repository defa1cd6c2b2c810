"""When the swarm should re-evaluate its block placement: three pluggable trigger policies.

A trigger is a frozen policy object with an explicit state: `state = trigger.start()`, then at every snapshot
`state, fired = trigger.step(state, observation)`. Pure: no clock (the observation carries the time), no I/O, so
the same objects drive the simulation (topology/life.py) and a node daemon.

- `HomologyTrigger` (ours, Nesa sec. 2.7): fires when the snapshot's persistence diagrams move further from the
  reference than repeated measurements of an unchanged swarm do (monitor.py).
- `LoadVariationTrigger` (what Parallax does): fires when the coefficient of variation of the per-block load,
  demand_b / served_b, exceeds a threshold.
- `PeriodicTrigger` (what Petals does): fires every `period_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nesa_node.routing.snapshot import SwarmSnapshot
from nesa_node.sharding.balancing import Placement, served_throughput
from nesa_node.topology.graph import NEIGHBOURS, swarm_graph
from nesa_node.topology.homology import diagrams
from nesa_node.topology.monitor import ChangeThreshold, MonitorState, observe, start_monitor

PETALS_PERIOD_S = 120.0  # petals servers re-check their blocks about every 2 minutes (mean_balance_check_period)
LOAD_CV_THRESHOLD = 0.5  # coefficient of variation of per-block load that counts as imbalance (guess)

__all__ = [
    "HomologyTrigger",
    "LoadVariationTrigger",
    "PeriodicTrigger",
    "TriggerInput",
    "load_variation",
]


@dataclass(frozen=True, eq=False)
class TriggerInput:
    time_s: float
    snapshot: SwarmSnapshot
    placement: Placement  # balancing.placement_from_snapshot(snapshot)


@dataclass(frozen=True)
class PeriodicTrigger:
    period_s: float = PETALS_PERIOD_S
    name: str = "periodic"

    def start(self) -> float:
        return -np.inf  # time of the last firing

    def step(self, state: float, observation: TriggerInput) -> tuple[float, bool]:
        if observation.time_s - state >= self.period_s:
            return observation.time_s, True
        return state, False


def load_variation(placement: Placement) -> float:
    """Coefficient of variation (std / mean) of the per-block load demand_b / served_b; inf if a block is
    unserved."""
    served, _ = served_throughput(placement.num_blocks, placement.start, placement.length, placement.throughput)
    if np.any(served <= 0):
        return float("inf")
    load = placement.demand / served
    return float(load.std() / load.mean())


@dataclass(frozen=True)
class LoadVariationTrigger:
    threshold: float = LOAD_CV_THRESHOLD
    name: str = "load-cv"

    def start(self) -> None:
        return None

    def step(self, state: None, observation: TriggerInput) -> tuple[None, bool]:
        return state, load_variation(observation.placement) > self.threshold


@dataclass(frozen=True)
class HomologyTrigger:
    threshold: ChangeThreshold  # monitor.learn_threshold on repeated measurements of the swarm
    neighbours: int = NEIGHBOURS
    name: str = "homology"

    def start(self) -> MonitorState:
        return start_monitor(self.threshold)

    def step(self, state: MonitorState, observation: TriggerInput) -> tuple[MonitorState, bool]:
        snapshot_diagrams = diagrams(swarm_graph(observation.snapshot, neighbours=self.neighbours))
        state = observe(state, snapshot_diagrams, observation.time_s)
        return state, bool(state.last is not None and state.last.changed)
