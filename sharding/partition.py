"""Max-Throughput Partitioning (MTPP) of an operation graph over a pipeline of nodes (Nesa sec. 2.5-2.6).

The graph G = (V, E) holds one vertex per operation with work(v) (seconds on a reference device), sizeparam(v)
and sizeout(v) (bytes). A partition slices a topological order pi into at most k contiguous segments; segment t
runs on node t of the pipeline. Its cost is eq. 10,

    f_t(S) = io(V \\ S, S) + sum_{v in S} work(v) / speed_t + overflow_t(S) + io(S, V \\ S),

with io (eq. 8) the bytes of distinct tensors crossing the segment's border over the node's bandwidth B_t, and
the partition's cost is its bottleneck max_t f_t(S_t) (eq. 11). Deviations from the paper, by intent:

- eq. 9 as printed adds bytes to seconds. Here overflow_t(S) = max(0, sizeparam(S) + peak(S) - M_t) / R_t: the
  bytes that do not fit the node's fast memory M_t, streamed at the node's stream bandwidth R_t (bytes/s).
- peak(S), the activation peak inside S, is taken as the largest working set of one operation of S (its inputs
  plus its output). The true peak depends on the schedule inside the node; this bound is monotone in S, which the
  exact pruning of `slice_order` needs, and is exact for a chain.
- Algorithm 1's `heuristic_adjustment` is the identity: both DPs below are exact for the given order.

A contiguous slice of a topological order always has an acyclic quotient graph (every edge goes forward in the
order, so forward between segments); `quotient_is_acyclic` checks it for any assignment. The search over orders
(BRKGA, sec. 2.6.1) lives in `sharding.brkga`.

Pure: numpy and networkx over frozen inputs; no clock, I/O or global RNG.

One module past 400 lines, on purpose: the cost of eq. 10, Algorithm 1's DP and the fast exact DP share the
segment cost and order helpers, and the property tests compare them side by side.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

# Relative slack of the exact pruning in `slice_order`: a segment is dropped only when its lower bound exceeds the
# upper bound by more than float rounding of a sum of ~1e4 terms (guess, generous).
_PRUNE_SLACK = 1e-9


def _frozen_array(values, name: str) -> np.ndarray:
    array = np.array(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{name} must be finite and non-negative")
    array.setflags(write=False)
    return array


@dataclass(frozen=True)
class OperationGraph:
    """A computation graph: operation i has `work[i]` seconds, `size_param[i]` and `size_out[i]` bytes; an edge
    (u, v) means v consumes u's output. Raises ValueError on a cycle, a bad index or mismatched lengths."""

    names: tuple[str, ...]
    work: np.ndarray  # (n,) seconds on the reference device
    size_param: np.ndarray  # (n,) bytes of parameters the operation reads
    size_out: np.ndarray  # (n,) bytes of the tensor the operation outputs
    edges: tuple[tuple[int, int], ...]  # (producer, consumer), deduplicated

    def __post_init__(self) -> None:
        n = len(self.names)
        object.__setattr__(self, "names", tuple(str(name) for name in self.names))
        for field in ("work", "size_param", "size_out"):
            array = _frozen_array(getattr(self, field), field)
            if array.shape != (n,):
                raise ValueError(f"{field} has {array.shape[0]} entries for {n} operations")
            object.__setattr__(self, field, array)
        edges = tuple(sorted({(int(u), int(v)) for u, v in self.edges}))
        for u, v in edges:
            if not (0 <= u < n and 0 <= v < n) or u == v:
                raise ValueError(f"edge ({u}, {v}) is not between two distinct operations of {n}")
        object.__setattr__(self, "edges", edges)
        if len(kahn_order(self)) != n:
            raise ValueError("the operation graph has a cycle")

    @property
    def size(self) -> int:
        return len(self.names)

    @functools.cached_property
    def predecessors(self) -> tuple[tuple[int, ...], ...]:
        lists: list[list[int]] = [[] for _ in range(self.size)]
        for u, v in self.edges:
            lists[v].append(u)
        return tuple(tuple(items) for items in lists)

    @functools.cached_property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        lists: list[list[int]] = [[] for _ in range(self.size)]
        for u, v in self.edges:
            lists[u].append(v)
        return tuple(tuple(items) for items in lists)

    @functools.cached_property
    def working_set(self) -> np.ndarray:
        """(n,) bytes live while operation v runs: its inputs plus its output (the per-operation peak)."""
        result = self.size_out.copy()
        for u, v in self.edges:
            result[v] += self.size_out[u]
        result.setflags(write=False)
        return result


@dataclass(frozen=True)
class NodeProfile:
    """What the cost model needs of one pipeline node."""

    speed: float = 1.0  # work(v) / speed seconds on this node; 1.0 = the device the work was profiled on
    bandwidth: float = 1.25e8  # B of eq. 8, bytes/s; default a 1 Gbit/s link (guess for a home swarm)
    fast_memory: float = math.inf  # M of eq. 9, bytes
    stream_bandwidth: float = 1.6e10  # bytes/s for parameters beyond M; default PCIe 4.0 x16 (guess)

    def __post_init__(self) -> None:
        for name in ("speed", "bandwidth", "stream_bandwidth"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        if not self.fast_memory >= 0:
            raise ValueError(f"fast_memory must be >= 0, got {self.fast_memory}")

    def cost(self, *, bytes_in, bytes_out, work, size_param, peak):
        """Eq. 10 in seconds from the raw sums (scalars or arrays of the same shape)."""
        overflow = np.maximum(0.0, size_param + peak - self.fast_memory) / self.stream_bandwidth
        return (bytes_in + bytes_out) / self.bandwidth + work / self.speed + overflow


@dataclass(frozen=True)
class Partition:
    """Segments `order[ends[t-1]:ends[t]]` (ends[-1] == n), segment t on node t, with its cost in seconds."""

    order: tuple[int, ...]
    ends: tuple[int, ...]
    costs: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        """max_t f_t(S_t), seconds: the pipeline's time per input (eq. 11)."""
        return max(self.costs)

    @property
    def segments(self) -> tuple[tuple[int, ...], ...]:
        starts = (0, *self.ends[:-1])
        return tuple(self.order[start:end] for start, end in zip(starts, self.ends, strict=True))

    def assignment(self) -> np.ndarray:
        """(n,) segment index of every operation."""
        result = np.empty(len(self.order), dtype=np.int64)
        for index, segment in enumerate(self.segments):
            result[list(segment)] = index
        return result


def kahn_order(graph: OperationGraph, keys: np.ndarray | None = None) -> tuple[int, ...]:
    """Kahn's topological order. Without keys, ready operations leave in first-in first-out order (ties by index);
    with keys (n,), the ready operation of smallest key goes next (the BRKGA decoder of sec. 2.6.1). Returns fewer
    than n operations when the graph has a cycle."""
    n = len(graph.names)
    indegree = [0] * n
    successors: list[list[int]] = [[] for _ in range(n)]
    for u, v in graph.edges:
        indegree[v] += 1
        successors[u].append(v)
    order: list[int] = []
    if keys is None:
        ready = deque(v for v in range(n) if indegree[v] == 0)
        while ready:
            u = ready.popleft()
            order.append(u)
            for v in successors[u]:
                indegree[v] -= 1
                if indegree[v] == 0:
                    ready.append(v)
        return tuple(order)
    keys = np.asarray(keys, dtype=np.float64)
    if keys.shape != (n,):
        raise ValueError(f"keys must have shape ({n},), got {keys.shape}")
    heap = [(keys[v], v) for v in range(n) if indegree[v] == 0]
    heapq.heapify(heap)
    while heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        for v in successors[u]:
            indegree[v] -= 1
            if indegree[v] == 0:
                heapq.heappush(heap, (keys[v], v))
    return tuple(order)


def validate_order(graph: OperationGraph, order: Sequence[int]) -> tuple[int, ...]:
    """`order` as a tuple if it is a topological order of `graph`; raises ValueError otherwise."""
    order = tuple(int(v) for v in order)
    if sorted(order) != list(range(graph.size)):
        raise ValueError("order is not a permutation of the operations")
    position = {v: index for index, v in enumerate(order)}
    if any(position[u] >= position[v] for u, v in graph.edges):
        raise ValueError("order is not topological")
    return order


def set_cost(graph: OperationGraph, members: Iterable[int], node: NodeProfile) -> float:
    """f(S) of eq. 10 for any set S of operations on `node`, seconds (the definition, used as an oracle)."""
    inside = set(members)
    bytes_in = sum(graph.size_out[u] for u in {u for u, v in graph.edges if v in inside and u not in inside})
    bytes_out = sum(graph.size_out[u] for u in {u for u, v in graph.edges if u in inside and v not in inside})
    ids = sorted(inside)
    return float(
        node.cost(
            bytes_in=bytes_in,
            bytes_out=bytes_out,
            work=graph.work[ids].sum(),
            size_param=graph.size_param[ids].sum(),
            peak=graph.working_set[ids].max(initial=0.0),
        )
    )


def partition_from_ends(
    graph: OperationGraph, order: Sequence[int], ends: Sequence[int], nodes: Sequence[NodeProfile]
) -> Partition:
    """The partition of `order` cut at `ends` (increasing, last == n), segment t costed on nodes[t]."""
    order = validate_order(graph, order)
    ends = tuple(int(end) for end in ends)
    if not ends or ends[-1] != len(order) or any(b <= a for a, b in zip((0, *ends), ends, strict=False)):
        raise ValueError(f"ends must increase strictly and end at {len(order)}, got {ends}")
    if len(ends) > len(nodes):
        raise ValueError(f"{len(ends)} segments for {len(nodes)} nodes")
    starts = (0, *ends[:-1])
    costs = tuple(
        set_cost(graph, order[start:end], node) for start, end, node in zip(starts, ends, nodes, strict=False)
    )
    return Partition(order=order, ends=ends, costs=costs)


def uniform_partition(
    graph: OperationGraph, order: Sequence[int], nodes: Sequence[NodeProfile], weights: np.ndarray
) -> Partition:
    """The baseline split: `order` cut into len(nodes) segments of about equal total `weights` (n,), for example
    ones (operation count) or `graph.size_param` (parameter bytes). Segments are never empty."""
    order = validate_order(graph, order)
    n, k = len(order), min(len(nodes), len(order))
    cumulative = np.cumsum(np.asarray(weights, dtype=np.float64)[list(order)])  # (n,)
    total = cumulative[-1] if n else 0.0
    ends = []
    for t in range(1, k):
        target = total * t / k
        end = int(np.searchsorted(cumulative, target, side="left")) + 1 if total > 0 else round(n * t / k)
        low = (ends[-1] if ends else 0) + 1
        ends.append(min(max(end, low), n - (k - t)))
    ends.append(n)
    return partition_from_ends(graph, order, ends, nodes)


def quotient_is_acyclic(graph: OperationGraph, assignment: Sequence[int]) -> bool:
    """Whether the quotient graph of `graph` under `assignment` (block index per operation) has no cycle."""
    quotient = nx.DiGraph()
    quotient.add_nodes_from(set(int(block) for block in assignment))
    quotient.add_edges_from(
        (int(assignment[u]), int(assignment[v])) for u, v in graph.edges if assignment[u] != assignment[v]
    )
    return nx.is_directed_acyclic_graph(quotient)


def _last_use(graph: OperationGraph, position: np.ndarray) -> np.ndarray:
    """(n,) by position p: the largest position consuming the output at p, or -1 without a consumer."""
    result = np.full(graph.size, -1, dtype=np.int64)
    for u, v in graph.edges:
        result[position[u]] = max(result[position[u]], position[v])
    return result


def _backtrack(choice: np.ndarray, best: np.ndarray, n: int) -> tuple[int, ...]:
    segments = int(np.argmin(best[1:, n])) + 1  # the fewest segments among the ties
    ends, end = [], n
    for t in range(segments, 0, -1):
        ends.append(end)
        end = int(choice[t, end])
    return tuple(reversed(ends))


def _order_arrays(graph: OperationGraph, order: Sequence[int], nodes: Sequence[NodeProfile]):
    """What both DPs read of an order: (checked order, ids by position, position of each id, last use by position,
    output bytes by position). Raises ValueError for an invalid order or no node."""
    order = validate_order(graph, order)
    if len(nodes) < 1:
        raise ValueError("need at least one node")
    ids = np.array(order, dtype=np.int64)
    position = np.empty(len(order), dtype=np.int64)
    position[ids] = np.arange(len(order))
    return order, ids, position, _last_use(graph, position), graph.size_out[ids]


def slice_order_reference(graph: OperationGraph, order: Sequence[int], nodes: Sequence[NodeProfile]) -> Partition:
    """Algorithm 1 as written: every segment cost precomputed (O(n^2) table), then the O(n^2 k) dynamic program
    best[t][j] = min_l max(best[t-1][l], f_t(order[l:j])) over at most k = len(nodes) segments. Exact for the
    order; memory n^2 floats, so for graphs of a few thousand operations at most."""
    order, ids, position, last, size_out = _order_arrays(graph, order, nodes)
    n, k = len(order), len(nodes)
    producers = [sorted(position[list(graph.predecessors[v])]) for v in order]
    consumers = [sorted(position[list(graph.successors[v])]) for v in order]
    bytes_in = np.zeros((n, n))  # [a, b]: segment order[a..b] inclusive
    bytes_out = np.zeros((n, n))
    peak = np.zeros((n, n))
    for a in range(n):
        delta_in, delta_out = np.zeros(n + 1), np.zeros(n + 1)
        for p in range(a, n):
            if last[p] > p:  # output leaves the segment until its last consumer joins it
                delta_out[p] += size_out[p]
                delta_out[last[p]] -= size_out[p]
            for u in producers[p]:
                if u < a and not any(a <= c < p for c in consumers[u]):
                    delta_in[p] += size_out[u]  # first consumer of an outside tensor inside [a, b]
        bytes_in[a, a:] = np.cumsum(delta_in[a:n])
        bytes_out[a, a:] = np.cumsum(delta_out[a:n])
        peak[a, a:] = np.maximum.accumulate(graph.working_set[ids[a:]])
    work_prefix = np.concatenate(([0.0], np.cumsum(graph.work[ids])))
    param_prefix = np.concatenate(([0.0], np.cumsum(graph.size_param[ids])))
    work = work_prefix[None, 1:] - work_prefix[:-1, None]  # (n, n), upper triangle meaningful
    size_param = param_prefix[None, 1:] - param_prefix[:-1, None]
    best = np.full((k + 1, n + 1), math.inf)
    best[0, 0] = 0.0
    choice = np.zeros((k + 1, n + 1), dtype=np.int64)
    for t in range(1, k + 1):
        table = nodes[t - 1].cost(
            bytes_in=bytes_in, bytes_out=bytes_out, work=work, size_param=size_param, peak=peak
        )  # (n, n) seconds of segment [a, b] on node t
        for j in range(1, n + 1):
            candidates = np.maximum(best[t - 1, :j], table[:j, j - 1])  # (j,) by segment start
            choice[t, j] = int(np.argmin(candidates))
            best[t, j] = candidates[choice[t, j]]
    return partition_from_ends(graph, order, _backtrack(choice, best, n), nodes)


def slice_order(
    graph: OperationGraph, order: Sequence[int], nodes: Sequence[NodeProfile], *, upper_bound: float | None = None
) -> Partition:
    """The same optimum as `slice_order_reference`, fast: the segment costs ending at j are kept as a column over
    start positions and updated per edge when j advances, and only starts whose segment can still beat a known
    feasible bottleneck U are considered. The pruning is exact: every term of eq. 10 is non-negative, so a segment
    whose work alone exceeds U on the fastest node is in no partition better than U. U is the better of the
    uniform-by-work split and `upper_bound` (for example the best bottleneck found so far, in BRKGA). With an
    `upper_bound` below this order's optimum the result is a valid partition no better than `upper_bound` but not
    necessarily optimal for the order; at or above it, the result is exact.

    Time O(m + n * w * k) with w the widest window, about n / k when the cost is dominated by work."""
    order, ids, position, last, size_out = _order_arrays(graph, order, nodes)
    n, k = len(order), len(nodes)
    working_set = graph.working_set[ids]
    work_prefix = np.concatenate(([0.0], np.cumsum(graph.work[ids])))  # (n + 1,)
    param_prefix = np.concatenate(([0.0], np.cumsum(graph.size_param[ids])))
    # For each consumer position p: (u, previous consumer of u before p, or u) of each producer u.
    incoming: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for v in order:
        for_u = sorted(position[list(graph.successors[v])])
        u, previous = int(position[v]), int(position[v])
        for c in for_u:
            incoming[c].append((u, previous))
            previous = c
    uniform = uniform_partition(graph, order, nodes, graph.work)
    bound = uniform.bottleneck
    if upper_bound is not None:
        bound = min(bound, upper_bound)
    bound = bound * (1 + _PRUNE_SLACK) + 1e-300
    fastest = max(node.speed for node in nodes)
    distinct = list(dict.fromkeys(nodes))
    row_of_node = np.array([distinct.index(node) for node in nodes])  # (k,)
    bytes_in, bytes_out, peak = np.zeros(n), np.zeros(n), np.zeros(n)  # by segment start, for the current end
    best = np.full((k + 1, n + 1), math.inf)
    best[0, 0] = 0.0
    choice = np.zeros((k + 1, n + 1), dtype=np.int64)
    low = 0
    for p in range(n):
        while (work_prefix[p + 1] - work_prefix[low]) / fastest > bound:
            low += 1  # monotone: a start too early for end p is too early for every later end
        window = slice(low, p + 1)
        if last[p] > p:
            bytes_out[window] += size_out[p]
        for u, previous in incoming[p]:
            if last[u] == p and u >= low:
                bytes_out[low : u + 1] -= size_out[u]  # u's last consumer joins segments that hold u
            if previous + 1 <= p:
                start = max(previous + 1, low)
                bytes_in[start : p + 1] += size_out[u]  # u first consumed inside segments starting after `previous`
        np.maximum(peak[window], working_set[p], out=peak[window])
        rows = np.stack(
            [
                node.cost(
                    bytes_in=bytes_in[window],
                    bytes_out=bytes_out[window],
                    work=work_prefix[p + 1] - work_prefix[low : p + 1],
                    size_param=param_prefix[p + 1] - param_prefix[low : p + 1],
                    peak=peak[window],
                )
                for node in distinct
            ]
        )  # (distinct nodes, window) seconds
        candidates = np.maximum(best[:k, window], rows[row_of_node])  # (k, window)
        picks = np.argmin(candidates, axis=1)  # (k,)
        best[1:, p + 1] = candidates[np.arange(k), picks]
        choice[1:, p + 1] = picks + low
    if not np.isfinite(best[1:, n]).any():
        return uniform  # `upper_bound` is below this order's optimum: every partition of it was pruned
    return partition_from_ends(graph, order, _backtrack(choice, best, n), nodes)
