"""Tuning on a live swarm's snapshot: request latency as the snapshot's own measurements imply it.

A live swarm has no hidden truth to score chains against, only what its records and links say. The latency of a
chain for a request of P prompt tokens and G new tokens is modelled from the same per-node times eq. 18 reads
(cost.request_base, before any exponent):

    latency = (1 + G) * (client leg in + sum of node-to-node legs + client leg out)
              + (P + G) * batch * sum over hops of blocks * compute ms per block per token at the node's load

(one prefill pass and G one-token passes; the transfer legs use the request's mean tokens per pass, as the cost
does). The GA (ga.evolve) then picks the exponents whose chains minimise this over seeded synthetic requests.
`nesa-node tune --from-swarm` runs it; a scenario (simulate.py) remains the better judge where one fits the swarm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from nesa_node.errors import NoRouteError
from nesa_node.routing.chain import select_chains
from nesa_node.routing.cost import RoutingParams, request_base
from nesa_node.routing.snapshot import Chain, ChainRequest, SwarmSnapshot

PROMPT_TOKENS = (16, 512)  # range of synthetic prompt lengths (guess: chat turns to long documents)
NEW_TOKENS = (16, 256)  # range of synthetic generation lengths (guess)


def measured_latency_s(snapshot: SwarmSnapshot, request: ChainRequest, chain: Chain) -> float:
    """Modelled latency of `request` on `chain`, seconds, from the snapshot's measurements (module docstring).
    Raises KeyError for a hop whose peer is not in the snapshot."""
    base = request_base(snapshot, request)
    index = snapshot.arrays.peer_index
    nodes = [index[hop.peer_id] for hop in chain.hops]
    if not nodes:
        return 0.0
    transfer = float(base.client_ms[nodes[0]] + base.client_ms[nodes[-1]])
    for previous, node in zip(nodes, nodes[1:], strict=False):
        transfer += float(
            base.side_ms[previous] + base.backbone[base.region[previous], base.region[node]] + base.side_ms[node]
        )
    compute = sum(
        (hop.end_block - hop.start_block) * float(base.block_ms[node])
        for hop, node in zip(chain.hops, nodes, strict=True)
    )
    tokens = max(request.prompt_tokens, 1) + max(request.new_tokens, 0)
    return ((1 + max(request.new_tokens, 0)) * transfer + tokens * max(request.batch, 1) * compute) / 1000.0


def synthetic_requests(count: int, rng: np.random.Generator, *, partial_spans: bool = True) -> list[ChainRequest]:
    """`count` requests of random prompt and generation lengths (uniform in PROMPT_TOKENS, NEW_TOKENS)."""
    prompts = rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, count)
    news = rng.integers(NEW_TOKENS[0], NEW_TOKENS[1] + 1, count)
    return [
        ChainRequest(prompt_tokens=int(prompt), new_tokens=int(new), partial_spans=partial_spans)
        for prompt, new in zip(prompts, news, strict=True)
    ]


def snapshot_fitness(
    snapshot: SwarmSnapshot, requests: Sequence[ChainRequest]
) -> Callable[[list[RoutingParams]], np.ndarray]:
    """For ga.evolve: parameter sets -> mean measured latency (s) of `requests` on `snapshot` (inf where a request
    found no chain)."""

    def latency(population: list[RoutingParams]) -> np.ndarray:
        total = np.zeros(len(population))
        for request in requests:
            for position, chain in enumerate(select_chains(snapshot, request, population)):
                failed = isinstance(chain, NoRouteError)
                total[position] += math.inf if failed else measured_latency_s(snapshot, request, chain)
        return total / max(len(requests), 1)

    return latency


__all__ = ["measured_latency_s", "snapshot_fitness", "synthetic_requests"]
