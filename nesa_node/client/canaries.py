"""Known-answer canaries (verify="canary:P"): each node of a generation's chain is checked, with probability P, on
hidden states whose outputs the client knows (verification/canaries.py), with no other node involved.

After a generation, for each node sampled, the client opens a fresh lossless session on that node alone for its
blocks and sends a canary the way a generation goes: a prompt of random length, then one-token steps to the
canary's end. The outputs are compared with the known answer under the tolerance audits use for the node's
announced dtype against float32 (verification/commitment.py `compare`). A node that fails is sent a second canary;
failing both, it is blamed (banned for an hour, its routing reliability cut: Swarm.blame) and the caller runs the
generation again on other nodes (AsyncDistributedModel.generate). A node failing one canary of two is counted
"inconclusive" and kept: one check out of tolerance is not proof, and an honest node of a long bfloat16 span is the
likeliest to show one.

What the checks say and do not: a node that passes computed its announced blocks on the canary's session; it may
still cheat on sessions it can tell apart (longer ones, adapters: canaries run the base weights; or every session,
if it holds the canary file). Audits (audit:P) check the sessions themselves but need other nodes serving the same
blocks; canaries check the only node of a span too. Nodes announcing quantized weights are skipped (their honest
error against float32 is not calibrated). The report says "checked with known answers at rate P", never
"verified".
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from nesa_node.client.audit import BLAME_BAN_S, LOSSLESS
from nesa_node.client.chain_links import LinkFailed
from nesa_node.client.session import InferenceSession
from nesa_node.errors import NesaError
from nesa_node.routing.snapshot import Chain, Hop
from nesa_node.verification.canaries import CanarySet
from nesa_node.verification.commitment import commit_window, compare, tolerance_for

logger = logging.getLogger(__name__)


@dataclass
class CanaryBlame:
    """A node that failed two canaries, with what each comparison measured."""

    peer_id: str
    blocks: tuple[int, int]
    canaries: tuple[int, int]
    reasons: tuple[str, ...]


@dataclass
class CanaryOutcome:
    """What one round of canary checks of a chain found."""

    rate: float
    nodes: int = 0  # distinct nodes in the chain
    sampled: int = 0  # nodes sampled for a check
    checks: dict = field(
        default_factory=lambda: {"passed": 0, "failed": 0, "inconclusive": 0, "skipped": 0, "unanswered": 0}
    )
    blamed: list[CanaryBlame] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.blamed

    def report(self) -> dict:
        """The outcome as response metadata: the rate, counts by result, blamed peers."""
        return {
            "mode": f"canary:{self.rate:g}",
            "checked": f"checked with known answers at rate {self.rate:g}: {self.sampled} of {self.nodes} nodes",
            "checks": dict(self.checks),
            "blamed": [blame.peer_id for blame in self.blamed],
        }


class CanaryChecker:
    """Checks the nodes of chains for `model` (an AsyncDistributedModel) with `canaries`, each node with chance
    `rate`, drawing with `rng`."""

    def __init__(self, model, rate: float, canaries: CanarySet, rng: random.Random | None = None):
        if not 0 < rate <= 1:
            raise ValueError(f"canary rate must be in (0, 1], got {rate}")
        self.model = model
        self.rate = rate
        self.canaries = canaries
        self.rng = rng if rng is not None else random.Random()

    async def check(self, chain: Chain) -> CanaryOutcome:
        """Check the nodes of `chain` (see the module docstring); blamed nodes are banned before this returns."""
        outcome = CanaryOutcome(self.rate)
        seen: set[str] = set()
        for hop in chain.hops:
            if hop.peer_id in seen:
                continue
            seen.add(hop.peer_id)
            outcome.nodes += 1
            if self.rng.random() >= self.rate:
                continue
            outcome.sampled += 1
            info = self.model.swarm.announced(hop.peer_id)
            if info is not None and info.quantization != "none":
                outcome.checks["skipped"] += 1
                continue
            dtype = info.dtype if info is not None else str(self.model.dtype).removeprefix("torch.")
            first = self.rng.randrange(self.canaries.count)
            reasons = await self._failed(hop, first, dtype)
            if reasons is None:
                outcome.checks["unanswered"] += 1
            elif not reasons:
                outcome.checks["passed"] += 1
            else:
                outcome.checks["failed"] += 1
                second = self.rng.choice([index for index in range(self.canaries.count) if index != first] or [first])
                again = await self._failed(hop, second, dtype)
                if not again:  # passed, or no answer: nothing proven
                    outcome.checks["inconclusive"] += 1
                    continue
                self.model.swarm.blame(hop.peer_id, ban_s=BLAME_BAN_S)
                blame = CanaryBlame(hop.peer_id, (hop.start_block, hop.end_block), (first, second), reasons + again)
                outcome.blamed.append(blame)
                logger.warning(
                    "canaries: %s (blocks %d:%d) failed canaries %d and %d: %s; banned",
                    hop.peer_id, hop.start_block, hop.end_block, first, second, "; ".join(blame.reasons),
                )  # fmt: skip
        return outcome

    async def _failed(self, hop: Hop, index: int, dtype: str) -> tuple[str, ...] | None:
        """Run canary `index` through `hop`'s node alone: () when its outputs match the known answer, the reasons
        when they do not, None when the node did not answer."""
        given, answer = self.canaries.case(index, hop.start_block, hop.end_block)
        tokens = given.shape[1]
        prompt = self.rng.randint(max(1, tokens // 4), max(1, tokens // 2))
        given = given.to(self.model.dtype)
        session = InferenceSession(
            self.model.swarm,
            Chain(hops=(hop,)),
            self.model.config.replace(compression=LOSSLESS),
            batch=1,
            max_length=tokens,
        )
        outputs = []
        try:
            async with session:
                outputs.append(await session.step(given[:, :prompt]))
                for position in range(prompt, tokens):
                    outputs.append(await session.step(given[:, position : position + 1]))
        except (NesaError, LinkFailed) as error:
            logger.info("canary %d on %s (blocks %d:%d) got no answer: %s", index, hop.peer_id,
                        hop.start_block, hop.end_block, error)  # fmt: skip
            return None
        output = torch.cat(outputs, dim=1).float().cpu()
        report = compare(commit_window(answer), output, tolerance_for(dtype, "float32"))
        return () if report.matches else tuple(f"canary {index}: {reason}" for reason in report.reasons)


__all__ = ["CanaryBlame", "CanaryChecker", "CanaryOutcome"]
