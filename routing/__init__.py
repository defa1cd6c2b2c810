"""Routing: chain selection over a frozen swarm snapshot, the eq. 18 cost, its GA tuner and a swarm simulator.

Pure: may import numpy, scipy, networkx and nesa_node.errors only; no sockets, clocks, global RNG or hivemind.
Functions that draw random numbers take an explicit numpy.random.Generator (or a seed).

Modules: snapshot (what routing sees), cost (eq. 18), search (exact and beam searches), chain (`select_chain`),
simulate / scenarios / baselines (a seeded internet swarm and the routers to compare), ga (sec. 3.2 tuner), bound
(the least latency any router could get in the simulator, what tuning is measured against),
coordinates (last-mile latencies fitted from measured round trips), measured (latency a live snapshot implies, for
tuning on a live swarm).
"""

from nesa_node.routing.chain import select_chain
from nesa_node.routing.cost import RoutingParams
from nesa_node.routing.snapshot import Chain, ChainRequest, CostBreakdown, Hop, NodeView, SwarmSnapshot

__all__ = [
    "Chain",
    "ChainRequest",
    "CostBreakdown",
    "Hop",
    "NodeView",
    "RoutingParams",
    "SwarmSnapshot",
    "select_chain",
]
