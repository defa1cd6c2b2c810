"""Known-answer canaries (verify="canary:P"): each node of a generation's chain is checked, with probability P, on
hidden states whose outputs the client knows (verification/canaries.py), with no other node involved.

Once a generation's session is closed, each node sampled gets a fresh lossless session of its own for its blocks,
opened with the generation's length, and one canary sent the way that generation went: its prompt length (within
the canary), then one-token steps to the canary's end. The outputs are compared with the known answer
(verification/commitment.py `compare`, token by token: verification/canaries.py `comparable`) under the file's
tolerance for the span, the node's announced dtype and the dtype the client sends in (`CanarySet.tolerance`: the
audits' calibration, widened for spans in bfloat16 or float16 by the rounding error measured when the file was
built). A node that fails gets a second canary; failing
it too, or not answering it, the node is blamed (banned for an hour, its routing reliability cut: Swarm.blame) and
the caller runs the generation again on other nodes (AsyncDistributedModel.generate). Each sampled node counts once:
"passed", "failed" (blamed), "inconclusive" (one canary of two failed: kept), "skipped" (it announces quantized
weights, whose honest error is not calibrated; no record is at hand to say what it computes in; or even one of
its blocks rounds past MAX_BOUND: a span that does as a whole is checked on a random part of it that does not) or
"unanswered" (no answer within CANARY_TIMEOUT_S of steps, a refusal: not
proof of anything). Nodes are checked concurrently.

What the checks say and do not: a node that passes computed its announced blocks on the canary's session. It may
still cheat on sessions it can tell apart: a node holding the file knows every canary; one that sees the same few
canaries often may learn them (more canaries, `--count`, repeat less; a canary from random token ids is told from
prose by a node of the first blocks: build them from text, `--text`); and canaries run the base weights, so a node
cheating on adapters only is not seen. Audits (audit:P) check the sessions themselves but need other nodes serving
the same blocks; canaries check the only node of a span too. The report says "checked with known answers at rate
P", never "verified".
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

import torch

from nesa_node.client.audit import BLAME_BAN_S, LOSSLESS
from nesa_node.client.session import InferenceSession
from nesa_node.errors import NesaError
from nesa_node.routing.snapshot import Chain, Hop
from nesa_node.verification.canaries import CanarySet, comparable
from nesa_node.verification.commitment import commit_window, compare

logger = logging.getLogger(__name__)

RESULTS = ("passed", "failed", "inconclusive", "skipped", "unanswered")
CANARY_TIMEOUT_S = 60.0  # one canary session, open to last step (a healthy node takes a step's time per token)


@dataclass
class CanaryBlame:
    """A node that failed a canary and then failed or did not answer a second, with what was measured."""

    peer_id: str
    blocks: tuple[int, int]
    canaries: tuple[int, int]
    reasons: tuple[str, ...]


@dataclass
class CanaryOutcome:
    """What one round of canary checks of a chain found: one result per sampled node."""

    rate: float
    nodes: int = 0  # distinct nodes in the chain
    sampled: int = 0  # nodes sampled for a check
    checks: dict = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
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
        self.timeout_s = CANARY_TIMEOUT_S

    async def check(self, chain: Chain, *, max_length: int = 0, prompt_tokens: int = 0) -> CanaryOutcome:
        """Check the nodes of `chain` (see the module docstring), whose generation opened its session for
        `max_length` tokens with a prompt of `prompt_tokens` (0: unknown, drawn at random); blamed nodes are banned
        before this returns."""
        outcome = CanaryOutcome(self.rate)
        hops = list({hop.peer_id: hop for hop in chain.hops}.values())  # a node of two hops: its last
        outcome.nodes = len(hops)
        sampled = [hop for hop in hops if self.rng.random() < self.rate]
        outcome.sampled = len(sampled)
        count = self.canaries.count
        plans = []
        for hop in sampled:
            first = self.rng.randrange(count)
            second = self.rng.choice([index for index in range(count) if index != first] or [first])
            tokens = self.canaries.tokens
            prompt = min(prompt_tokens, tokens - 1) if prompt_tokens > 0 else self.rng.randint(1, max(1, tokens // 2))
            plans.append((hop, (first, second), max(prompt, 1)))
        results = await asyncio.gather(
            *(self._check_node(hop, indices, prompt, max(max_length, self.canaries.tokens)) for hop, indices, prompt in plans),
            return_exceptions=True,
        )  # fmt: skip
        for (hop, _, _), result in zip(plans, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                logger.warning("canaries: the check of %s failed: %r", hop.peer_id, result)
                result = ("unanswered", None)
            result, blame = result
            outcome.checks[result] += 1
            if blame is not None:
                self.model.swarm.blame(blame.peer_id, ban_s=BLAME_BAN_S)
                outcome.blamed.append(blame)
                logger.warning(
                    "canaries: %s (blocks %d:%d) failed canary %d, then %d: %s; banned",
                    blame.peer_id, *blame.blocks, *blame.canaries, "; ".join(blame.reasons),
                )  # fmt: skip
        return outcome

    async def _check_node(
        self, hop: Hop, indices: tuple[int, int], prompt: int, max_length: int
    ) -> tuple[str, CanaryBlame | None]:
        info = self.model.swarm.announced(hop.peer_id)
        if info is None or info.quantization != "none":
            return "skipped", None
        hop = self._checkable(hop, info.dtype)
        if hop is None:
            return "skipped", None  # even one of its blocks rounds as much as the cheats a check could tell
        first = await self.failures(hop, indices[0], info.dtype, prompt=prompt, max_length=max_length)
        if first is None:
            return "unanswered", None
        if not first:
            return "passed", None
        second = await self.failures(hop, indices[1], info.dtype, prompt=prompt, max_length=max_length)
        if second == ():
            return "inconclusive", None
        reasons = first + (second or (f"canary {indices[1]}: no answer after a failed canary",))
        return "failed", CanaryBlame(hop.peer_id, (hop.start_block, hop.end_block), indices, reasons)

    def _checkable(self, hop: Hop, dtype: str) -> Hop | None:
        """`hop`, or when its whole span rounds past the canaries' bound (CanarySet.tolerance: a long span in a low
        precision) a random part of it as long as the bound allows (a node runs any part of its span for a chain);
        None when not even one block does."""
        sent = str(self.model.dtype).removeprefix("torch.")
        start, end = hop.start_block, hop.end_block
        if self.canaries.tolerance(start, end, dtype, sent) is not None:
            return hop
        for length in range(end - start - 1, 0, -1):
            starts = [first for first in range(start, end - length + 1)
                      if self.canaries.tolerance(first, first + length, dtype, sent) is not None]  # fmt: skip
            if starts:
                first = self.rng.choice(starts)
                return Hop(hop.peer_id, first, first + length, hop.codecs)
        return None

    async def failures(
        self, hop: Hop, index: int, dtype: str, *, prompt: int = 0, max_length: int = 0
    ) -> tuple[str, ...] | None:
        """Run canary `index` through `hop`'s node alone (which computes in `dtype`), its first `prompt` tokens as one
        step (0: drawn at random) in a session of `max_length` tokens (at least the canary's): () when the outputs
        match the known answer, the reasons when they do not, None when the node did not answer."""
        given, answer = self.canaries.case(index, hop.start_block, hop.end_block)
        tokens = given.shape[1]
        prompt = prompt if 0 < prompt < tokens else self.rng.randint(1, max(1, tokens // 2))
        given = given.to(self.model.dtype)
        # one node, no failover: each step gets the request timeout (InferenceSession.deadline), not a generation's
        # adaptive deadline, so a step held up a moment does not make the node unanswered; the whole check is bounded
        # by CANARY_TIMEOUT_S
        config = self.model.config.replace(compression=LOSSLESS)
        session = InferenceSession(
            self.model.swarm,
            Chain(hops=(hop,)),
            config,
            batch=1,
            max_length=max(max_length, tokens),
            hidden_size=self.model.model_config.hidden_size,
        )
        sent = str(given.dtype).removeprefix("torch.")
        tolerance = self.canaries.tolerance(hop.start_block, hop.end_block, dtype, sent)
        if tolerance is None:
            raise ValueError(f"blocks {hop.start_block}:{hop.end_block} in {dtype} round past what canaries can check")
        outputs = []
        try:
            async with session:  # opening is bounded by the request timeout, closing by the session's own
                async with asyncio.timeout(self.timeout_s):
                    outputs.append(await session.step(given[:, :prompt]))
                    for position in range(prompt, tokens):
                        outputs.append(await session.step(given[:, position : position + 1]))
        except (NesaError, TimeoutError) as error:  # LinkFailed is a NesaError
            logger.info("canary %d on %s (blocks %d:%d) got no answer: %r", index, hop.peer_id,
                        hop.start_block, hop.end_block, error)  # fmt: skip
            return None
        expected, computed = comparable(answer, torch.cat(outputs, dim=1).cpu())
        report = compare(commit_window(expected), computed, tolerance)
        return () if report.matches else tuple(f"canary {index}: {reason}" for reason in report.reasons)


__all__ = ["CANARY_TIMEOUT_S", "RESULTS", "CanaryBlame", "CanaryChecker", "CanaryOutcome"]
