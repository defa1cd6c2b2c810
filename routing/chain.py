"""Chain selection: a sequence of nodes whose spans cover every block once, in order (eq. 1-2 of the Nesa paper).

`select_chain(snapshot, request)` is the one interface the client calls.

- With `params` (a `RoutingParams`), the chain of least eq. 18 cost (cost.py): exact for window = 0 (shortest
  path over (node, block boundary) states), a beam search for window > 0 (search.py). Should every partial chain
  the beam kept run into a dead end, the exact window-0 search picks the chain instead, so a chain is found
  whenever one exists.
- Without, the rule the live client has used so far: fewest hops, then least summed latency (measured rtt plus the
  node's per-token compute time), then peer ids. It is kept as the default because today's client builds snapshots
  without the loads, regions and bandwidths eq. 18 reads; a request with `partial_spans` always uses eq. 18.

By default a hop is a node's whole span inside the requested range; with `request.partial_spans` (what the live
client asks for: nodes run any contiguous part of their span) a hop may be any contiguous part of a span. Nodes offline, draining, excluded, without
cache room for batch * max_length tokens, or (for a request naming a LoRA adapter the client cannot send) without that
adapter are skipped. `request.alternatives` asks for that many node-disjoint
alternative chains as well (found one after another, each excluding the nodes of the chains before it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from nesa_node.errors import NoRouteError
from nesa_node.routing.batch import exact_chains
from nesa_node.routing.cost import RoutingParams, chain_cost, request_base
from nesa_node.routing.search import PARTIAL_SPANS, WHOLE_SPANS, Moves, NoPath, beam_chain, exact_chain
from nesa_node.routing.snapshot import (
    DEFAULT_RTT_MS,
    Chain,
    ChainRequest,
    CostBreakdown,
    Hop,
    NodeView,
    SwarmSnapshot,
)

__all__ = [
    "Chain",
    "ChainRequest",
    "CostBreakdown",
    "Hop",
    "NodeView",
    "RoutingParams",
    "SwarmSnapshot",
    "block_range",
    "missing_blocks",
    "no_route_error",
    "select_chain",
    "select_chains",
    "usable_nodes",
]


def _usable(node: NodeView, request: ChainRequest) -> bool:
    if not node.online or node.draining or node.peer_id in request.exclude:
        return False
    if request.adapter is not None and not _gets_adapter(node, request):
        return False
    if request.max_length:
        if node.max_length and request.max_length > node.max_length:
            return False
        if node.cache_tokens_left < request.batch * request.max_length:
            return False
    limit = node.max_step_tokens or request.unannounced_tokens
    return not (request.step_tokens and limit and limit < request.step_tokens)


def _gets_adapter(node: NodeView, request: ChainRequest) -> bool:
    """Whether the node holds the request's adapter or can get it (sent by the client, or fetched from peers)."""
    if request.adapter in node.adapters:
        return True
    if request.adapter_block_bytes <= 0:
        return False
    return request.adapter_reachable is None or node.peer_id in request.adapter_reachable


def usable_nodes(snapshot: SwarmSnapshot, request: ChainRequest, moves: Moves | None = None) -> np.ndarray:
    """Mask over snapshot.nodes of the nodes a chain for `request` may use (vectorised `_usable` plus the range:
    whole spans must lie inside it, parts of spans need only overlap it)."""
    arrays = snapshot.arrays
    first, end = block_range(snapshot, request)
    moves = moves or (PARTIAL_SPANS if request.partial_spans else WHOLE_SPANS)
    mask = arrays.available.copy()
    for peer_id in request.exclude:
        index = arrays.peer_index.get(peer_id)
        if index is not None:
            mask[index] = False
    if request.adapter is not None:
        mask &= np.fromiter((_gets_adapter(node, request) for node in snapshot.nodes), bool, len(snapshot.nodes))
    if request.max_length:
        mask &= (arrays.max_length == 0) | (request.max_length <= arrays.max_length)
        mask &= arrays.cache_tokens_left >= request.batch * request.max_length
    if request.step_tokens:
        limits = np.where(arrays.max_step_tokens == 0, request.unannounced_tokens, arrays.max_step_tokens)
        mask &= (limits == 0) | (limits >= request.step_tokens)
    if moves.enter_anywhere:
        mask &= (arrays.start < end) & (arrays.end > first)
    else:
        mask &= (arrays.start >= first) & (arrays.end <= end)
    return mask


def block_range(snapshot: SwarmSnapshot, request: ChainRequest) -> tuple[int, int]:
    """The blocks [first, end) the request's chain covers."""
    end = snapshot.num_blocks if request.end_block is None else min(request.end_block, snapshot.num_blocks)
    return max(request.start_block, 0), end


def missing_blocks(snapshot: SwarmSnapshot, request: ChainRequest) -> list[int]:
    """Blocks of the request's range that no usable node serves."""
    first, end = block_range(snapshot, request)
    covered = set()
    for node in snapshot.nodes:
        if _usable(node, request):
            covered.update(range(max(node.start_block, first), min(node.end_block, end)))
    return [block for block in range(first, end) if block not in covered]


def select_chain(
    snapshot: SwarmSnapshot,
    request: ChainRequest,
    *,
    params: RoutingParams | None = None,
    rng: np.random.Generator | None = None,
) -> Chain:
    """The chain covering blocks [request.start_block, request.end_block) (default: every block), with
    `request.alternatives` node-disjoint alternatives.

    `params`: eq. 18 exponents and search settings; None keeps the live rule (fewest hops, then latency) unless the
    request asks for partial spans. `rng` is accepted for stochastic selectors and unused: both rules are
    deterministic. Raises NoRouteError naming the blocks no usable node serves.
    """
    chain = _select_one(snapshot, request, params)
    alternatives: list[Chain] = []
    used = set(chain.peer_ids)
    for _ in range(max(request.alternatives, 0)):
        try:
            alternative = _select_one(snapshot, _without(request, used), params)
        except NoRouteError:
            break
        alternatives.append(alternative)
        used.update(alternative.peer_ids)
    return Chain(chain.hops, chain.cost, tuple(alternatives))


def _without(request: ChainRequest, peers: set[str]) -> ChainRequest:
    return replace(request, exclude=request.exclude | frozenset(peers), alternatives=0)


def _select_one(snapshot: SwarmSnapshot, request: ChainRequest, params: RoutingParams | None) -> Chain:
    first, end = block_range(snapshot, request)
    if not first < end:
        raise NoRouteError(f"empty block range {first}:{end}")
    if params is None and not request.partial_spans:
        return _fewest_hops(snapshot, request, first, end)
    params = params or RoutingParams()
    moves = PARTIAL_SPANS if request.partial_spans else WHOLE_SPANS
    terms = request_base(snapshot, request).terms(params)
    usable = usable_nodes(snapshot, request, moves)
    found = None
    try:
        if params.window > 0:
            found, _ = beam_chain(
                snapshot.arrays, terms, usable, first, end, moves, window=params.window, width=params.beam_width
            )
    except NoPath:
        pass  # every partial chain the beam kept ran into a dead end: the exact search finds one if any exists
    try:
        if found is None:
            found, _ = exact_chain(snapshot.arrays, terms, usable, first, end, moves)
    except NoPath:
        raise no_route_error(snapshot, request, first, end) from None
    nodes = snapshot.nodes
    hops = tuple(Hop(nodes[index].peer_id, start, stop, nodes[index].codecs) for index, start, stop in found)
    return Chain(hops, chain_cost(snapshot, request, params, hops, terms=terms))


def select_chains(
    snapshot: SwarmSnapshot, request: ChainRequest, params: Sequence[RoutingParams]
) -> list[Chain | NoRouteError]:
    """`select_chain(snapshot, request, params=p)` for every p, sharing the work (the GA evaluates a population
    this way). A parameter set with no chain gets its NoRouteError in place of a Chain; alternatives are not
    searched. Sets with window > 0 run one by one."""
    results: list[Chain | NoRouteError] = [NoRouteError("not searched")] * len(params)
    batched = [index for index, p in enumerate(params) if p.window == 0]
    for index in set(range(len(params))) - set(batched):
        try:
            results[index] = _select_one(snapshot, replace(request, alternatives=0), params[index])
        except NoRouteError as error:
            results[index] = error
    if not batched:
        return results
    first, end = block_range(snapshot, request)
    if not first < end:
        error = NoRouteError(f"empty block range {first}:{end}")
        return [error if index in batched else result for index, result in enumerate(results)]
    base = request_base(snapshot, request)
    terms = [base.terms(params[index]) for index in batched]
    moves = PARTIAL_SPANS if request.partial_spans else WHOLE_SPANS
    try:
        found = exact_chains(
            snapshot.arrays,
            base.side_ms,
            base.region,
            base.backbone,
            np.stack([t.client_leg for t in terms]),
            np.stack([t.block for t in terms]),
            np.stack([t.reliability for t in terms]),
            np.array([t.gamma for t in terms]),
            usable_nodes(snapshot, request, moves),
            first,
            end,
            moves,
        )
    except NoPath:
        error = no_route_error(snapshot, request, first, end)
        return [error if index in batched else result for index, result in enumerate(results)]
    nodes = snapshot.nodes
    for index, term, (hops_found, _) in zip(batched, terms, found, strict=True):
        hops = tuple(Hop(nodes[i].peer_id, start, stop, nodes[i].codecs) for i, start, stop in hops_found)
        results[index] = Chain(hops, chain_cost(snapshot, request, params[index], hops, terms=term))
    return results


def no_route_error(snapshot: SwarmSnapshot, request: ChainRequest, first: int, end: int) -> NoRouteError:
    """The error naming the blocks no usable node serves, or saying the spans do not join."""
    missing = missing_blocks(snapshot, request)
    if missing:
        return NoRouteError(f"no online node with enough cache serves blocks {_ranges(missing)}")
    return NoRouteError(f"the nodes' spans do not join into a chain from block {first} to block {end}")


def _hop_latency_ms(node: NodeView) -> float:
    rtt = node.rtt_ms if node.rtt_ms is not None else DEFAULT_RTT_MS
    compute = 1000.0 / node.inference_tps if node.inference_tps > 0 else 0.0
    return rtt + compute


def _fewest_hops(snapshot: SwarmSnapshot, request: ChainRequest, first: int, end: int) -> Chain:
    """The live rule: Dijkstra over block boundaries with lexicographic cost (hops, latency, peer ids)."""
    edges: dict[int, list[NodeView]] = {}
    for node in snapshot.nodes:
        if _usable(node, request) and first <= node.start_block < node.end_block <= end:
            edges.setdefault(node.start_block, []).append(node)
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
    raise no_route_error(snapshot, request, first, end)


def _ranges(blocks: list[int]) -> str:
    parts, start = [], None
    for index, block in enumerate(blocks):
        if start is None:
            start = block
        if index + 1 == len(blocks) or blocks[index + 1] != block + 1:
            parts.append(f"{start}" if start == block else f"{start}-{block}")
            start = None
    return ", ".join(parts)
