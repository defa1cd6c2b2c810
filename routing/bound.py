"""The perfect-information bound: per simulated request, the chain of least true latency.

A router reads a noisy, up to a minute old snapshot through the eq. 18 model of it; this one reads the simulator's
truth instead: every node's true position, last mile, bandwidth, load at the request's arrival, and its prefill and
decode times, and only nodes online at that moment. Per request it finds, by an exact search over (node, block
boundary) states with the full node-to-node matrix (no regions, no exponents), the chain whose latency as
`Simulator.latency_s` computes it is least, leaving out the per-request jitter (not knowable in advance) and
failovers (it uses only online nodes, which rarely leave within a request).

No router, whatever its parameters, can do better on average than this chain, up to the jitter. How far the
untuned router is above it bounds what tuning eq. 18 could gain (bench/routing.py reports both, README "Routing").
Slow (a dense sender x receiver matrix per block): for the bench and diagnostics, not for clients.
"""

from __future__ import annotations

import numpy as np

from nesa_node.routing.chain import select_chain, usable_nodes
from nesa_node.routing.cost import RoutingParams, bytes_per_element
from nesa_node.routing.search import PARTIAL_SPANS
from nesa_node.routing.simulate import (
    CODEC,
    FIBRE_KM_PER_MS,
    ROUTE_INFLATION,
    SimRequest,
    Simulator,
    great_circle_km,
)
from nesa_node.routing.snapshot import Chain, Hop

CONTINUED = -1  # back pointer: the node ran the previous block too
FROM_CLIENT = -2  # back pointer: the node took the hidden state from the client


def best_chain(simulator: Simulator, request: SimRequest) -> Chain:
    """The chain of least true latency for `request` among the nodes listed in its snapshot that are online at its
    arrival and have cache room (parts of spans allowed, as the router's). Raises ValueError if none joins."""
    snapshot = simulator.snapshot(request.time_s)
    ids = np.array([int(node.peer_id[4:]) for node in snapshot.nodes])  # "node000123" -> 123
    usable = (
        usable_nodes(snapshot, simulator.chain_request(request), PARTIAL_SPANS) & simulator.online(request.time_s)[ids]
    )
    prompt, new = request.prompt_tokens, request.new_tokens
    slowdown = 1.0 / (1.0 - simulator.load_at(request.time_s)[ids])
    decode = simulator.decode_ms[ids]
    compute_ms = (np.maximum(decode, prompt * simulator.prefill_ms_per_token[ids]) + new * decode) * slowdown
    # places: the snapshot's nodes, then the client (index n)
    lat = np.r_[simulator.lat[ids], request.client_lat]
    lon = np.r_[simulator.lon[ids], request.client_lon]
    access = np.r_[simulator.access_ms[ids], request.client_access_ms]
    bandwidth = np.r_[simulator.bandwidth_mbps[ids], request.client_bandwidth_mbps]
    client = ids.size
    megabits = simulator.scenario.model.hidden_size * bytes_per_element(CODEC, 2.0) * 8 / 1e6

    def link_ms(senders: np.ndarray, receivers: np.ndarray) -> np.ndarray:
        """All passes' time on the links senders -> receivers (broadcast): (1 + G) latencies, P + G tokens."""
        latency = great_circle_km(lat[senders], lon[senders], lat[receivers], lon[receivers])
        latency = latency / FIBRE_KM_PER_MS * ROUTE_INFLATION + access[senders] + access[receivers]
        serial = megabits / np.minimum(bandwidth[senders], bandwidth[receivers]) * 1000.0
        return (1 + new) * latency + (prompt + new) * serial

    starts = np.array([node.start_block for node in snapshot.nodes])
    ends = np.array([node.end_block for node in snapshot.nodes])
    back: list[tuple[np.ndarray, np.ndarray]] = []
    previous, previous_value = np.empty(0, np.int64), np.empty(0)
    for block in range(snapshot.num_blocks):
        holders = np.flatnonzero(usable & (starts <= block) & (ends > block))
        if holders.size == 0:
            raise ValueError(f"no online usable node holds block {block}")
        if block == 0:
            value, source = link_ms(np.full(holders.size, client), holders), np.full(holders.size, FROM_CLIENT)
        else:
            going_on = np.full(holders.size, np.inf)
            at = np.searchsorted(previous, holders).clip(max=previous.size - 1)  # previous: sorted, never empty here
            same = previous[at] == holders
            going_on[same] = previous_value[at[same]]
            handed = link_ms(previous[:, None], holders[None, :]) + previous_value[:, None]  # (senders, receivers)
            sender = handed.argmin(axis=0)
            handed = handed[sender, np.arange(holders.size)]
            take = handed < going_on
            value = np.where(take, handed, going_on)
            source = np.where(take, previous[sender], CONTINUED)
        back.append((holders, source))
        previous, previous_value = holders, value + compute_ms[holders]
    total = previous_value + link_ms(previous, np.full(previous.size, client))
    node, hop_end, hops = int(previous[total.argmin()]), snapshot.num_blocks, []
    for block in range(snapshot.num_blocks - 1, -1, -1):
        holders, source = back[block]
        came_from = int(source[np.searchsorted(holders, node)])
        if came_from != CONTINUED:
            hops.append(Hop(snapshot.nodes[node].peer_id, block, hop_end, snapshot.nodes[node].codecs))
            node, hop_end = came_from, block
    return Chain(tuple(reversed(hops)))


def bound_latency_s(simulator: Simulator, requests: tuple[SimRequest, ...]) -> np.ndarray:
    """True latency (s) of each request on its `best_chain`."""
    return np.array([simulator.latency_s(best_chain(simulator, request), request) for request in requests])


def untuned_latency_s(simulator: Simulator, requests: tuple[SimRequest, ...]) -> np.ndarray:
    """True latency (s) of each request on the chain the untuned router (exponents 1) picks from its snapshot."""
    return simulator.evaluate(
        lambda snapshot, request, rng: select_chain(snapshot, request, params=RoutingParams()), requests
    )
