"""Sampled audits of a session's hops (verify="audit:p"): re-execute sampled windows on independent nodes and check
the nodes' signed commitments, blaming the first faulty node.

Each node of a session opened with hop records signs, per 32-token window, a commitment to its output
(server/window_log.py, verification/commitment.py). After the generation, `Auditor.audit(session)` fetches the
records and samples each window with probability p. For the sampled windows it replays the chain stage by stage
from what the client itself sent (its own inputs, as the first node decoded them): each hop's blocks run the whole
prefix as one prefill, in a fresh session with the audited session's adapter, on another node serving them, never the audited one; the hop's committed
windows are checked against that re-execution (`compare`, tolerances calibrated per dtype), and the re-executed
output, passed through the hop's wire codec as the next node received it, is the next hop's input. The client
trusts no node's word about another's input: only what it sent and what independent nodes recompute.

A window that fails its check is re-executed on a second independent node. When the two re-executions agree, the
audited node is blamed: banned for an hour, its routing reliability cut (Swarm.blame), and its signed record kept
as evidence. When they disagree one of the auditors lied, and nothing is concluded (counted "inconclusive"); the
first auditor's output may be the lie, so the checks stop there too, as at the first blamed hop, whose output fed
the rest: an auditor's lie never becomes the input an honest later hop is checked against. The caller re-runs a blamed generation on other nodes
(AsyncDistributedModel.generate), so the tokens it returns are those of nodes that passed.

Costs: one forward of the prefix per hop up to the last sampled window (and one more per failed window), against
one step per token for serving; receipts say "audited at rate p", never "verified": an unsampled window is not
checked, so a node cheating on a fraction f of windows escapes an audit of n windows with probability (1 - p f)^n.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from nesa_node.client.chain_links import LinkFailed
from nesa_node.client.session import InferenceSession
from nesa_node.errors import NesaError, NoRouteError, ReceiptError
from nesa_node.protocol.tensors import WireCodec, as_received, tensor_to_wire
from nesa_node.routing.chain import ChainRequest
from nesa_node.verification.commitment import (
    WINDOW_TOKENS,
    WindowCommitment,
    commit_window,
    compare,
    tolerance_for,
)
from nesa_node.verification.receipts import HopRecord, SessionReceipts

logger = logging.getLogger(__name__)

LOSSLESS = WireCodec.of("none")
BLAME_BAN_S = 3600.0  # a node caught cheating is kept out of this client's chains for an hour


@dataclass
class Blame:
    """A node a failed audit blames, with the evidence: its signed record and what the check measured."""

    peer_id: str
    hop: int
    window: int
    record: HopRecord | None  # None: it withheld its record, or sent one not of this session's windows
    reasons: tuple[str, ...]


@dataclass
class AuditOutcome:
    """What one audit of a session found."""

    rate: float
    windows: int = 0  # windows the session had (with a record from every hop)
    sampled: int = 0  # windows sampled
    checks: dict = field(default_factory=lambda: {"passed": 0, "failed": 0, "inconclusive": 0, "unrecorded": 0})
    blamed: list[Blame] = field(default_factory=list)
    receipts: SessionReceipts | None = None  # the session's signed records and Merkle root (`nesa-node audit` file)

    @property
    def clean(self) -> bool:
        return not self.blamed

    def report(self) -> dict:
        """The outcome as response metadata: the rate, counts by result, blamed peers."""
        return {
            "mode": f"audit:{self.rate:g}",
            "audited": f"audited at rate {self.rate:g}: {self.sampled} of {self.windows} windows",
            "checks": dict(self.checks),
            "blamed": [blame.peer_id for blame in self.blamed],
        }


def _as_received(hidden: torch.Tensor, codec: str) -> torch.Tensor:
    """`hidden` as a node decodes it after `codec` on the wire (lossless where the codec cannot carry its values, as
    the node that sent it does: protocol/tensors.py tensor_to_wire)."""
    proto, sent = tensor_to_wire(hidden, WireCodec.of(codec))
    return as_received(hidden, proto, sent)


class Auditor:
    """Audits sessions of `model` (an AsyncDistributedModel) at `rate`, sampling windows with `rng`."""

    def __init__(self, model, rate: float, rng: random.Random | None = None):
        if not 0 < rate <= 1:
            raise ValueError(f"audit rate must be in (0, 1], got {rate}")
        self.model = model
        self.rate = rate
        self.rng = rng if rng is not None else random.Random()

    async def audit(self, session: InferenceSession) -> AuditOutcome:
        """Fetch the session's last records and check its sampled windows (see the module docstring). Call it
        before closing the session, between steps."""
        outcome = AuditOutcome(self.rate)
        try:
            await session.fetch_records(final=True)
        except ReceiptError as error:  # records not its own, or not of this session's windows: as good as none
            hops = [hop.peer_id for hop in session.chain.hops]
            index = hops.index(error.peer_id) if error.peer_id in hops else -1
            self._blame(outcome, Blame(error.peer_id, index, -1, None, (error.message,)))
            return outcome
        try:
            return await self._audit(session, outcome)
        finally:
            outcome.receipts = session.receipts.receipts(
                audit_rate=self.rate, metadata={"audited": f"{outcome.sampled} of {outcome.windows} windows"}
            )

    def _blame(self, outcome: AuditOutcome, blame: Blame) -> None:
        self.model.swarm.blame(blame.peer_id, ban_s=BLAME_BAN_S)
        outcome.blamed.append(blame)
        logger.warning("audit: %s (hop %d) blamed: %s; banned", blame.peer_id, blame.hop, "; ".join(blame.reasons))

    async def _audit(self, session: InferenceSession, outcome: AuditOutcome) -> AuditOutcome:
        hops = session.chain.hops
        by_window: dict[int, dict[int, HopRecord]] = {}
        for record in session.records:
            by_window.setdefault(record.window, {})[record.hop] = record  # a replacement's record replaces
        # every node of the chain holds a record of every window of the tokens the session holds (a replacement too:
        # its cache's replay made them); one it keeps back is a window it would not have checked
        held = {(record.peer_id, record.window) for record in session.records}
        windows_held = range(-(-session.position // WINDOW_TOKENS))
        for index, hop in enumerate(hops):
            missing = [window for window in windows_held if (hop.peer_id, window) not in held]
            if missing:
                reason = f"kept back its signed records of {len(missing)} of {len(windows_held)} windows"
                self._blame(outcome, Blame(hop.peer_id, index, missing[0], None, (reason,)))
        if outcome.blamed:
            return outcome
        windows = sorted(by_window)
        outcome.windows = len(windows)
        sampled = [window for window in windows if self.rng.random() < self.rate]
        outcome.sampled = len(sampled)
        if not sampled:
            return outcome
        complete = [window for window in sampled if len(by_window[window]) == len(hops)]
        outcome.checks["unrecorded"] += len(sampled) - len(complete)
        if not complete:
            return outcome
        if any(hop.peer_id in session.links.recoded for hop in hops[:-1]):
            # a node's output codec changed mid-session (retargeted to a replacement that takes another): what its
            # next node decoded, step by step, is not known here
            outcome.checks["inconclusive"] += len(complete)
            return outcome
        end = max(record.token_end for window in complete for record in by_window[window].values())
        received = torch.cat(session._inputs[0], dim=1)[:, :end]  # kept as the first node decoded them
        if received.shape[1] < end:  # fewer inputs kept than the records cover: cannot replay
            outcome.checks["unrecorded"] += len(complete)
            return outcome
        # relay mode: the client sent every node its input, and kept it as that node decoded it: each hop is checked
        # on what it was given (nothing modeled, no auditor's output carried from one hop to the next)
        relay = not session.links.direct and len(session._inputs) == len(hops)
        hidden = received
        for index, hop in enumerate(hops):
            if relay and index > 0:
                hidden = torch.cat(session._inputs[index], dim=1)[:, :end]
                if hidden.shape[1] < end:
                    outcome.checks["unrecorded"] += len(complete) * (len(hops) - index)
                    return outcome
            executed = await self._reexecute(session, hop.start_block, hop.end_block, hidden, exclude={hop.peer_id})
            if executed is None:
                outcome.checks["inconclusive"] += len(complete)
                return outcome
            output, auditors = executed
            doubted = False  # a check its confirmation did not bear out: an auditor lied, maybe the first
            for window in complete:
                record = by_window[window][index]
                tolerance = self.tolerance({record.peer_id} | auditors)
                part = output[:, record.token_start : record.token_end]
                report = compare(WindowCommitment.from_bytes(record.commitment), part, tolerance)
                if report.matches:
                    outcome.checks["passed"] += 1
                    continue
                outcome.checks["failed"] += 1
                if await self._confirmed(session, hop, hidden, part, record, tolerance, auditors | {hop.peer_id}):
                    reasons = (f"window {window} of blocks {hop.start_block}:{hop.end_block}", *report.reasons)
                    self._blame(outcome, Blame(record.peer_id, index, window, record, reasons))
                    return outcome  # its output fed every later hop: the rest is not evidence
                outcome.checks["inconclusive"] += 1
                doubted = True
            if doubted and not relay:  # the first auditor's output may be the lie: it feeds no later hop
                outcome.checks["inconclusive"] += len(complete) * (len(hops) - index - 1)
                return outcome
            codec = session.output_codecs.get(hop.peer_id, "none")
            hidden = _as_received(output, codec) if index + 1 < len(hops) else output
        return outcome

    async def _reexecute(
        self, session: InferenceSession, start: int, end: int, hidden: torch.Tensor, *, exclude: set[str]
    ) -> tuple[torch.Tensor, set[str]] | None:
        """Blocks [start, end) over `hidden` (batch, tokens, hidden) as one prefill, with the audited session's LoRA
        adapter, in a fresh session on nodes other than `exclude`: (output, the nodes that ran it), or None when no
        such node answers."""
        links = session.links
        adapter = session.adapter
        config = self.model.config.replace(compression=LOSSLESS)
        for _ in range(3):
            request = ChainRequest(
                start_block=start,
                end_block=end,
                batch=hidden.shape[0],
                max_length=hidden.shape[1],
                exclude=frozenset(exclude),
                adapter=adapter,
                adapter_block_bytes=links.adapter_block_bytes,
                adapter_reachable=await self.model.adapter_reachable(adapter) if adapter is not None else None,
            )
            try:
                chain = await self.model.router.choose_chain(request)
            except NoRouteError:
                return None
            check = InferenceSession(
                self.model.swarm,
                chain,
                config,
                batch=hidden.shape[0],
                max_length=hidden.shape[1],
                adapter=adapter,
                own_adapter=links.own_adapter,
                adapter_block_bytes=links.adapter_block_bytes,
                hidden_size=self.model.model_config.hidden_size,
            )
            try:
                async with check:
                    return await check.step(hidden), set(chain.peer_ids)
            except (NesaError, LinkFailed) as error:
                logger.info("audit re-execution of blocks %d:%d failed: %s", start, end, error)
                exclude = exclude | set(chain.peer_ids)
        return None

    def tolerance(self, peer_ids: set[str]):
        """The calibrated tolerance for outputs compared across `peer_ids` (an audited node and its auditors) and
        this client's inputs: bfloat16's where any of them computes in bfloat16, or one's dtype is not known (each
        node's record says its own; the client's dtype is not the nodes', in a swarm of mixed dtypes or where the
        user chose it)."""
        dtypes = {str(self.model.dtype).removeprefix("torch.")}
        for peer_id in peer_ids:
            dtypes.update(self.model.swarm.answer_dtypes(peer_id) or ("bfloat16",))
        widest = "bfloat16" if "bfloat16" in dtypes else "float32"
        return tolerance_for(widest, widest)

    async def _confirmed(
        self, session, hop, hidden, first: torch.Tensor, record: HopRecord, tolerance, exclude
    ) -> bool:
        """Whether a re-execution on yet other nodes (not `exclude`: the audited node and the first auditors) also
        fails the record's window and agrees with the first re-execution `first` (batch, tokens, hidden): then the
        audited node, not an auditor, is at fault."""
        again = await self._reexecute(session, hop.start_block, hop.end_block, hidden, exclude=exclude)
        if again is None:
            return False
        tolerance = max(tolerance, self.tolerance(again[1]), key=lambda each: each.sketch)  # the wider
        part = again[0][:, record.token_start : record.token_end]
        committed = WindowCommitment.from_bytes(record.commitment)
        return (
            not compare(committed, part, tolerance).matches and compare(commit_window(first), part, tolerance).matches
        )


__all__ = ["BLAME_BAN_S", "AuditOutcome", "Auditor", "Blame"]
