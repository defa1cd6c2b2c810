"""Searches over (node, block boundary) states for the chain of least eq. 18 cost (eq. 1-2).

A state (A, b) is "node A has just run block b - 1". Walking the boundaries in order, a node either goes on to the
next block (adds its load term) or hands the hidden state to a node B that covers block b (adds the transfer term
A -> B and B's reliability term). Who may enter or leave where is the `Moves` of the request: whole spans (live
nodes), any part of a span, or petals' rule (enter anywhere, leave at the span's end).

window = 0: `exact_chain`, a shortest path, exact. At each boundary the minimum over senders A of
value(A) + (side_A + backbone[region_A, region_B] + side_B)^gamma only needs, per sender region, the senders not
dominated in (value, side_A): a Pareto front, typically a handful of nodes. That makes one boundary cost
O(n log n + front * receivers) instead of O(senders * receivers).

window > 0: `beam_chain` keeps the `width` cheapest partial chains per boundary (distinct last window + 1 nodes),
since the transfer term then depends on more than the previous node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nesa_node.routing.cost import CLIENT, RequestTerms
from nesa_node.routing.snapshot import SnapshotArrays

PAD = -3  # no node: the chain is shorter than the window
DIRECT_PAIRS = 32768  # below this many (front sender, receiver) pairs the bounds cost more than they save (measured)


class NoPath(Exception):
    """No chain through the usable nodes joins the first boundary to the last."""


@dataclass(frozen=True)
class Moves:
    enter_anywhere: bool  # a node may take over at any block it holds, not only at its start
    exit_anywhere: bool  # a node may hand over before the end of its span


WHOLE_SPANS = Moves(False, False)
PARTIAL_SPANS = Moves(True, True)
PETALS_SPANS = Moves(True, False)  # petals: "we force to go to the end of [a server] before switching"


def _receivers(arrays: SnapshotArrays, usable: np.ndarray, block: int, moves: Moves) -> tuple[np.ndarray, np.ndarray]:
    """Usable nodes covering `block`, and the mask of those that may be entered there."""
    covering = arrays.covering(block)
    covering = covering[usable[covering]]
    enter = np.ones(covering.size, bool) if moves.enter_anywhere else arrays.start[covering] == block
    return covering, enter


def _handoff(
    values: np.ndarray,
    senders: np.ndarray,
    side: np.ndarray,
    region: np.ndarray,
    rows: np.ndarray,
    receiver_region: np.ndarray,
    side_range: np.ndarray,
    backbone: np.ndarray,
    gamma: float,
) -> tuple[np.ndarray, np.ndarray]:
    """For each receiver, min over senders of value + transfer term, and the arg-min sender (node index).

    `senders`, `values`, `side`, `region`: the senders and their value, side_ms and region. `rows`:
    (regions + 1, receivers), backbone[q, receiver's region] + receiver's side_ms for every region q. `side_range`:
    (regions + 1, 2), the least and greatest side_ms per region, for the bounds below.
    """
    # 1. Pareto front per sender region over (value, side): sort by region then value, keep strict running minima
    # of side (equal values in any order: a dominated sender kept by a tie costs time, never the answer)
    order = np.argsort(region * (values.max() - values.min() + 1.0) + values)
    side, region, values, senders = side[order], region[order], values[order], senders[order]
    shifted = side - region * (side.max() + 1.0)  # a new region starts below every earlier one: the min resets
    front = np.ones(order.size, bool)
    front[1:] = shifted[1:] < np.minimum.accumulate(shifted)[:-1]
    senders, side, region, values = senders[front], side[front], region[front], values[front]
    count = rows.shape[1]
    if senders.size * count <= DIRECT_PAIRS:
        cost = (rows[region] + side[:, None]) ** gamma + values[:, None]  # (front, receivers)
        chosen = cost.argmin(axis=0)
        return cost[chosen, np.arange(count)], senders[chosen]
    # 2. Drop (sender region, receiver region) pairs that cannot win. For receivers of region q with side s in
    # [s_lo, s_hi], region r costs at least lower(s) = min value_r + (min side_r + backbone[r, q] + s)^gamma, and one
    # front sender g costs exactly upper(s) = value_g + (side_g + backbone[g, q] + s)^gamma. lower - upper is
    # monotone in s (a difference of two shifted powers), so lower > upper at both ends rules r out for all of q.
    regions = side_range.shape[0]
    ends = side_range  # (regions, 2)
    upper = values[:, None, None] + (side[:, None, None] + backbone[region][:, :, None] + ends[None]) ** gamma
    best = upper.argmin(axis=0)  # (regions, 2): the front sender cheapest at each end, per receiver region
    columns = np.arange(regions)[:, None]
    first_of = np.flatnonzero(np.concatenate(([True], region[1:] != region[:-1])))  # least value per region
    last_of = np.concatenate((first_of[1:], [region.size])) - 1  # least side per region
    lower = (
        values[first_of][:, None, None]
        + (side[last_of][:, None, None] + backbone[region[first_of]][:, :, None] + ends[None]) ** gamma
    )  # (sender regions, receiver regions, 2)
    ruled_out = np.zeros(lower.shape[:2], bool)
    for pick in (0, 1):  # compare against the sender cheapest at the low end, then the one cheapest at the high end
        reference = upper[best[:, pick][:, None], columns, np.arange(2)[None]]  # (receiver regions, 2)
        ruled_out |= (lower > reference[None]).all(axis=2)
    # 3. Per receiver, the front senders of the regions not ruled out, padded to the same count
    allowed = ~ruled_out[np.searchsorted(first_of, np.arange(region.size), side="right") - 1]  # (front, regions)
    allowed_count = allowed.sum(axis=0)
    width = int(allowed_count.max())
    table = np.argsort(~allowed, axis=0, kind="stable")[:width]  # (width, regions): allowed senders first
    pick = table[:, receiver_region]  # (width, receivers) front positions
    cost = (rows[region[pick], np.arange(count)] + side[pick]) ** gamma + values[pick]
    cost[~(np.arange(width)[:, None] < allowed_count[receiver_region])] = np.inf
    chosen = cost.argmin(axis=0)
    columns = np.arange(count)
    return cost[chosen, columns], senders[pick[chosen, columns]]


def _side_range(terms: RequestTerms) -> np.ndarray:
    """(regions + 1, 2): least and greatest side_ms per region (regions without nodes: 0, 0)."""
    count = terms.backbone.shape[0]
    low, high = np.full(count, np.inf), np.full(count, -np.inf)
    np.minimum.at(low, terms.region, terms.side_ms)
    np.maximum.at(high, terms.region, terms.side_ms)
    empty = ~np.isfinite(low)
    low[empty], high[empty] = 0.0, 0.0
    return np.stack([low, high], axis=1)


def exact_chain(
    arrays: SnapshotArrays, terms: RequestTerms, usable: np.ndarray, first: int, end: int, moves: Moves
) -> tuple[list[tuple[int, int, int]], float]:
    """Least-cost chain over blocks [first, end) for window = 0: hops (node index, start, end) and its cost.

    Raises NoPath when the usable nodes do not join into a chain.
    """
    # the usable nodes holding each block, and their per-node terms, gathered once for all blocks
    lengths = np.diff(arrays.covering_ptr[first : end + 1])
    holders = arrays.covering_idx[arrays.covering_ptr[first] : arrays.covering_ptr[end]]
    block_of = np.repeat(np.arange(first, end), lengths)
    keep = usable[holders]
    holders, block_of = holders[keep], block_of[keep]
    bounds = np.searchsorted(block_of, np.arange(first, end + 1))
    side, region = terms.side_ms[holders], terms.region[holders]
    step = terms.reliability[holders]  # added on entering
    block_cost = terms.block[holders]
    enters = None if moves.enter_anywhere else arrays.start[holders] == block_of
    leaves = None if moves.exit_anywhere else arrays.end[holders] == block_of + 1  # may hand over after this block
    side_range = _side_range(terms)
    gamma, backbone = terms.gamma, terms.backbone
    values = np.full(usable.size, np.inf)  # value of each node after the previous block (inf: not active)
    history: list[np.ndarray] = []  # per block: predecessor of each holder (-1 went on, CLIENT, or a node index)
    previous = np.empty(0, np.int64)
    previous_value = np.empty(0)
    for position, block in enumerate(range(first, end)):
        low, high = bounds[position], bounds[position + 1]
        if low == high:
            raise NoPath(block)
        here = holders[low:high]
        going_on = values[here]
        entering = slice(None) if enters is None else np.flatnonzero(enters[low:high])
        handed = np.full(here.size, np.inf)
        source = np.full(here.size, -1)
        if position == 0:
            handed[entering], source[entering] = terms.client_leg[here[entering]], CLIENT
        else:
            senders = np.isfinite(previous_value)
            if leaves is not None:
                senders &= leaves[bounds[position - 1] : low]
            senders = np.flatnonzero(senders)
            receivers = np.arange(here.size)[entering]
            if senders.size and receivers.size:
                offset = bounds[position - 1]
                rows = backbone[:, region[low:high][receivers]] + side[low:high][receivers]
                handed[receivers], source[receivers] = _handoff(
                    previous_value[senders],
                    previous[senders],
                    side[offset + senders],
                    region[offset + senders],
                    rows,
                    region[low:high][receivers],
                    side_range,
                    backbone,
                    gamma,
                )
        handed += step[low:high]
        take = handed < going_on  # ties go on: a hand-over to oneself never beats going on
        best = np.where(take, handed, going_on) + block_cost[low:high]
        history.append(np.where(take, source, -1))
        values[previous] = np.inf
        values[here] = best
        previous, previous_value = here, best
        if not np.isfinite(best).any():
            raise NoPath(block)
    final = previous_value + terms.client_leg[previous]  # any active node may stop at `end`, the request's last block
    last = int(np.argmin(final))
    return _backtrack(history, holders, bounds, int(previous[last]), first, end), float(final[last])


def _backtrack(
    history: list[np.ndarray], holders: np.ndarray, bounds: np.ndarray, node: int, first: int, end: int
) -> list[tuple[int, int, int]]:
    hops, hop_end = [], end
    for block in range(end - 1, first - 1, -1):
        low, high = bounds[block - first], bounds[block - first + 1]
        came_from = int(history[block - first][np.searchsorted(holders[low:high], node)])
        if came_from == -1:
            continue
        hops.append((node, block, hop_end))
        node, hop_end = came_from, block
        if came_from == CLIENT:
            break
    return hops[::-1]


def beam_chain(
    arrays: SnapshotArrays,
    terms: RequestTerms,
    usable: np.ndarray,
    first: int,
    end: int,
    moves: Moves,
    *,
    window: int,
    width: int,
) -> tuple[list[tuple[int, int, int]], float]:
    """Beam search for window > 0: the cheapest chain found keeping `width` partial chains per boundary.

    A partial chain is its last window + 1 nodes (`members`, CLIENT and PAD included), its value, and its parent in
    the previous boundary's beam. Raises NoPath when no partial chain reaches `end`.
    """
    members = np.full((1, window + 1), PAD)
    members[0, -1] = CLIENT
    values = np.zeros(1)
    history: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per block: parent, node, entered here
    for block in range(first, end):
        covering, enter = _receivers(arrays, usable, block, moves)
        receivers = covering[enter]
        current = members[:, -1]
        # hand-overs: every beam entry to every receiver, transfer from each member inside the window
        transfer = np.zeros((members.shape[0], receivers.size))
        for column in range(window + 1):
            source = members[:, column]
            nodes = np.maximum(source, 0)
            term = terms.transfer(nodes[:, None], receivers[None, :])
            term = np.where((source == CLIENT)[:, None], terms.client_leg[receivers][None, :], term)
            transfer += np.where((source == PAD)[:, None], 0.0, term)
        may_leave = current == CLIENT
        if block > first:
            may_leave = may_leave | (moves.exit_anywhere | (arrays.end[np.maximum(current, 0)] == block))
        handed = values[:, None] + transfer + (terms.reliability + terms.block)[receivers][None, :]
        handed[~may_leave] = np.inf
        handed[current[:, None] == receivers[None, :]] = np.inf
        # going on: the current node runs this block too
        goes_on = (current >= 0) & (arrays.end[np.maximum(current, 0)] > block) & (block > first)
        going_on = np.where(goes_on, values + terms.block[np.maximum(current, 0)], np.inf)
        candidates = np.concatenate([going_on, handed.ravel()])
        keep = min(candidates.size, 4 * width)
        chosen = np.argpartition(candidates, keep - 1)[:keep] if keep < candidates.size else np.arange(keep)
        chosen = chosen[np.argsort(candidates[chosen], kind="stable")]
        chosen = chosen[np.isfinite(candidates[chosen])]
        if chosen.size == 0:
            raise NoPath(block)
        entered = chosen >= going_on.size
        parent = np.where(entered, (chosen - going_on.size) // max(receivers.size, 1), chosen)
        node = current[parent]
        node[entered] = receivers[(chosen[entered] - going_on.size) % max(receivers.size, 1)]
        new_members = members[parent].copy()
        new_members[entered] = np.concatenate([new_members[entered][:, 1:], node[entered][:, None]], axis=1)
        # partial chains with the same last window + 1 nodes have the same future: keep the cheapest of each
        _, distinct = np.unique(new_members, axis=0, return_index=True)
        distinct = np.sort(distinct)[:width]
        members, values = new_members[distinct], candidates[chosen][distinct]
        history.append((parent[distinct], node[distinct], entered[distinct]))
    final = values + terms.client_leg[members[:, -1]]
    best = int(np.argmin(final))
    hops, hop_end = [], end
    for block in range(end - 1, first - 1, -1):
        parent, node, entered = history[block - first]
        if entered[best]:
            hops.append((int(node[best]), block, hop_end))
            hop_end = block
        best = int(parent[best])
    return hops[::-1], float(final.min())
