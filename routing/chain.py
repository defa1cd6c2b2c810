"""Chain selection: a sequence of nodes whose spans cover every block (eq. 1-2 of the Nesa paper).

`select_chain(snapshot, request)` is the one interface the client calls. The rule here is the simple one:
fewest hops, then lowest summed latency (measured rtt plus the node's per-token compute time), then peer ids
for a deterministic tie-break. It is a shortest path over block boundaries: a node serving [start, end) is an
edge start -> end.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from nesa_node.errors import NoRouteError

DEFAULT_RTT_MS = 5.0  # assumed for a peer the client has not measured (guess: loopback to LAN)


@dataclass(frozen=True)
class NodeView:
    """What routing needs to know of one node (built from its NodeInfo record)."""

    peer_id: str
    start_block: int
    end_block: int
    online: bool = True
    inference_tps: float = 0.0  # tokens/s, one token at a time
    cache_tokens_left: int = 0
    max_length: int = 0  # 0: unknown/unlimited
    rtt_ms: float | None = None  # measured by the client
    codecs: tuple[str, ...] = ("none",)  # hidden-state codecs the node accepts


@dataclass(frozen=True)
class SwarmSnapshot:
    num_blocks: int
    nodes: tuple[NodeView, ...]


@dataclass(frozen=True)
class ChainRequest:
    batch: int = 1
    max_length: int = 0  # tokens the session reserves; 0: a cacheless forward
    exclude: frozenset[str] = field(default_factory=frozenset)  # peer ids not to use
    start_block: int = 0  # the chain covers blocks [start_block, end_block): a sub-range replaces a lost span
    end_block: int | None = None  # None: the model's last block + 1


@dataclass(frozen=True)
class Hop:
    peer_id: str
    start_block: int
    end_block: int
    codecs: tuple[str, ...] = ("none",)  # hidden-state codecs the node accepts


@dataclass(frozen=True)
class Chain:
    hops: tuple[Hop, ...]

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(hop.peer_id for hop in self.hops)


def _usable(node: NodeView, request: ChainRequest) -> bool:
    if not node.online or node.peer_id in request.exclude:
        return False
    if request.max_length:
        if node.max_length and request.max_length > node.max_length:
            return False
        if node.cache_tokens_left < request.batch * request.max_length:
            return False
    return True


def _hop_latency_ms(node: NodeView) -> float:
    rtt = node.rtt_ms if node.rtt_ms is not None else DEFAULT_RTT_MS
    compute = 1000.0 / node.inference_tps if node.inference_tps > 0 else 0.0
    return rtt + compute


def _bounds(snapshot: SwarmSnapshot, request: ChainRequest) -> tuple[int, int]:
    end = snapshot.num_blocks if request.end_block is None else min(request.end_block, snapshot.num_blocks)
    return max(request.start_block, 0), end


def missing_blocks(snapshot: SwarmSnapshot, request: ChainRequest) -> list[int]:
    """Blocks of the request's range that no usable node serves."""
    first, end = _bounds(snapshot, request)
    covered = set()
    for node in snapshot.nodes:
        if _usable(node, request):
            covered.update(range(max(node.start_block, first), min(node.end_block, end)))
    return [block for block in range(first, end) if block not in covered]


def select_chain(snapshot: SwarmSnapshot, request: ChainRequest, *, rng=None) -> Chain:
    """The chain covering blocks [request.start_block, request.end_block) (default: every block) with fewest hops,
    then least latency.

    `rng` is accepted for interface compatibility with stochastic selectors and unused: the rule is
    deterministic. Raises NoRouteError naming the blocks no usable node serves.
    """
    first, end = _bounds(snapshot, request)
    if not first < end:
        raise NoRouteError(f"empty block range {first}:{end}")
    edges: dict[int, list[NodeView]] = {}
    for node in snapshot.nodes:
        if _usable(node, request) and first <= node.start_block < node.end_block <= end:
            edges.setdefault(node.start_block, []).append(node)
    # Dijkstra over block boundaries with lexicographic cost (hops, latency, peer ids)
    best: dict[int, tuple] = {first: (0, 0.0, ())}
    queue: list[tuple] = [(0, 0.0, (), first, ())]
    while queue:
        hops, latency, ids, position, path = heapq.heappop(queue)
        if position == end:
            return Chain(hops=path)
        if best.get(position, (hops, latency, ids)) < (hops, latency, ids):
            continue
        for node in edges.get(position, ()):
            cost = (hops + 1, latency + _hop_latency_ms(node), ids + (node.peer_id,))
            if cost < best.get(node.end_block, (float("inf"),)):
                best[node.end_block] = cost
                hop = Hop(node.peer_id, node.start_block, node.end_block, node.codecs)
                heapq.heappush(queue, (*cost, node.end_block, path + (hop,)))
    missing = missing_blocks(snapshot, request)
    if missing:
        raise NoRouteError(f"no online node with enough cache serves blocks {_ranges(missing)}")
    raise NoRouteError(f"the nodes' spans do not join into a chain from block {first} to block {end}")


def _ranges(blocks: list[int]) -> str:
    parts, start = [], None
    for index, block in enumerate(blocks):
        if start is None:
            start = block
        if index + 1 == len(blocks) or blocks[index + 1] != block + 1:
            parts.append(f"{start}" if start == block else f"{start}-{block}")
            start = None
    return ", ".join(parts)
