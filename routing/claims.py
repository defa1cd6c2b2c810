"""What routing believes of a node's self-reported figures (RELIABILITY.md G4): every field of a record is a claim,
and identities are free, so a claim is bounded by what the other nodes claim and replaced by what the client has
measured once it has.

- Speed. A node's claimed compute time per block per token, t = 1000 / (inference_tps * span), is compared with the
  median t of the other nodes serving any of its blocks (or of all other nodes, when none shares a block): a claim
  faster than CLAIM_CAP times that median is cut to it, and a missing or zero claim costs the median (an unknown
  node is an average one, not a free one). Once the client has MIN_SAMPLES measurements of the node, the measured
  time replaces the claim.
- Over-claiming. A node measured slower than its own (uncapped) claim by more than OVERCLAIM_TOLERANCE has, with
  factor = OVERCLAIM_TOLERANCE / (measured / claimed), its reliability (eq. 18's R_A) scaled by the factor and its
  block time divided by it: a liar is costed as slower than it measured, so it loses sessions to honest nodes of
  equal speed instead of tying with them (R_A alone moves eq. 18 by a few ms at most, less than load does).
- Uptime. Cut to the larger of the median claimed by the other nodes and how long this client has seen the node:
  claiming to have been up for years buys nothing over the swarm's usual.
- Bandwidth. Cut to CLAIM_CAP times the median of the other nodes' figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

CLAIM_CAP = 2.0  # a claim may beat the median of its peers by this factor (guess: GPU generations differ ~2x)
OVERCLAIM_TOLERANCE = 3.0  # measured over claimed before reliability suffers (guess: load and noise on busy hosts)
MIN_SAMPLES = 3  # measured steps before a measurement replaces the claim


@dataclass(frozen=True)
class SpeedClaim:
    """One node's claimed speed over its span."""

    peer_id: str
    start_block: int
    end_block: int
    inference_tps: float  # tokens/s through the whole span, one token at a time; 0: unknown

    @property
    def block_ms(self) -> float | None:
        """Claimed compute ms per block per token, or None when the claim is missing or not a positive number."""
        span = self.end_block - self.start_block
        if not (math.isfinite(self.inference_tps) and self.inference_tps > 0 and span > 0):
            return None
        return 1000.0 / (self.inference_tps * span)


@dataclass(frozen=True)
class Measured:
    """The client's measurement of one node: compute ms per block per token, and how many steps it rests on."""

    block_ms: float
    samples: int


@dataclass(frozen=True)
class TrustedSpeed:
    block_ms: float | None  # what routing uses; None: nothing known of any node
    reliability_factor: float  # multiplies the node's R_A, in (0, 1]


def _median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if values else None


def medians_of_the_others(values: Sequence[float]) -> list[float | None]:
    """For each value, the median of all the others (None for a lone value): one sort, O(n log n), where taking each
    median afresh would be quadratic in the number of nodes."""
    count = len(values)
    if count < 2:
        return [None] * count
    order = np.argsort(np.asarray(values, dtype=np.float64), kind="stable")
    ordered = np.asarray(values, dtype=np.float64)[order]
    rank = np.empty(count, dtype=np.int64)
    rank[order] = np.arange(count)
    rest = count - 1  # values left once one is taken out

    def nth(position: int, removed: int) -> float:  # the position-th smallest of the others
        return float(ordered[position if position < removed else position + 1])

    medians: list[float | None] = []
    for index in range(count):
        removed = int(rank[index])
        if rest % 2:
            medians.append(nth(rest // 2, removed))
        else:
            medians.append((nth(rest // 2 - 1, removed) + nth(rest // 2, removed)) / 2)
    return medians


def peer_median_block_ms(claims: Sequence[SpeedClaim]) -> dict[str, float | None]:
    """Per node, the median claimed block time of the other nodes serving any of its blocks (all other nodes when
    none does); None when no other node claims anything."""
    known = [(claim, claim.block_ms) for claim in claims if claim.block_ms is not None]
    medians: dict[str, float | None] = {}
    for claim in claims:
        others = [(other, ms) for other, ms in known if other.peer_id != claim.peer_id]
        sharing = [
            ms for other, ms in others if other.start_block < claim.end_block and claim.start_block < other.end_block
        ]
        medians[claim.peer_id] = _median(sharing) if sharing else _median([ms for _, ms in others])
    return medians


def trusted_speeds(claims: Sequence[SpeedClaim], measured: Mapping[str, Measured]) -> dict[str, TrustedSpeed]:
    """The block time routing uses for each node, and its reliability factor (module docstring)."""
    medians = peer_median_block_ms(claims)
    speeds: dict[str, TrustedSpeed] = {}
    for claim in claims:
        claimed, median = claim.block_ms, medians[claim.peer_id]
        if claimed is None:
            bounded = median
        elif median is None:
            bounded = claimed
        else:
            bounded = max(claimed, median / CLAIM_CAP)
        factor = 1.0
        seen = measured.get(claim.peer_id)
        if seen is not None and seen.samples >= MIN_SAMPLES and math.isfinite(seen.block_ms) and seen.block_ms > 0:
            bounded = seen.block_ms
            if claimed is not None and seen.block_ms > OVERCLAIM_TOLERANCE * claimed:
                factor = OVERCLAIM_TOLERANCE * claimed / seen.block_ms
                bounded = seen.block_ms / factor
        speeds[claim.peer_id] = TrustedSpeed(bounded, factor)
    return speeds


def capped_uptimes(claimed: Mapping[str, float], seen_s: Mapping[str, float]) -> dict[str, float]:
    """Each node's uptime as routing counts it: its claim, at most the larger of the other nodes' median claim
    and how long this client has seen it (seconds)."""
    capped: dict[str, float] = {}
    medians = medians_of_the_others(list(claimed.values()))
    for (peer, uptime), median in zip(claimed.items(), medians, strict=True):
        ceiling = max(median or 0.0, seen_s.get(peer, 0.0))
        capped[peer] = min(uptime, ceiling) if median is not None or peer in seen_s else uptime
    return capped


def capped_bandwidths(claimed: Mapping[str, float]) -> dict[str, float]:
    """Each node's bandwidth, at most CLAIM_CAP times the median of the other nodes' (Mbit/s)."""
    capped: dict[str, float] = {}
    medians = medians_of_the_others(list(claimed.values()))
    for (peer, bandwidth), median in zip(claimed.items(), medians, strict=True):
        capped[peer] = min(bandwidth, CLAIM_CAP * median) if median is not None else bandwidth
    return capped


__all__ = [
    "CLAIM_CAP",
    "MIN_SAMPLES",
    "OVERCLAIM_TOLERANCE",
    "Measured",
    "SpeedClaim",
    "TrustedSpeed",
    "capped_bandwidths",
    "capped_uptimes",
    "medians_of_the_others",
    "peer_median_block_ms",
    "trusted_speeds",
]
