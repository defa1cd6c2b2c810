"""From the nodes' DHT records to the frozen `SwarmSnapshot` routing reads (eq. 18's inputs, live).

- load C_A: the record's queue of waiting steps N read as an M/M/1 queue's mean occupancy, rho = N / (N + 1); a node
  that reports GPU utilisation counts the larger of the two.
- reliability R_A: reputation (0..1, announced) times the share of a warm-up the node has stayed up,
  uptime / (uptime + UPTIME_SCALE_S): a node that just (re)started has not yet shown it stays; times the factor a
  node measured far slower than it claims is given (routing/claims.py).
- speed: the claimed throughput, bounded by the other nodes' claims and replaced by the client's own measurement
  once it has one (routing/claims.py); uptime and bandwidth claims are bounded the same way.
- the client's own open sessions on a node count as load on it (each an M/M/1 customer, like a queued step), so a
  client's concurrent sessions spread over nodes of equal cost instead of piling onto the first.
- access_ms: last-mile latencies fitted (routing/coordinates.py) from the round trips the client measured to nodes
  and those the nodes publish as links; the client is one more endpoint of the fit.
- bandwidth_mbps: the largest bandwidth measured on any link of the node (a path's bandwidth is bounded by each
  end's access link, so the largest is the tightest lower bound at hand).
Nodes whose span reaches past the model's last block are dropped: the record schema cannot know the model's depth.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from nesa_node.protocol.records import LoadInfo, NodeInfo, NodeState
from nesa_node.routing.claims import Measured, SpeedClaim, capped_bandwidths, capped_uptimes, trusted_speeds
from nesa_node.routing.coordinates import fit_access_ms
from nesa_node.routing.snapshot import NodeView, SwarmSnapshot

logger = logging.getLogger(__name__)

UPTIME_SCALE_S = 600.0  # guess: a node up for 10 minutes has come through start-up (loading, first sessions)
CLIENT = "\x00client"  # the client's name in the latency fit (no peer id starts with a NUL)
ELEMENT_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}


def load_share(load: LoadInfo) -> float:
    """C_A in [0, 1): the share of the node's compute busy with other work (see the module docstring)."""
    queue = float(load.queue)
    return max(queue / (queue + 1.0), load.gpu_percent / 100.0)


def reliability(info: NodeInfo, uptime_s: float | None = None) -> float:
    """R_A in [0, 1] (eq. 18's reliability, sign fixed): rises with uptime (the record's, or as bounded by
    `uptime_s`) and reputation."""
    uptime = info.uptime_s if uptime_s is None else uptime_s
    return info.reputation * uptime / (uptime + UPTIME_SCALE_S)


def link_measurements(infos: Iterable[NodeInfo], client_rtt_ms: Mapping[str, float]) -> list[tuple[str, str, float]]:
    """Every round trip at hand, as (endpoint, endpoint, ms): the nodes' published links and the client's own."""
    infos = list(infos)
    recorded = {info.peer_id for info in infos}  # links to peers without a record tell routing nothing it uses
    measurements = [
        (info.peer_id, link.peer_id, link.rtt_ms) for info in infos for link in info.links if link.peer_id in recorded
    ]
    measurements += [(CLIENT, peer_id, rtt) for peer_id, rtt in client_rtt_ms.items()]
    return measurements


def build_snapshot(
    infos: Iterable[NodeInfo],
    num_blocks: int,
    *,
    client_rtt_ms: Mapping[str, float] | None = None,
    hidden_size: int = 0,
    measured: Mapping[str, Measured] | None = None,
    seen_s: Mapping[str, float] | None = None,
    own_sessions: Mapping[str, int] | None = None,
    distrust: Mapping[str, float] | None = None,
) -> SwarmSnapshot:
    """The routing snapshot of `infos` (one record per node) for a model of `num_blocks` blocks.

    `client_rtt_ms`: the client's own measured round trips by peer id. `hidden_size` sets D of eq. 18's transfer
    term (0: latency only). Element bytes follow the nodes' announced dtype (the most common one). `measured`: the
    client's own measurements of nodes' speed; `seen_s`: how long the client has seen each node; `own_sessions`:
    the client's open sessions per node (the module docstring says how each is used); `distrust`: factors in
    (0, 1] by peer id that multiply R_A (a node an audit caught cheating: client/audit.py).
    """
    client_rtt_ms = dict(client_rtt_ms or {})
    own_sessions = own_sessions or {}
    infos = [info for info in infos if _fits(info, num_blocks)]
    access = fit_access_ms(link_measurements(infos, client_rtt_ms))
    bandwidth: dict[str, float] = {}
    for info in infos:
        for link in info.links:
            if link.bandwidth_mbps:
                for peer_id in (info.peer_id, link.peer_id):
                    bandwidth[peer_id] = max(bandwidth.get(peer_id, 0.0), link.bandwidth_mbps)
    # the peers routing knows only: a record naming links to made-up peers would otherwise add entries to every
    # snapshot and pull the median its own claim is capped by
    recorded = {info.peer_id for info in infos}
    bandwidth = {peer_id: mbps for peer_id, mbps in bandwidth.items() if peer_id in recorded}
    bandwidth = capped_bandwidths(bandwidth)
    speeds = trusted_speeds(
        [SpeedClaim(info.peer_id, info.start_block, info.end_block, info.inference_tps) for info in infos],
        measured or {},
    )
    uptimes = {info.peer_id: info.uptime_s for info in infos}
    if seen_s is not None:  # a client's view: uptime claims are bounded by what it has seen
        uptimes = capped_uptimes(uptimes, seen_s)
    nodes = [
        NodeView(
            peer_id=info.peer_id,
            start_block=info.start_block,
            end_block=info.end_block,
            online=info.state == NodeState.online,
            draining=info.state == NodeState.draining,
            inference_tps=_tps(speeds[info.peer_id].block_ms, info.end_block - info.start_block),
            cache_tokens_left=info.cache_tokens_left,
            max_length=info.max_length,
            max_step_tokens=info.max_step_tokens,
            rtt_ms=client_rtt_ms.get(info.peer_id),
            codecs=info.codecs,
            access_ms=access.get(info.peer_id),
            bandwidth_mbps=bandwidth.get(info.peer_id),
            load=max(load_share(info.load), _share(own_sessions.get(info.peer_id, 0))),
            reliability=reliability(info, uptimes[info.peer_id])
            * speeds[info.peer_id].reliability_factor
            * (distrust or {}).get(info.peer_id, 1.0),
            adapters=frozenset(adapter.adapter_id for adapter in info.adapters),
            lat=info.location[0] if info.location is not None else None,
            lon=info.location[1] if info.location is not None else None,
        )
        for info in infos
    ]
    dtypes = [info.dtype for info in infos]
    dtype = max(sorted(set(dtypes)), key=dtypes.count) if dtypes else "float32"
    return SwarmSnapshot(
        num_blocks=num_blocks,
        nodes=tuple(sorted(nodes, key=lambda node: node.peer_id)),
        hidden_size=hidden_size,
        element_bytes=ELEMENT_BYTES.get(dtype, 2.0),
    )


def _tps(block_ms: float | None, blocks: int) -> float:
    """Tokens/s through `blocks` blocks at `block_ms` per block (0: unknown)."""
    return 1000.0 / (block_ms * blocks) if block_ms and blocks > 0 else 0.0


def _share(customers: int) -> float:
    """Busy share of a node with `customers` in its queue (M/M/1 mean occupancy, as load_share)."""
    return customers / (customers + 1.0)


def _fits(info: NodeInfo, num_blocks: int) -> bool:
    if info.end_block > num_blocks:
        logger.debug(
            "ignoring %s: blocks %d:%d outside the model's %d",
            info.peer_id,
            info.start_block,
            info.end_block,
            num_blocks,
        )
        return False
    return True


__all__ = ["UPTIME_SCALE_S", "build_snapshot", "link_measurements", "load_share", "reliability"]
