"""Routers to compare against, on the same snapshot (the same noisy measurements) as ours.

- `petals_router`: the min-latency route of petals (`RemoteSequenceManager` in "min_latency" mode): a shortest path
  where entering a server costs rtt / 2 (the client's or the previous server's ping), every block it runs costs
  1 / its announced throughput, and the way back costs rtt / 2. As in petals, a route may enter a server at any
  block it holds but then runs it to the end of its span ("we force to go to the end of it before switching to a
  new one"), the throughput is the one measured at start (no load), and links carry no bandwidth term.
- `compute_rtt_load_router`: a DP over (node, block boundary) with hop cost rtt(previous, node) + the node's
  compute time for its blocks scaled by (1 + load), a linear load compensator; parts of spans allowed, as ours.
- `random_router`: a random feasible chain: from the first block, a node drawn uniformly among the usable nodes
  holding the next block, run to the end of its span.

The first two run the exact search of search.py on their own per-node costs (both are separable, gamma = 1), so
they are exact for their cost functions. Pings are taken from the same network coordinates ours reads.
"""

from __future__ import annotations

import numpy as np

from nesa_node.errors import NoRouteError
from nesa_node.routing.chain import block_range, no_route_error, usable_nodes
from nesa_node.routing.cost import RequestTerms, client_latency_ms
from nesa_node.routing.search import PARTIAL_SPANS, PETALS_SPANS, Moves, NoPath, exact_chain
from nesa_node.routing.snapshot import Chain, ChainRequest, Hop, SwarmSnapshot


def _route(snapshot: SwarmSnapshot, request: ChainRequest, terms: RequestTerms, moves: Moves) -> Chain:
    first, end = block_range(snapshot, request)
    if not first < end:
        raise NoRouteError(f"empty block range {first}:{end}")
    try:
        found, _ = exact_chain(snapshot.arrays, terms, usable_nodes(snapshot, request, moves), first, end, moves)
    except NoPath:
        raise no_route_error(snapshot, request, first, end) from None
    nodes = snapshot.nodes
    return Chain(tuple(Hop(nodes[i].peer_id, start, stop, nodes[i].codecs) for i, start, stop in found))


def petals_router(snapshot: SwarmSnapshot, request: ChainRequest, rng: np.random.Generator | None = None) -> Chain:
    """Baseline (a): petals' min-latency route. Costs in ms: rtt / 2 per hand-over, 1000 / throughput per block."""
    return _route(snapshot, request, _petals_terms(snapshot, request), PETALS_SPANS)


def _petals_terms(snapshot: SwarmSnapshot, request: ChainRequest) -> RequestTerms:
    arrays = snapshot.arrays
    return RequestTerms(
        side_ms=arrays.access_ms,  # one-way latency = access + backbone + access = rtt / 2
        region=arrays.region,
        backbone=arrays.backbone,
        client_leg=client_latency_ms(arrays, request),
        block=arrays.block_ms,  # the throughput measured at start, whatever the load now
        reliability=np.zeros(arrays.start.size),
        gamma=1.0,
    )


def petals_cost_partial_spans_router(
    snapshot: SwarmSnapshot, request: ChainRequest, rng: np.random.Generator | None = None
) -> Chain:
    """Baseline (a'), for the bench only: petals' cost with parts of spans allowed as for ours, which separates
    what petals' cost misses from what its span rule costs."""
    return _route(snapshot, request, _petals_terms(snapshot, request), PARTIAL_SPANS)


def compute_rtt_load_router(
    snapshot: SwarmSnapshot, request: ChainRequest, rng: np.random.Generator | None = None
) -> Chain:
    """Baseline (b): hop cost rtt + compute time * (1 + load), ms; parts of spans allowed."""
    arrays = snapshot.arrays
    terms = RequestTerms(
        side_ms=2 * arrays.access_ms,  # rtt = 2 * one-way
        region=arrays.region,
        backbone=2 * arrays.backbone,
        client_leg=2 * client_latency_ms(snapshot.arrays, request),
        block=arrays.block_ms * (1.0 + arrays.load),
        reliability=np.zeros(arrays.start.size),
        gamma=1.0,
    )
    return _route(snapshot, request, terms, PARTIAL_SPANS)


def random_router(snapshot: SwarmSnapshot, request: ChainRequest, rng: np.random.Generator) -> Chain:
    """Baseline (c): a uniformly random usable node for the next block, run to the end of its span (or of the
    range). Raises NoRouteError when the random walk reaches a block no usable node holds."""
    first, end = block_range(snapshot, request)
    usable = usable_nodes(snapshot, request, PETALS_SPANS)
    arrays, nodes = snapshot.arrays, snapshot.nodes
    hops, block = [], first
    while block < end:
        holders = arrays.covering(block)
        holders = holders[usable[holders]]
        if holders.size == 0:
            raise no_route_error(snapshot, request, first, end)
        node = int(holders[rng.integers(holders.size)])
        stop = min(int(arrays.end[node]), end)
        hops.append(Hop(nodes[node].peer_id, block, stop, nodes[node].codecs))
        block = stop
    return Chain(tuple(hops))
