"""The routing cost of eq. 18: what appending node A to the chain so far costs.

The paper, minimised over candidates A for position i of the chain:

    sum_{j=1}^{i-1} (D_{j,A} / B_{j,A} + L_{j,A})^gamma + (G_A / C_A)^beta + (1 / (R_A + 1))^alpha,  R_A = 1 - uptime

Implemented: node A serves blocks [s, e) after the chain A_0 (the client), A_1 .. A_{i-1}; all times in ms.

    transfer     sum over j = max(0, i-1-window) .. i-1 of (D / bw_j + D / bw_A + L_{j,A}) ** gamma
    load         sum over the blocks b in [s, e) of (t_A / (1 - C_A) + f_A) ** beta
    reliability  (RELIABILITY_MS / (1 + R_A)) ** alpha

and a chain adds once its exit leg, (D / bw_p + D / bw_client + L_{p,client}) ** gamma, to the transfer term.

- D = hidden_size * tokens per pass * bytes per element of the request's codec, with tokens per pass =
  batch * max(1, (P + G) / (1 + G)): the mean of the request's passes (one prefill of P tokens, then G one-token
  steps), so (1 + G) * (D / B + L) is exactly the request's time on that link. A hop whose node does not accept
  the codec falls back to "none" on the wire; the cost does not see that.
- B_{j,A}: serialisation at both access links, D / bw_j + D / bw_A. It bounds the true D / min(bw_j, bw_A) from
  above within 2x, and it separates into a per-node part, which lets the exact search prune (search.py).
- L_{j,A} = access_j + backbone[region_j, region_A] + access_A (network coordinates, see snapshot.py). On a client
  leg the client's measured rtt / 2, when it has one, replaces the estimate.
- Load, fixed: the paper's (G_A / C_A)^beta grows with free GPU capacity, so a minimised cost would prefer busy
  nodes. Here it is load over availability: t_A / (1 - C_A) is A's compute time per block for one token when a
  share C_A of it is busy (the M/M/1 sojourn time), t_A = 1000 / (inference_tps * span blocks). It is summed per
  block so that parts of spans compose, which the (node, block boundary) search needs.
- f_A: getting the session's LoRA adapter to a node that lacks it (sent by the client, or fetched from the peers
  announcing it), per block, spread over the session's 1 + G passes; 0 for a node that announces it (eq. 18 has no such term: a node that
  holds the adapter is preferred by exactly what fetching costs).
- Reliability, fixed: with R_A = 1 - uptime the paper's term grows with uptime. Here R_A in [0, 1] is reliability
  (uptime share and reputation, raised for stable regions by sec. 3.1), so the term falls as it rises; the
  constant gives it time units, and it charges every hop (more hops, more to fail).
- The paper's alpha plays two roles. `alpha` here is eq. 18's reliability exponent (a real number); eq. 2's
  context length (how many previous nodes the transfer term looks back over) is the integer `window`: window = 0
  looks at the previous node only (exact search), window = w at the previous w + 1 (beam search). The client is
  A_0 and counts while it is inside the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

from nesa_node.routing.snapshot import ChainRequest, CostBreakdown, Hop, SnapshotArrays, SwarmSnapshot

RELIABILITY_MS = 10.0  # scale of the reliability term: of the order of one hop's per-step overhead (guess)
# bytes per element by codec, from compression/codec.py: 8-bit codes plus a float32 scale per block of 64
CODEC_BYTES = {"fp16": 2.0, "bf16": 2.0, "blockwise8": 1.0 + 4 / 64, "dynamic8": 1.0 + 4 / 64}
CLIENT = -2  # node index standing for the client (A_0) in chains and searches


@dataclass(frozen=True)
class RoutingParams:
    """Exponents of eq. 18 (tuned by ga.py) and the search settings."""

    gamma: float = 1.0  # transfer exponent
    beta: float = 1.0  # load exponent
    alpha: float = 1.0  # reliability exponent (eq. 18's alpha)
    window: int = 0  # eq. 2's alpha: look back over window + 1 previous nodes; 0: exact search
    beam_width: int = 16  # partial chains kept per block boundary when window > 0 (guess; see bench/routing.py)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> RoutingParams:
        """Raises ValueError for unknown keys, wrong types or values out of range."""
        known = {item.name: item for item in fields(cls)}
        unknown = set(values) - set(known)
        if unknown:
            raise ValueError(f"unknown routing parameters: {', '.join(sorted(unknown))}")
        checked = {}
        for name, value in values.items():
            integer = name in ("window", "beam_width")
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
                raise ValueError(f"routing parameter {name} must be {'an integer' if integer else 'a number'}")
            checked[name] = value if integer else float(value)
        params = cls(**checked)
        if not all(np.isfinite([params.gamma, params.beta, params.alpha])) or min(params.gamma, params.beta) <= 0:
            raise ValueError(f"gamma and beta must be finite and > 0, alpha finite: {params}")
        if params.window < 0 or params.beam_width < 1:
            raise ValueError(f"window must be >= 0 and beam_width >= 1: {params}")
        return params


def bytes_per_element(codec: str, element_bytes: float) -> float:
    return CODEC_BYTES.get(codec, element_bytes)


def tokens_per_pass(request: ChainRequest) -> float:
    """Mean tokens per pass of the request: one prefill of P tokens, then G one-token steps."""
    passes = 1 + max(request.new_tokens, 0)
    return max(request.batch, 1) * max(1.0, (max(request.prompt_tokens, 0) + max(request.new_tokens, 0)) / passes)


@dataclass(frozen=True, eq=False)
class RequestTerms:
    """Per-node parts of eq. 18 for one request (index = position in snapshot.nodes)."""

    side_ms: np.ndarray  # (n,) D / bw + access: a node's own share of any link to or from it
    region: np.ndarray  # (n,)
    backbone: np.ndarray  # (regions + 1, regions + 1)
    client_leg: np.ndarray  # (n,) client <-> node transfer term, raised to gamma
    block: np.ndarray  # (n,) load term of one block, raised to beta
    reliability: np.ndarray  # (n,) reliability term, raised to alpha
    gamma: float

    def transfer(self, source: np.ndarray, target: np.ndarray) -> np.ndarray:
        """Transfer term (raised to gamma) from nodes `source` to nodes `target` (broadcast; no client here)."""
        latency = self.side_ms[source] + self.backbone[self.region[source], self.region[target]] + self.side_ms[target]
        return latency**self.gamma


@dataclass(frozen=True, eq=False)
class RequestBase:
    """The parameter-free parts of eq. 18 for one request: times in ms before any exponent."""

    side_ms: np.ndarray  # (n,)
    client_ms: np.ndarray  # (n,) client <-> node transfer time
    block_ms: np.ndarray  # (n,) compute per block per token at the node's load
    reliability_ms: np.ndarray  # (n,) RELIABILITY_MS / (1 + R_A)
    region: np.ndarray
    backbone: np.ndarray

    def terms(self, params: RoutingParams) -> RequestTerms:
        return RequestTerms(
            self.side_ms,
            self.region,
            self.backbone,
            self.client_ms**params.gamma,
            self.block_ms**params.beta,
            self.reliability_ms**params.alpha,
            params.gamma,
        )


def client_latency_ms(arrays: SnapshotArrays, request: ChainRequest) -> np.ndarray:
    """One-way latency between the client and each node, ms: the client's measured rtt / 2; else, for a node with
    a region, the client's last mile + backbone + the node's last mile; else the node's path-through-the-client
    last mile (snapshot.py), which is already rtt / 2."""
    num_regions = arrays.backbone.shape[0] - 1
    client_region = request.client_region if 0 <= request.client_region < num_regions else num_regions
    estimate = request.client_access_ms + arrays.backbone[client_region, arrays.region] + arrays.access_ms
    estimate = np.where(arrays.region == num_regions, arrays.access_ms, estimate)
    return np.where(np.isnan(arrays.client_rtt_ms), estimate, arrays.client_rtt_ms / 2)


def adapter_send_ms(snapshot: SwarmSnapshot, request: ChainRequest) -> np.ndarray:
    """(n,) per block, ms: what getting the request's LoRA adapter to each node that lacks it adds, spread over the
    session's passes like every other term (a one-time transfer of `adapter_block_bytes` per block over the node's
    access link, and the client's when the client sends it); 0 where the node holds it or no adapter is named."""
    arrays: SnapshotArrays = snapshot.arrays
    if request.adapter is None or request.adapter_block_bytes <= 0:
        return np.zeros(len(snapshot.nodes))
    lacking = np.fromiter((request.adapter not in node.adapters for node in snapshot.nodes), bool, len(snapshot.nodes))
    megabits = request.adapter_block_bytes * 8 / 1e6
    seconds = megabits / arrays.bandwidth_mbps
    if request.client_bandwidth_mbps and request.adapter_reachable is None:  # the client sends it over its own link
        seconds = seconds + megabits / request.client_bandwidth_mbps
    passes = 1 + max(request.new_tokens, 0)
    return np.where(lacking, seconds * 1000.0 / passes, 0.0)


def request_base(
    snapshot: SwarmSnapshot, request: ChainRequest, *, reliability_ms: float = RELIABILITY_MS
) -> RequestBase:
    """Per-node times of eq. 18 for `request`, ms: D / bw + last mile (each node's share of a link), the client
    legs, compute per block at the announced load, and the reliability term's base."""
    arrays: SnapshotArrays = snapshot.arrays
    megabits = (
        snapshot.hidden_size * tokens_per_pass(request) * bytes_per_element(request.codec, snapshot.element_bytes)
    )
    megabits *= 8 / 1e6
    serial = megabits / arrays.bandwidth_mbps * 1000.0  # Mbit / (Mbit/s) -> s -> ms
    client_serial = megabits / request.client_bandwidth_mbps * 1000.0 if request.client_bandwidth_mbps else 0.0
    return RequestBase(
        side_ms=serial + arrays.access_ms,
        client_ms=client_serial + serial + client_latency_ms(arrays, request),
        block_ms=arrays.block_ms / (1.0 - arrays.load) + adapter_send_ms(snapshot, request),
        reliability_ms=reliability_ms / (1.0 + arrays.reliability),
        region=arrays.region,
        backbone=arrays.backbone,
    )


def request_terms(
    snapshot: SwarmSnapshot, request: ChainRequest, params: RoutingParams, *, reliability_ms: float = RELIABILITY_MS
) -> RequestTerms:
    """Per-node terms of eq. 18 for `request` under `params`."""
    return request_base(snapshot, request, reliability_ms=reliability_ms).terms(params)


def append_cost(
    terms: RequestTerms, previous: Sequence[int], node: int, blocks: int, params: RoutingParams
) -> CostBreakdown:
    """Cost of appending `node` for `blocks` blocks after the chain `previous` (node indices, CLIENT first).

    Only the last window + 1 entries of `previous` count (eq. 2's look-back).
    """
    transfer = 0.0
    for source in previous[-(params.window + 1) :]:
        if source == CLIENT:
            transfer += float(terms.client_leg[node])
        else:
            transfer += float(terms.transfer(np.asarray(source), np.asarray(node)))
    return CostBreakdown(transfer, blocks * float(terms.block[node]), float(terms.reliability[node]))


def chain_cost(
    snapshot: SwarmSnapshot,
    request: ChainRequest,
    params: RoutingParams,
    hops: Sequence[Hop],
    *,
    terms: RequestTerms | None = None,
) -> CostBreakdown:
    """Eq. 18 summed over a chain, plus the exit leg back to the client. Raises KeyError for an unknown peer."""
    terms = terms or request_terms(snapshot, request, params)
    index = snapshot.arrays.peer_index
    previous: list[int] = [CLIENT]
    total = CostBreakdown()
    for hop in hops:
        node = index[hop.peer_id]
        total += append_cost(terms, previous, node, hop.end_block - hop.start_block, params)
        previous.append(node)
    if hops:
        total += CostBreakdown(transfer=float(terms.client_leg[previous[-1]]))
    return total
