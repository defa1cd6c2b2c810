"""What routing sees and returns: frozen node views, the swarm snapshot, the request, and the chain.

`SwarmSnapshot.arrays` turns the node views into numpy columns once per snapshot (the snapshot is frozen, so the
columns never go stale); every router and the cost function read the columns, so one snapshot serves many requests
at the price of one conversion.

Network coordinates. No swarm measures all n^2 links, so the one-way latency between two nodes is estimated as
`access_ms[a] + region_latency_ms[region[a]][region[b]] + access_ms[b]`: each node's last mile to its region's
backbone plus the measured latency between the two regions (landmark-style coordinates, as IDMaps/GNP). A node
with no region falls back to the path through the client: half its client-measured rtt as its last mile and no
backbone term. The client's own rtt to a node, when measured, replaces the estimate on the client legs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

DEFAULT_RTT_MS = 5.0  # assumed for a peer the client has not measured (guess: loopback to LAN)
DEFAULT_ACCESS_MS = 5.0  # last mile of a node with a region but no measured access latency (guess: home fibre/cable)
DEFAULT_BANDWIDTH_MBPS = 100.0  # access bandwidth of a node that announced none (guess: a typical home uplink)


@dataclass(frozen=True)
class NodeView:
    """What routing needs to know of one node (built from its NodeInfo record)."""

    peer_id: str
    start_block: int
    end_block: int
    online: bool = True
    inference_tps: float = 0.0  # tokens/s through the node's whole span, one token at a time
    cache_tokens_left: int = 0
    max_length: int = 0  # 0: unknown/unlimited
    max_step_tokens: int = 0  # rows x tokens of the largest step the node takes; 0: not announced (unannounced_tokens)
    rtt_ms: float | None = None  # measured by the client
    codecs: tuple[str, ...] = ("none",)  # hidden-state codecs the node accepts
    draining: bool = False  # finishing its sessions, takes no new ones
    region: int = -1  # index into SwarmSnapshot.region_latency_ms; -1: unknown
    access_ms: float | None = None  # one-way latency from the node to its region's backbone, ms
    bandwidth_mbps: float | None = None  # access-link bandwidth, Mbit/s
    load: float = 0.0  # C_A of eq. 18: share of the node's compute busy with other work, 0..1
    reliability: float = 1.0  # R_A of eq. 18 (sign fixed): 0..1, rises with uptime and reputation
    lat: float | None = None  # announced location, degrees north; None: not announced (topology embeds by latency)
    lon: float | None = None  # announced location, degrees east
    adapters: frozenset[str] = frozenset()  # ids of the LoRA adapters the node holds for its blocks


@dataclass(frozen=True)
class SwarmSnapshot:
    num_blocks: int
    nodes: tuple[NodeView, ...]
    hidden_size: int = 0  # elements per token of a hidden state; 0: unknown, the transfer term is latency only
    element_bytes: float = 2.0  # bytes per element sent with codec "none" (fp16/bf16, the usual serving dtype)
    region_latency_ms: tuple[tuple[float, ...], ...] = ()  # one-way backbone latency between regions, ms

    @functools.cached_property
    def arrays(self) -> SnapshotArrays:
        """Columns of the node views (computed once; the snapshot is immutable)."""
        return SnapshotArrays.build(self)


@dataclass(frozen=True)
class ChainRequest:
    batch: int = 1
    max_length: int = 0  # tokens the session reserves; 0: a cacheless forward
    # rows x tokens of a step every node of the chain must take (a prompt's part under way, say); 0: any
    step_tokens: int = 0
    # what a node announcing no step limit is taken to take (the client's floor: it is held to that); 0: anything
    unannounced_tokens: int = 0
    exclude: frozenset[str] = field(default_factory=frozenset)  # peer ids not to use
    start_block: int = 0  # the chain covers blocks [start_block, end_block): a sub-range replaces a lost span
    end_block: int | None = None  # None: the model's last block + 1
    # Live nodes run only their whole span; True lets a chain use any contiguous part of a node's span.
    partial_spans: bool = False
    prompt_tokens: int = 0  # P: tokens of the prefill pass (0: unknown, the transfer term assumes decode steps)
    new_tokens: int = 0  # G: one-token passes after the prefill
    codec: str = "blockwise8"  # hidden-state codec the client asks for (sets D of eq. 18)
    client_region: int = -1  # the client's network-coordinate region; -1: unknown
    client_access_ms: float = DEFAULT_ACCESS_MS  # the client's last mile, ms
    client_bandwidth_mbps: float | None = None  # None: the client's link is not counted
    alternatives: int = 0  # how many node-disjoint alternative chains to return as well (failover, redundancy)
    adapter: str | None = None  # the LoRA adapter id the session runs with; None: the base model
    # bytes per block of that adapter when the client can send it to a node lacking it (0: it cannot: every hop must
    # hold the adapter); sending is costed once per session (routing/cost.py)
    adapter_block_bytes: float = 0.0
    # with adapter_block_bytes > 0: the peers that lack the adapter but can get it (the holders' spans cover theirs);
    # None: every node (the client sends it)
    adapter_reachable: frozenset[str] | None = None


@dataclass(frozen=True)
class Hop:
    peer_id: str
    start_block: int
    end_block: int
    codecs: tuple[str, ...] = ("none",)  # hidden-state codecs the node accepts


@dataclass(frozen=True)
class CostBreakdown:
    """The three terms of eq. 18 summed over a chain (see nesa_node.routing.cost), in ms raised to their exponents."""

    transfer: float = 0.0
    load: float = 0.0
    reliability: float = 0.0

    @property
    def total(self) -> float:
        return self.transfer + self.load + self.reliability

    def __add__(self, other: CostBreakdown) -> CostBreakdown:
        return CostBreakdown(
            self.transfer + other.transfer, self.load + other.load, self.reliability + other.reliability
        )


@dataclass(frozen=True)
class Chain:
    hops: tuple[Hop, ...]
    cost: CostBreakdown | None = None  # None for chains the legacy rule picked or a session built
    alternatives: tuple[Chain, ...] = ()  # node-disjoint from this chain and from each other, best first

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(hop.peer_id for hop in self.hops)


@dataclass(frozen=True, eq=False)
class SnapshotArrays:
    """Per-node columns (index = position in snapshot.nodes) and the blocks -> covering nodes index."""

    peer_index: dict[str, int]
    start: np.ndarray  # (n,) int64
    end: np.ndarray  # (n,) int64
    available: np.ndarray  # (n,) bool: online and not draining
    cache_tokens_left: np.ndarray  # (n,) int64
    max_length: np.ndarray  # (n,) int64
    max_step_tokens: np.ndarray  # (n,) int64
    client_rtt_ms: np.ndarray  # (n,) float64, nan where unmeasured
    region: np.ndarray  # (n,) int64; unknown regions map to the last row/column of `backbone`
    backbone: np.ndarray  # (regions + 1, regions + 1) one-way ms; the extra row/column (unknown) is zero
    access_ms: np.ndarray  # (n,) one-way ms
    bandwidth_mbps: np.ndarray  # (n,)
    block_ms: np.ndarray  # (n,) compute ms per block per token when idle (0: throughput unknown)
    load: np.ndarray  # (n,) clipped to [0, MAX_LOAD]
    reliability: np.ndarray  # (n,) clipped to [0, 1]
    covering_ptr: np.ndarray  # (num_blocks + 1,) CSR pointers into covering_idx
    covering_idx: np.ndarray  # node indices covering each block, ascending within a block

    MAX_LOAD = 0.99  # a node announcing full load still finishes work, 100x slower (guess; keeps 1 / (1 - load) finite)

    def covering(self, block: int) -> np.ndarray:
        return self.covering_idx[self.covering_ptr[block] : self.covering_ptr[block + 1]]

    @classmethod
    def build(cls, snapshot: SwarmSnapshot) -> SnapshotArrays:
        nodes = snapshot.nodes
        count = len(nodes)
        num_regions = len(snapshot.region_latency_ms)
        start = np.fromiter((node.start_block for node in nodes), np.int64, count)
        end = np.fromiter((node.end_block for node in nodes), np.int64, count)
        start = np.clip(start, 0, snapshot.num_blocks)
        end = np.clip(end, start, snapshot.num_blocks)
        available = np.fromiter((node.online and not node.draining for node in nodes), bool, count)
        rtt = np.fromiter((np.nan if node.rtt_ms is None else node.rtt_ms for node in nodes), np.float64, count)
        region = np.fromiter((node.region for node in nodes), np.int64, count)
        region = np.where((region >= 0) & (region < num_regions), region, num_regions)
        backbone = np.zeros((num_regions + 1, num_regions + 1))
        if num_regions:
            backbone[:num_regions, :num_regions] = np.asarray(snapshot.region_latency_ms, dtype=np.float64)
        access = np.fromiter((np.nan if node.access_ms is None else node.access_ms for node in nodes), float, count)
        known_region = region < num_regions
        via_client = np.where(np.isnan(rtt), DEFAULT_RTT_MS, rtt) / 2  # unknown region: the path through the client
        access = np.where(np.isnan(access), np.where(known_region, DEFAULT_ACCESS_MS, via_client), access)
        bandwidth = np.fromiter(
            (DEFAULT_BANDWIDTH_MBPS if node.bandwidth_mbps is None else node.bandwidth_mbps for node in nodes),
            np.float64,
            count,
        )
        tps = np.fromiter((node.inference_tps for node in nodes), np.float64, count)
        span = np.maximum(end - start, 1)
        with np.errstate(divide="ignore"):
            block_ms = np.where(tps > 0, 1000.0 / (np.maximum(tps, 1e-300) * span), 0.0)
        # blocks -> covering nodes, as CSR: node i appears once per block of its span
        lengths = end - start
        owners = np.repeat(np.arange(count), lengths)
        offsets = np.arange(owners.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        blocks = np.repeat(start, lengths) + offsets
        order = np.argsort(blocks, kind="stable")  # stable: node indices stay ascending within a block
        ptr = np.zeros(snapshot.num_blocks + 1, np.int64)
        np.cumsum(np.bincount(blocks, minlength=snapshot.num_blocks), out=ptr[1:])
        return cls(
            peer_index={node.peer_id: index for index, node in enumerate(nodes)},
            start=start,
            end=end,
            available=available,
            cache_tokens_left=np.fromiter((node.cache_tokens_left for node in nodes), np.int64, count),
            max_length=np.fromiter((node.max_length for node in nodes), np.int64, count),
            max_step_tokens=np.fromiter((node.max_step_tokens for node in nodes), np.int64, count),
            client_rtt_ms=rtt,
            region=region,
            backbone=backbone,
            access_ms=np.maximum(access, 0.0),
            bandwidth_mbps=np.maximum(bandwidth, 1e-6),
            block_ms=block_ms,
            load=np.clip(np.fromiter((node.load for node in nodes), np.float64, count), 0.0, cls.MAX_LOAD),
            reliability=np.clip(np.fromiter((node.reliability for node in nodes), np.float64, count), 0.0, 1.0),
            covering_ptr=ptr,
            covering_idx=owners[order],
        )
