"""From the nodes' DHT records to the frozen `SwarmSnapshot` routing reads (eq. 18's inputs, live).

- load C_A: the record's queue of waiting steps N read as an M/M/1 queue's mean occupancy, rho = N / (N + 1); a node
  that reports GPU utilisation counts the larger of the two.
- reliability R_A: reputation (0..1, announced) times the share of a warm-up the node has stayed up,
  uptime / (uptime + UPTIME_SCALE_S): a node that just (re)started has not yet shown it stays.
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


def reliability(info: NodeInfo) -> float:
    """R_A in [0, 1] (eq. 18's reliability, sign fixed): rises with uptime and reputation."""
    return info.reputation * info.uptime_s / (info.uptime_s + UPTIME_SCALE_S)


def link_measurements(infos: Iterable[NodeInfo], client_rtt_ms: Mapping[str, float]) -> list[tuple[str, str, float]]:
    """Every round trip at hand, as (endpoint, endpoint, ms): the nodes' published links and the client's own."""
    measurements = [(info.peer_id, link.peer_id, link.rtt_ms) for info in infos for link in info.links]
    measurements += [(CLIENT, peer_id, rtt) for peer_id, rtt in client_rtt_ms.items()]
    return measurements


def build_snapshot(
    infos: Iterable[NodeInfo],
    num_blocks: int,
    *,
    client_rtt_ms: Mapping[str, float] | None = None,
    hidden_size: int = 0,
) -> SwarmSnapshot:
    """The routing snapshot of `infos` (one record per node) for a model of `num_blocks` blocks.

    `client_rtt_ms`: the client's own measured round trips by peer id. `hidden_size` sets D of eq. 18's transfer
    term (0: latency only). Element bytes follow the nodes' announced dtype (the most common one).
    """
    client_rtt_ms = dict(client_rtt_ms or {})
    infos = [info for info in infos if _fits(info, num_blocks)]
    access = fit_access_ms(link_measurements(infos, client_rtt_ms))
    bandwidth: dict[str, float] = {}
    for info in infos:
        for link in info.links:
            if link.bandwidth_mbps:
                for peer_id in (info.peer_id, link.peer_id):
                    bandwidth[peer_id] = max(bandwidth.get(peer_id, 0.0), link.bandwidth_mbps)
    nodes = [
        NodeView(
            peer_id=info.peer_id,
            start_block=info.start_block,
            end_block=info.end_block,
            online=info.state == NodeState.online,
            draining=info.state == NodeState.draining,
            inference_tps=info.inference_tps,
            cache_tokens_left=info.cache_tokens_left,
            max_length=info.max_length,
            rtt_ms=client_rtt_ms.get(info.peer_id),
            codecs=info.codecs,
            access_ms=access.get(info.peer_id),
            bandwidth_mbps=bandwidth.get(info.peer_id),
            load=load_share(info.load),
            reliability=reliability(info),
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
