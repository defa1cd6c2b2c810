"""Routing: chain selection over a frozen swarm snapshot, the eq. 18 cost, and its GA tuner.

Pure: may import numpy, networkx and nesa_node.errors only; no sockets, clocks, global RNG or hivemind.
"""

from nesa_node.routing.chain import Chain, ChainRequest, Hop, NodeView, SwarmSnapshot, select_chain

__all__ = ["Chain", "ChainRequest", "Hop", "NodeView", "SwarmSnapshot", "select_chain"]
