"""The exact search of search.py for many parameter sets at once (the GA's inner loop).

For one request on one snapshot, the usable nodes, the block boundaries and the per-node side times are the same
for every parameter set; only the exponents differ. Running the boundary loop once with values of shape
(parameter sets, nodes) pays numpy's per-call overhead once instead of once per set, which is most of the time on
a 1,000-node swarm. Same states and answers as `exact_chain`, up to
floating-point ties (x ** gamma is computed as exp(gamma * log x) here) (tests/unit/test_routing_search.py).
"""

from __future__ import annotations

import numpy as np

from nesa_node.routing.search import Moves, NoPath
from nesa_node.routing.snapshot import SnapshotArrays


def _log_times(rows: np.ndarray, side: np.ndarray, region: np.ndarray) -> np.ndarray:
    """log of the transfer times (receivers, senders): x ** gamma is computed as exp(gamma * log x), with the logs
    shared by all parameter sets."""
    with np.errstate(divide="ignore"):  # log 0 = -inf, and exp(-inf) = 0 = 0 ** gamma
        return np.log(rows.T[:, region] + side)


def _handoff_many(
    values: np.ndarray, side: np.ndarray, region: np.ndarray, rows: np.ndarray, gamma: np.ndarray
) -> np.ndarray:
    """`_handoff` of search.py, without the region bounds, for values (sets, senders) and gamma (sets,): the least
    cost per (set, receiver). `rows`: (regions + 1, receivers). Which sender gives it is found again only for the
    hops of the chosen chains (`_sender`): an arg-min over the front is most of the cost here otherwise."""
    spread = values.max(axis=1) - values.min(axis=1) + 1.0
    order = np.argsort(region[None] * spread[:, None] + values, axis=1)  # (sets, senders): by region, then value
    shifted = side[order] - region[order] * (side.max() + 1.0)
    front = np.ones(order.shape, bool)
    front[:, 1:] = shifted[:, 1:] < np.minimum.accumulate(shifted, axis=1)[:, :-1]
    rank = np.cumsum(front, axis=1) - 1  # each front member's place in its set's row
    width = int(rank[:, -1].max()) + 1
    rows_of, columns_of = np.nonzero(front)
    position = np.zeros((values.shape[0], width), np.int64)  # (sets, width) indices into the senders
    position[rows_of, rank[rows_of, columns_of]] = order[rows_of, columns_of]
    front_values = np.full(position.shape, np.inf)  # padding stays inf
    front_values[rows_of, rank[rows_of, columns_of]] = values[rows_of, order[rows_of, columns_of]]
    members, member_of = np.unique(position, return_inverse=True)  # the senders on some set's front
    logs = _log_times(rows, side[members], region[members]).T  # (members, receivers)
    cost = np.exp(logs[member_of.reshape(position.shape)] * gamma[:, None, None]) + front_values[:, :, None]
    return cost.min(axis=1)


def _sender(
    values: np.ndarray, side: np.ndarray, region: np.ndarray, rows: np.ndarray, gamma: float, receiver: int
) -> int:
    """The sender (position) giving one receiver its least cost: the same arithmetic as `_handoff_many` over all
    senders. Floating-point operations are monotone, so a dominated sender never costs less than its dominator,
    and the minimum found here is the one the search used."""
    logs = _log_times(rows[:, receiver : receiver + 1], side, region)[0]
    return int(np.argmin(np.exp(logs * gamma) + values))


def exact_chains(
    arrays: SnapshotArrays,
    side_ms: np.ndarray,
    region: np.ndarray,
    backbone: np.ndarray,
    client_leg: np.ndarray,
    block: np.ndarray,
    reliability: np.ndarray,
    gamma: np.ndarray,
    usable: np.ndarray,
    first: int,
    end: int,
    moves: Moves,
) -> list[tuple[list[tuple[int, int, int]], float]]:
    """`exact_chain` for parameter sets stacked on axis 0 of client_leg, block, reliability (sets, nodes) and
    gamma (sets,): per set, the hops (node index, start, end) and the cost. Raises NoPath as `exact_chain`."""
    sets = gamma.size
    lengths = np.diff(arrays.covering_ptr[first : end + 1])
    holders = arrays.covering_idx[arrays.covering_ptr[first] : arrays.covering_ptr[end]]
    block_of = np.repeat(np.arange(first, end), lengths)
    keep = usable[holders]
    holders, block_of = holders[keep], block_of[keep]
    bounds = np.searchsorted(block_of, np.arange(first, end + 1)).tolist()
    side, home = side_ms[holders], region[holders]
    step, block_cost = reliability[:, holders], block[:, holders]
    enters = None if moves.enter_anywhere else arrays.start[holders] == block_of
    leaves = None if moves.exit_anywhere else arrays.end[holders] == block_of + 1
    values = np.full((sets, usable.size), np.inf)
    # per block: which holders each set entered there, and the senders (positions, values) they could come from
    history: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    previous = np.empty(0, np.int64)
    previous_value = np.empty((sets, 0))
    for position, block_index in enumerate(range(first, end)):
        low, high = bounds[position], bounds[position + 1]
        if low == high:
            raise NoPath(block_index)
        here = holders[low:high]
        going_on = values[:, here]
        receivers = np.arange(here.size) if enters is None else np.flatnonzero(enters[low:high])
        handed = np.full((sets, here.size), np.inf)
        senders = np.empty(0, np.int64)
        if position == 0:
            handed[:, receivers] = client_leg[:, here[receivers]]
        else:
            offset = bounds[position - 1]
            usable_senders = np.isfinite(previous_value[0])  # reachability does not depend on the parameters
            if leaves is not None:
                usable_senders &= leaves[offset:low]
            senders = offset + np.flatnonzero(usable_senders)  # positions in holders
            if senders.size and receivers.size:
                rows = backbone[:, home[low:high][receivers]] + side[low:high][receivers]
                handed[:, receivers] = _handoff_many(
                    previous_value[:, senders - offset], side[senders], home[senders], rows, gamma
                )
        handed += step[:, low:high]
        take = handed < going_on
        best = np.where(take, handed, going_on) + block_cost[:, low:high]
        history.append((take, senders, previous_value[:, senders - bounds[max(position - 1, 0)]]))
        values[:, previous] = np.inf
        values[:, here] = best
        previous, previous_value = here, best
        if not np.isfinite(best[0]).any():
            raise NoPath(block_index)
    final = previous_value + client_leg[:, previous]
    last = final.argmin(axis=1)
    results = []
    for index in range(sets):
        hops, node, hop_end = [], int(previous[last[index]]), end
        for block_index in range(end - 1, first - 1, -1):
            position = block_index - first
            low, high = bounds[position], bounds[position + 1]
            at = low + int(np.searchsorted(holders[low:high], node))
            take, senders, sender_values = history[position]
            if not take[index, at - low]:
                continue
            hops.append((node, block_index, hop_end))
            if position == 0:
                break
            rows = backbone[:, home[at : at + 1]] + side[at : at + 1]
            chosen = _sender(sender_values[index], side[senders], home[senders], rows, gamma[index], 0)
            node, hop_end = int(holders[senders[chosen]]), block_index
        results.append((hops[::-1], float(final[index, last[index]])))
    return results
