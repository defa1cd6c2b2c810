"""Which blocks each node should serve: the joining rule and the rebalancing R: S x P -> S' (eq. 3 of the Nesa paper).

Pure numpy over frozen inputs (no torch, no networking): a daemon calls `should_move(snapshot, peer_id)` to learn
whether to move and to which span; the simulator (topology/life.py) calls `plan_moves` on the whole swarm.

Model. Node i serves the contiguous span [start_i, start_i + length_i) (its length is what fits in its memory and
does not change when it moves) at throughput tps_i tokens/s through the whole span. The served throughput of block
b is the sum of tps_i over the nodes covering it, and with demand weights d_b (relative traffic through block b;
all ones when every request runs the whole model) the swarm's throughput is its bottleneck

    T = min_b served_b / d_b     (tokens/s the swarm can push through every block)

- Joining (`join_span`): a new node takes the window of its length whose weakest block (served / demand) is the
  weakest; ties go to the window with the lower mean, then to the lower start (petals' rule, demand-weighted).
- Coverage holes (`plan_hole_cover`, `cover_hole`): when a block has no server at all, the node to move is chosen
  by coverage alone (server counts, deterministic ties), before any throughput planning.
- Rebalancing (`plan_moves`, eq. 3 with P the announced throughputs, loads and demand): greedily, up to
  `max_moves` times, the single move (a node leaves its span for the weakest window of its length) that raises T
  the most, ties (a flat bottleneck of many equally weak blocks) broken by the least summed load
  sum_b demand_b / served_b; a move never lowers T nor leaves a block without a server. The plan is the shortest
  prefix of those moves that reaches the best T found, and it is empty unless that T beats the current one by more
  than the hysteresis `margin`. A swarm whose nodes decide alone and at once flip-flops: they all see the same weak
  block and all move to it. Here every node computes the same plan from the same snapshot (nodes sorted by peer
  id, deterministic ties) and only the nodes in the plan move, a few per round.
- Toward a target (`plan_toward`): the moves that take the swarm to given spans (a topology class's precomputed
  schema, topology/schemas.py) under the same rules: hysteresis, a few moves per round, and no block left without
  a serving node, also while the planned movers drain and load at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from nesa_node.routing.snapshot import SwarmSnapshot

MARGIN = 0.05  # move only for > 5% more swarm throughput (guess: above the ~5% noise of announced throughputs)
MAX_MOVES_SHARE = 0.05  # at most 5% of the nodes move per decision, at least one (guess)
BEST_ROUNDS = 20  # planning rounds of best_placement (measured: 200-1,000 simulated nodes converge in 2-4)

__all__ = [
    "Move",
    "Placement",
    "apply_moves",
    "best_placement",
    "cover_hole",
    "join_span",
    "placement_from_snapshot",
    "plan_hole_cover",
    "plan_moves",
    "plan_toward",
    "served_throughput",
    "should_move",
    "swarm_throughput",
]


@dataclass(frozen=True, eq=False)
class Placement:
    """The swarm's spans. Arrays are indexed by node; `peer_ids` names them (sorted for snapshots)."""

    num_blocks: int
    start: np.ndarray  # (n,) int, first block
    length: np.ndarray  # (n,) int, blocks served, >= 1
    throughput: np.ndarray  # (n,) tokens/s through the node's span at its load
    movable: np.ndarray  # (n,) bool: serving and allowed to move now
    demand: np.ndarray  # (num_blocks,) relative traffic per block, > 0
    peer_ids: tuple[str, ...] = ()

    def __post_init__(self):
        if np.any(self.length < 1) or np.any(self.start < 0) or np.any(self.start + self.length > self.num_blocks):
            raise ValueError("every span must lie inside [0, num_blocks) and hold at least one block")
        if self.demand.shape != (self.num_blocks,) or np.any(self.demand <= 0):
            raise ValueError("demand must hold one positive weight per block")


@dataclass(frozen=True)
class Move:
    node: int  # index into the placement
    peer_id: str
    from_start: int
    to_start: int
    throughput_before: float  # swarm throughput T before this move, tokens/s
    throughput_after: float


def served_throughput(
    num_blocks: int, start: np.ndarray, length: np.ndarray, throughput: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(served tokens/s per block, servers per block) of the spans."""
    delta = np.zeros(num_blocks + 1)
    count = np.zeros(num_blocks + 1, np.int64)
    np.add.at(delta, start, throughput)
    np.add.at(delta, start + length, -throughput)
    np.add.at(count, start, 1)
    np.add.at(count, start + length, -1)
    return np.cumsum(delta)[:-1], np.cumsum(count)[:-1]


def swarm_throughput(served: np.ndarray, demand: np.ndarray | None = None) -> float:
    """T = min_b served_b / demand_b, tokens/s (0 when a block has no server)."""
    demand = np.ones_like(served) if demand is None else demand
    return float(np.min(served / demand)) if served.size else 0.0


def join_span(served: np.ndarray, demand: np.ndarray, length: int) -> int:
    """Start block for a node of `length` blocks: the window with the weakest block (ties: lower mean, then lower
    start). Raises ValueError if the length does not fit."""
    if not 1 <= length <= served.size:
        raise ValueError(f"span of {length} blocks does not fit {served.size} blocks")
    ratio = served / demand
    windows = np.lib.stride_tricks.sliding_window_view(ratio, length)
    weakest, mean = windows.min(axis=1), windows.mean(axis=1)
    return int(np.lexsort((np.arange(weakest.size), mean, weakest))[0])


def _best_moves(
    placement: Placement, served: np.ndarray, servers: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every movable node: the start of the weakest window once it has left its span, the swarm throughput
    after moving there (-inf where the move would leave a block without a server or is no move), and the summed
    per-block load sum_b demand_b / served_b after it (inf where blocks go unserved)."""
    count, blocks = placement.start.size, placement.num_blocks
    target = np.zeros(count, np.int64)
    after = np.full(count, -np.inf)
    pressure = np.full(count, np.inf)
    block = np.arange(blocks)
    for length in np.unique(placement.length[placement.movable]):
        group = np.flatnonzero(placement.movable & (placement.length == length))
        inside = (block[None] >= placement.start[group, None]) & (block[None] < (placement.start + length)[group, None])
        without = served[None] - inside * placement.throughput[group, None]  # (g, blocks)
        ratio = without / placement.demand[None]
        windows = np.lib.stride_tricks.sliding_window_view(ratio, length, axis=1)  # (g, starts, length)
        weakest, mean = windows.min(axis=2), windows.mean(axis=2)
        # weakest window first, then lower mean, then lower start: lexsort per row via a combined key
        order = np.lexsort((np.broadcast_to(np.arange(weakest.shape[1]), weakest.shape), mean, weakest), axis=1)
        chosen = order[:, 0]
        new_inside = (block[None] >= chosen[:, None]) & (block[None] < chosen[:, None] + length)
        moved = without + new_inside * placement.throughput[group, None]
        covered = (servers[None] - inside + new_inside) >= 1
        value = np.min(moved / placement.demand[None], axis=1)
        valid = covered.all(axis=1) & (chosen != placement.start[group])
        with np.errstate(divide="ignore"):
            load = np.where(valid, (placement.demand[None] / np.maximum(moved, 0.0)).sum(axis=1), np.inf)
        target[group], after[group], pressure[group] = chosen, np.where(valid, value, -np.inf), load
    return target, after, pressure


def plan_moves(placement: Placement, *, margin: float = MARGIN, max_moves: int | None = None) -> tuple[Move, ...]:
    """Eq. 3: the moves, in order, that take the swarm from `placement` toward a higher bottleneck throughput (see
    the module docstring). Each move raises T by more than `margin` (relative) and leaves every block served.
    `max_moves` defaults to MAX_MOVES_SHARE of the nodes, at least one. Raises ValueError for a negative margin."""
    if margin < 0:
        raise ValueError("margin must be >= 0")
    limit = max(1, int(MAX_MOVES_SHARE * placement.start.size)) if max_moves is None else max_moves
    start = placement.start.copy()
    movable = placement.movable.copy()
    moves: list[Move] = []
    served, servers = served_throughput(placement.num_blocks, start, placement.length, placement.throughput)
    initial = swarm_throughput(served, placement.demand)
    pressure_now = _pressure(served, placement.demand)
    best_prefix, best_value = 0, initial
    for _ in range(limit):
        current = Placement(
            placement.num_blocks, start, placement.length, placement.throughput, movable, placement.demand
        )
        before = swarm_throughput(served, placement.demand)
        target, after, pressure = _best_moves(current, served, servers)
        # lexicographic: the highest bottleneck, then the least summed load (it lifts a flat bottleneck of many
        # equally weak blocks one window at a time); only strict improvements
        order = np.lexsort((np.arange(after.size), pressure, -after))
        node = int(order[0]) if order.size else 0
        if order.size == 0 or not np.isfinite(after[node]):
            break
        # the chosen move judged on sums taken afresh, as the swarm will measure them: the vectorised figures
        # above subtract and add throughputs, and their rounding must not make a move that changes nothing look
        # like a gain
        moved = start.copy()
        moved[node] = target[node]
        served_next, servers_next = served_throughput(
            placement.num_blocks, moved, placement.length, placement.throughput
        )
        reached, pressure_next = (
            swarm_throughput(served_next, placement.demand),
            _pressure(served_next, placement.demand),
        )
        if reached < before or (reached == before and not pressure_next < pressure_now):
            break
        peer_id = placement.peer_ids[node] if placement.peer_ids else str(node)
        moves.append(Move(node, peer_id, int(start[node]), int(target[node]), before, reached))
        start = moved
        movable[node] = False  # a node moves at most once per decision
        served, servers, pressure_now = served_next, servers_next, pressure_next
        if reached > best_value:
            best_prefix, best_value = len(moves), reached
    if best_value > initial * (1.0 + margin):
        return tuple(moves[:best_prefix])  # the shortest prefix reaching the best bottleneck
    return ()


def _pressure(served: np.ndarray, demand: np.ndarray) -> float:
    """Summed per-block load sum_b demand_b / served_b (inf while a block is unserved)."""
    with np.errstate(divide="ignore"):
        return float((demand / np.maximum(served, 0.0)).sum())


def _interchanged(placement: Placement, target: np.ndarray, tolerance: float) -> np.ndarray:
    """`target` with the starts traded among interchangeable nodes (one length, throughputs within `tolerance` of
    the group's fastest) so that as many nodes as possible keep their current start: within each group a node whose
    start is one of the group's target starts keeps it, the others take the rest in index order, starts ascending."""
    matched = target.copy()
    for length in np.unique(placement.length).tolist():
        members = np.flatnonzero(placement.length == length)
        members = members[np.argsort(-placement.throughput[members], kind="stable")]
        groups: list[list[int]] = []
        for node in members.tolist():
            if groups and placement.throughput[node] >= placement.throughput[groups[-1][0]] * (1.0 - tolerance):
                groups[-1].append(node)
            else:
                groups.append([node])
        for group in groups:
            group.sort()
            pool = sorted(int(target[node]) for node in group)
            waiting = []
            for node in group:
                current = int(placement.start[node])
                if current in pool:
                    pool.remove(current)
                    matched[node] = current
                else:
                    waiting.append(node)
            for node, start in zip(waiting, pool, strict=True):
                matched[node] = start
    return matched


def plan_toward(
    placement: Placement,
    target: np.ndarray,
    *,
    serving: np.ndarray | None = None,
    margin: float = MARGIN,
    max_moves: int | None = None,
    tolerance: float = MARGIN,
) -> tuple[Move, ...]:
    """The moves, in order, that take the swarm from `placement` toward the spans starting at `target` (n,), such as
    a topology class's precomputed schema (topology/schemas.py), with rebalancing's safety rules:

    - Fewest moves: nodes of one length whose throughputs lie within `tolerance` (relative) of each other are
      interchangeable, so they trade target starts and as many as possible keep their span (`_interchanged`); the
      served throughput per block is the target's up to that tolerance.
    - Hysteresis: nothing moves unless the target's bottleneck T beats the current one by more than `margin`
      (relative), or, with margin 0, equals it with a lower summed load. A daemon adopting a schema starts with
      MARGIN and passes 0 once under way, so the swarm goes the whole way.
    - No block left unserved: `serving` (n,) marks the nodes that serve their span now (online: not draining, not
      still loading; default all). A node is planned only if every block serving nodes cover now keeps a serving
      node that is not moving in this plan, so blocks stay served while every planned mover drains and loads, even
      when they all move at once.
    - No move lowers T (counting the moves planned before it at their new spans).
    - Order: greedily the movable node whose move gives the highest T with the moves planned so far (ties: the least
      summed load, then the lower index), at most once per node, up to `max_moves` (default MAX_MOVES_SHARE of the
      nodes, at least one); then cut to the shortest prefix that reaches the best T of those moves, or to the first
      move alone when none raises T (a move that makes room: the gain needs more moves than one round). A node that
      cannot move yet waits for a later round; a target that only a dip in T or a bare block leads to is not
      reached, and the swarm stays where the last safe move left it.

    Raises ValueError for a target of another shape or outside the model, or a negative margin or tolerance."""
    count, blocks = placement.start.size, placement.num_blocks
    target = np.asarray(target, np.int64)
    if target.shape != (count,):
        raise ValueError(f"target must hold one start per node ({count}), got shape {target.shape}")
    if np.any(target < 0) or np.any(target + placement.length > blocks):
        raise ValueError("every target span must lie inside [0, num_blocks)")
    if margin < 0 or tolerance < 0:
        raise ValueError("margin and tolerance must be >= 0")
    serving = np.ones(count, bool) if serving is None else np.asarray(serving, bool)
    if serving.shape != (count,):
        raise ValueError("serving must hold one flag per node")
    limit = max(1, int(MAX_MOVES_SHARE * count)) if max_moves is None else max_moves
    goal = _interchanged(placement, target, tolerance)
    served_now, _ = served_throughput(blocks, placement.start, placement.length, placement.throughput)
    served_goal, _ = served_throughput(blocks, goal, placement.length, placement.throughput)
    now, best = swarm_throughput(served_now, placement.demand), swarm_throughput(served_goal, placement.demand)
    if margin > 0:
        worth = best > now * (1.0 + margin)
    else:
        worth = best > now or (
            best >= now and _pressure(served_goal, placement.demand) < _pressure(served_now, placement.demand)
        )
    if not worth:
        return ()
    ones = np.ones(count)
    _, covered = served_throughput(blocks, placement.start[serving], placement.length[serving], ones[serving])
    covered = covered >= 1  # (blocks,) the blocks serving nodes hold now: each must keep one that stays
    start, moved = placement.start.copy(), np.zeros(count, bool)
    moves: list[Move] = []
    for _ in range(limit):
        served, _ = served_throughput(blocks, start, placement.length, placement.throughput)
        before = swarm_throughput(served, placement.demand)
        best_key, chosen = None, -1
        for node in np.flatnonzero(placement.movable & ~moved & (start != goal)).tolist():
            staying = serving & ~moved
            staying[node] = False
            _, kept = served_throughput(blocks, start[staying], placement.length[staying], ones[staying])
            if np.any(covered & (kept < 1)):
                continue
            trial = start.copy()
            trial[node] = goal[node]
            served_after, _ = served_throughput(blocks, trial, placement.length, placement.throughput)
            after = swarm_throughput(served_after, placement.demand)
            if after < before * (1.0 - 1e-12):  # a move never lowers T
                continue
            key = (-after, _pressure(served_after, placement.demand), node)
            if best_key is None or key < best_key:
                best_key, chosen = key, node
        if best_key is None:
            break
        moves.append(
            Move(chosen, _peer(placement, chosen), int(start[chosen]), int(goal[chosen]), before, -best_key[0])
        )
        start[chosen], moved[chosen] = goal[chosen], True
    if not moves:
        return ()
    reached = [move.throughput_after for move in moves]
    if max(reached) > now:  # the shortest prefix that reaches the round's best T: later moves can wait
        return tuple(moves[: int(np.argmax(reached)) + 1])
    return tuple(moves[:1])  # no prefix raises T this round: one move that clears the way


def apply_moves(placement: Placement, moves: tuple[Move, ...]) -> Placement:
    """The placement after `moves` (a new object)."""
    start = placement.start.copy()
    for move in moves:
        start[move.node] = move.to_start
    return replace(placement, start=start)


def best_placement(placement: Placement, *, max_rounds: int = BEST_ROUNDS) -> Placement:
    """The best spans balancing finds for these nodes from scratch, ignoring where they are now: every node joins in
    turn (`join_span`, fastest first, ties by index), then `plan_moves` with no margin and no move limit runs until
    a round finds no move that raises T (at most `max_rounds` rounds). What topology/schemas.py stores per topology
    class and compares its schemas against. The planning rounds never uncover a block the joins covered.

    Raises ValueError when `max_rounds` < 0."""
    if max_rounds < 0:
        raise ValueError("max_rounds must be >= 0")
    order = np.lexsort((np.arange(placement.start.size), -placement.throughput))
    start = np.zeros_like(placement.start)
    served = np.zeros(placement.num_blocks)
    for node in order:
        length = int(placement.length[node])
        start[node] = join_span(served, placement.demand, length)
        served[start[node] : start[node] + length] += placement.throughput[node]
    best = Placement(
        placement.num_blocks,
        start,
        placement.length,
        placement.throughput,
        np.ones(start.size, bool),
        placement.demand,
        placement.peer_ids,
    )
    for _ in range(max_rounds):
        moves = plan_moves(best, margin=0.0, max_moves=best.start.size)
        if not moves:
            break
        best = apply_moves(best, moves)
    return replace(best, movable=placement.movable)


def placement_from_snapshot(snapshot: SwarmSnapshot, demand: np.ndarray | None = None) -> Placement:
    """The serving nodes of `snapshot` (online, not draining, with a span), sorted by peer id; throughput is the
    announced inference_tps at the announced load, tps * (1 - load)."""
    arrays = snapshot.arrays
    serving = [
        index
        for index in np.flatnonzero(arrays.available & (arrays.end > arrays.start))
        if snapshot.nodes[index].inference_tps > 0
    ]
    serving.sort(key=lambda index: snapshot.nodes[index].peer_id)
    chosen = np.array(serving, np.int64)
    tps = np.array([snapshot.nodes[index].inference_tps for index in serving], np.float64)
    demand = np.ones(snapshot.num_blocks) if demand is None else np.asarray(demand, np.float64)
    return Placement(
        snapshot.num_blocks,
        arrays.start[chosen],
        arrays.end[chosen] - arrays.start[chosen],
        tps * (1.0 - arrays.load[chosen]),
        np.ones(chosen.size, bool),
        demand,
        tuple(snapshot.nodes[index].peer_id for index in serving),
    )


def should_move(
    snapshot: SwarmSnapshot,
    peer_id: str,
    *,
    demand: np.ndarray | None = None,
    margin: float = MARGIN,
    max_moves: int | None = None,
) -> Move | None:
    """For a daemon: the move `peer_id` should make now (its new span is [to_start, to_start + its length)), or None.
    Every node computing this on the same snapshot gets the same plan, so only the planned nodes move."""
    placement = placement_from_snapshot(snapshot, demand)
    for move in plan_moves(placement, margin=margin, max_moves=max_moves):
        if move.peer_id == peer_id:
            return move
    return None


def plan_hole_cover(placement: Placement, serving: np.ndarray | None = None) -> tuple[Move, ...]:
    """The moves that cover blocks no serving node holds (a coverage hole), at most one per node, in order.

    `serving` (n,) bool marks the nodes whose span counts as served now (default: all); a node that is not serving
    but is movable (a node already draining to move) can still be chosen, so the plan does not change while the
    chosen node drains (one draining over the hole's blocks is leaving, not moving: never chosen). Greedily, while a hole is left: for every movable node, the window of its length that holds
    the most hole blocks once it has left its span (ties: the fewest servers at its weakest block, then the fewest
    on average, then the lower start), valid only if every block served before keeps a server; the node chosen
    covers the most hole blocks, then has the most other servers at the weakest block of its current span (it comes
    from where the swarm has the most redundancy), then the lower index (placements from snapshots are sorted by
    peer id). Server counts, not throughput: a hole is about existence, and nodes that announce no throughput still
    serve. Every node computing this on the same snapshot gets the same plan, so exactly the planned nodes move.
    `throughput_before/after` of the moves are the swarm's T (0 while a hole is left)."""
    count, blocks = placement.start.size, placement.num_blocks
    serving = np.ones(count, bool) if serving is None else np.asarray(serving, bool).copy()
    if serving.shape != (count,):
        raise ValueError("serving must hold one flag per node")
    start, movable = placement.start.copy(), placement.movable.copy()
    block = np.arange(blocks)
    moves: list[Move] = []
    while True:
        _, servers = served_throughput(blocks, start[serving], placement.length[serving], np.ones(serving.sum()))
        holes = servers == 0
        if not holes.any():
            break
        best: tuple | None = None
        for node in np.flatnonzero(movable):
            length = int(placement.length[node])
            inside = (block >= start[node]) & (block < start[node] + length)
            without = servers - (inside if serving[node] else 0)  # (blocks,) servers once the node has left
            windows = np.lib.stride_tricks.sliding_window_view(block, length)  # (starts, length)
            covered = holes[windows].sum(axis=1)
            # a block served before must keep a server: the ones the node leaves bare must lie inside the new window
            bare = np.flatnonzero((without == 0) & ~holes)
            starts = windows[:, 0]
            valid = (starts <= bare.min()) & (bare.max() < starts + length) if bare.size else np.ones(starts.size, bool)
            valid &= starts != start[node]  # staying is no move (a node draining with a hole's span is leaving)
            if not valid.any() or covered[valid].max() == 0:
                continue
            weakest, mean = without[windows].min(axis=1), without[windows].mean(axis=1)
            order = np.lexsort((np.arange(windows.shape[0]), mean, weakest, -covered, ~valid))
            target = int(order[0])
            redundancy = int(without[inside].min())
            key = (-int(covered[target]), -redundancy, int(node))
            if best is None or key < best[0]:
                best = (key, int(node), target)
        if best is None:
            break
        _, node, target = best
        moves.append(Move(node, _peer(placement, node), int(start[node]), target, 0.0, 0.0))
        start[node], serving[node], movable[node] = target, True, False
    if moves:  # the swarm's T after the plan (0 while a hole is left)
        served, _ = served_throughput(blocks, start[serving], placement.length[serving], placement.throughput[serving])
        after = swarm_throughput(served, placement.demand)
        moves = [replace(move, throughput_after=after) for move in moves]
    return tuple(moves)


def _peer(placement: Placement, node: int) -> str:
    return placement.peer_ids[node] if placement.peer_ids else str(node)


def cover_hole(snapshot: SwarmSnapshot, peer_id: str) -> Move | None:
    """For a daemon: the move `peer_id` should make to cover a coverage hole of `snapshot`, or None.

    Online nodes (not draining) serve their spans; draining nodes may be chosen to move but serve nothing (a node
    draining to move keeps being the one planned; one draining to leave is chosen at worst until its record says
    offline). Nodes of any announced throughput count (see `plan_hole_cover`)."""
    arrays = snapshot.arrays
    candidates = [
        index
        for index, node in enumerate(snapshot.nodes)
        if (node.online or node.draining) and node.end_block > node.start_block
    ]
    candidates.sort(key=lambda index: snapshot.nodes[index].peer_id)
    chosen = np.array(candidates, np.int64)
    placement = Placement(
        snapshot.num_blocks,
        arrays.start[chosen],
        arrays.end[chosen] - arrays.start[chosen],
        np.array([snapshot.nodes[index].inference_tps for index in candidates], np.float64),
        np.ones(chosen.size, bool),
        np.ones(snapshot.num_blocks),
        tuple(snapshot.nodes[index].peer_id for index in candidates),
    )
    for move in plan_hole_cover(placement, arrays.available[chosen]):
        if move.peer_id == peer_id:
            return move
    return None
