"""Following a schema book (sec. 2.7.1 of the Nesa paper): when the swarm's topology class changes, move toward the
assignment the book stores for the new class. One pure policy that both a node daemon (server/rebalance.py) and the
life simulator (life.py) step once per snapshot, so what the simulator measures is what nodes do.

Per snapshot, given the book's assignment for it (schemas.apply_schema):
- The class is the assignment's label, or FAR when the snapshot lies beyond the book's radius from every class. A new
  class counts once CONFIRMATIONS snapshots in a row show it, the first one too; until then nothing moves. Measured:
  a swarm whose snapshots sit near the radius flips between a class and FAR from one snapshot to the next, and every
  flip would start a round of planning (14 changes in six simulated hours without this, 109 moves against 19). And
  a node that has just joined first sees the swarm as it was while it joined (the nodes it replaces still listed),
  a state far from every class, which taken at once started a recomputation the next snapshot no longer called for.
- Far, or a schema that would leave a block unserved (the assignment was recomputed): the book defers, and the
  caller's own planning (a trigger's episode of balancing.plan_moves) decides. Becoming far counts as a change: it
  starts such an episode (`BookStep.recompute`).
- Otherwise the book decides. A class change, or the caller's trigger firing, starts adopting the class's assignment
  if it beats the current bottleneck throughput by the hysteresis margin (balancing.plan_toward); rounds go on
  while it still does, the moves that raise the throughput most first. Nothing moves when neither happened. The
  margin holds to the end on purpose: a schema is a template by capacity rank, and in a large swarm most of the
  moves that would match it exactly change the throughput by nothing while each drops the mover's sessions.

The margin is SCHEMA_MARGIN, twice balancing's. Measured in six simulated hours of 600 nodes (bench/topology.py
`book_in_life`: the homology trigger alone made 19 moves; with a book of the scenario's five states): at a 5% margin
the book took 111 moves for +0.6% mean and +0.8% 10th-percentile throughput, at 10% 47 moves for +0.3% and +0.9%.
The joining rule and balancing's own moves already hold such a swarm within about 1% of the best assignment, so a
book earns its keep by deciding in a fraction of a millisecond, not by a better placement.

Pure: no clock, no I/O; the state is a frozen value passed back in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nesa_node.sharding.balancing import Move, Placement, plan_toward
from nesa_node.topology.schemas import Assignment

FAR = -1  # the class of a snapshot far from every class of the book
SCHEMA_MARGIN = 0.10  # hysteresis of adopting a schema (measured, module docstring; balancing.MARGIN is 0.05)
CONFIRMATIONS = 2  # snapshots in a row that must show a new class before it counts (guess: one check's noise)

__all__ = ["CONFIRMATIONS", "FAR", "SCHEMA_MARGIN", "BookState", "BookStep", "follow_book"]


@dataclass(frozen=True)
class BookState:
    topology_class: int | None = None  # the swarm's class (FAR: none of the book's); None before any snapshot
    adopting: int | None = None  # the class whose assignment the swarm is moving toward
    pending: int | None = None  # another class the last snapshots showed, not yet confirmed
    seen: int = 0  # snapshots in a row that showed `pending`


@dataclass(frozen=True)
class BookStep:
    moves: tuple[Move, ...] | None  # this round's moves toward the schema; None: the book defers to the caller
    changed: bool  # the class differs from the last snapshot's
    recompute: bool  # the swarm became far from every class: the caller starts an episode of its own planning
    started: bool  # adoption of the class's assignment began this round
    finished: bool  # adoption ended this round (no move left)


def follow_book(
    state: BookState,
    assignment: Assignment,
    placement: Placement,
    *,
    serving: np.ndarray | None = None,
    fired: bool = False,
    margin: float = SCHEMA_MARGIN,
    max_moves: int | None = None,
) -> tuple[BookState, BookStep]:
    """One round of the policy (module docstring) on the snapshot whose `placement` (placement_from_snapshot with
    the book's demand: nodes sorted by peer id) the book assigned as `assignment`. `serving` and `max_moves` are
    plan_toward's; `fired`: the caller's trigger fired on this snapshot. Raises ValueError when the assignment is
    of other nodes than the placement."""
    if assignment.placement.peer_ids != placement.peer_ids:
        raise ValueError("the assignment is of other nodes than the placement")
    label = FAR if assignment.far else assignment.label
    changed = label != state.topology_class
    if changed:
        seen = state.seen + 1 if label == state.pending else 1
        if seen < CONFIRMATIONS:
            waiting = BookState(state.topology_class, state.adopting, label, seen)
            return waiting, BookStep((), False, False, False, False)
    if assignment.recomputed:
        step = BookStep(None, changed, changed and label == FAR, False, state.adopting is not None)
        return BookState(label, None), step
    under_way = state.adopting == label
    if not (under_way or changed or fired):
        return BookState(label, None), BookStep((), changed, False, False, False)
    moves = plan_toward(placement, assignment.placement.start, serving=serving, margin=margin, max_moves=max_moves)
    adopting = label if moves else None
    step = BookStep(moves, changed, False, bool(moves) and not under_way, under_way and not moves)
    return BookState(label, adopting), step
