"""Majority verification (verify="majority:N"): each span of a chain is run by N disjoint replicas and the client
accepts an output only when a strict majority of the replicas agree with it.

Seed 000's scheme (redundant replicas of a split, majority vote), with the strict-majority rule: an output is
accepted when the replicas whose outputs agree with it, itself included, are more than N / 2. Read literally, the
seed's rule let one cheater void two honest replicas; with this one, one cheater among three is outvoted, two
cheaters that disagree with each other and with the honest replica give no consensus (NoConsensusError, the step
not taken), and two cheaters that collude on an identical output win: majority voting holds only while honest
replicas are the majority, which nothing here can check.

The client relays between spans: each voted span is N single-span sessions (InferenceSession over the chain's hop
for those blocks, or a sub-chain of nodes covering them, chosen disjoint from the other replicas), each step is
sent to all N at once, and the winning output goes on to the next span; consecutive spans outside the voted blocks
run as one direct sub-chain. A replica that is outvoted is banned, closed and counted; a replica whose session fails
for good counts as disagreeing from then on. The cost is N times the compute of the voted spans, and one round trip
per span (relayed).

Agreement: two outputs agree when their largest elementwise difference is within `tolerance` times the RMS of
the first (honest replicas on one dtype differ only by the order of float sums, when they batch decode steps
differently; bench/verify.py measures it), the tolerance of the widest dtype among the replicas (their records) and
the client. Replica answers are compared before any lossy codec: the voted sessions ask for lossless answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field, replace

import torch

from nesa_node.client.session import InferenceSession
from nesa_node.errors import NoConsensusError, NoRouteError, SessionStateError
from nesa_node.protocol.tensors import WireCodec
from nesa_node.routing.chain import Chain, ChainRequest

logger = logging.getLogger(__name__)

# largest difference / RMS at which two replica outputs agree, by the dtype the nodes compute in
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 2e-2}


def agree(first: torch.Tensor, second: torch.Tensor, tolerance: float) -> bool:
    """Whether two outputs (batch, seq, hidden) agree: same shape, max |first - second| <= tolerance * RMS(first)."""
    if first.shape != second.shape:
        return False
    first, second = first.float(), second.float()
    scale = first.pow(2).mean().sqrt().item()
    return (first - second).abs().max().item() <= tolerance * max(scale, 1e-12)


def vote(outputs: list[torch.Tensor | None], tolerance: float) -> tuple[int, list[int]] | None:
    """The strict-majority winner of replica `outputs` (None: a replica that gave no output): (index of an output
    backed by more than len(outputs) / 2 replicas, itself included; the indices that agree with it), or None when no
    output has such backing."""
    count = len(outputs)
    for index, output in enumerate(outputs):
        if output is None:
            continue
        backing = [
            other
            for other, candidate in enumerate(outputs)
            if candidate is not None and agree(output, candidate, tolerance)
        ]
        if 2 * len(backing) > count:
            return index, backing
    return None


@dataclass
class VotedSpan:
    """One span of the chain: its blocks and its replicas' sessions (one, not voted, outside the voted blocks)."""

    start_block: int
    end_block: int
    replicas: list[InferenceSession | None]
    voted: bool
    outvoted: list[str] = field(default_factory=list)  # peer ids of replicas outvoted so far


class MajoritySession:
    """A session whose voted spans run on N disjoint replicas each (see the module docstring). Has the methods of
    an InferenceSession that generation uses: step, position, max_length, batch, chain, close."""

    def __init__(self, spans: list[VotedSpan], swarm, *, replicas: int, tolerance: float, max_length: int, batch: int):
        self.spans = spans
        self.swarm = swarm
        self.replicas = replicas
        self.tolerance = tolerance
        self.max_length = max_length
        self.batch = batch
        self.position = 0
        self.checks = {"agreed": 0, "outvoted": 0, "no_consensus": 0}  # voted span steps by result
        self._broken: str | None = None  # why no step may be sent any more (a step failed after spans took it)

    @property
    def chain(self) -> Chain:
        """The chain of the first replica of every span."""
        hops = []
        for span in self.spans:
            first = next((session for session in span.replicas if session is not None), None)
            if first is not None:
                hops.extend(first.chain.hops)
        return Chain(hops=tuple(hops))

    @property
    def failovers(self) -> list[dict]:
        return [entry for span in self.spans for session in span.replicas if session for entry in session.failovers]

    @property
    def timings(self) -> list:
        first = self.spans[0].replicas[0]
        return first.timings if first is not None else []

    @property
    def verification(self) -> dict:
        """What the checks found: the mode, the voted blocks, checks by result, outvoted peers."""
        return {
            "mode": f"majority:{self.replicas}",
            "voted_blocks": [[span.start_block, span.end_block] for span in self.spans if span.voted],
            "checks": dict(self.checks),
            "outvoted": sorted({peer for span in self.spans for peer in span.outvoted}),
        }

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run the new tokens' hidden states (batch, seq, hidden) through every span, voting on the voted ones;
        NoConsensusError when a voted span's replicas have no strict majority (the session cannot go on)."""
        if self._broken is not None:
            raise SessionStateError(self._broken)
        if hidden.dim() != 3 or hidden.shape[0] != self.batch or hidden.shape[1] == 0:  # the caller's, no replica's
            shape = tuple(hidden.shape)
            raise SessionStateError(f"a step takes hidden states (batch {self.batch}, 1+ tokens, hidden), got {shape}")
        if self.position + hidden.shape[1] > self.max_length:
            raise SessionStateError(
                f"{self.position + hidden.shape[1]} tokens exceed the session's max_length {self.max_length}"
            )
        try:
            for span in self.spans:
                hidden = await (self._vote_step(span, hidden) if span.voted else span.replicas[0].step(hidden))
        except BaseException as exc:
            moved = [session for span in self.spans for session in span.replicas if session is not None]
            if any(session.position != self.position for session in moved):  # some spans took the step: the
                # session's spans no longer hold the same tokens, and a step sent again would be taken twice
                self._broken = f"this session failed after some of its spans took a step ({type(exc).__name__}): "
                self._broken += "open another session"
            raise
        self.position += hidden.shape[1]
        return hidden

    async def _vote_step(self, span: VotedSpan, hidden: torch.Tensor) -> torch.Tensor:
        live = [(index, session) for index, session in enumerate(span.replicas) if session is not None]
        answers = await asyncio.gather(*(session.step(hidden) for _, session in live), return_exceptions=True)
        outputs: list[torch.Tensor | None] = [None] * len(span.replicas)
        for (index, session), answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, Exception):
                    raise answer
                logger.info(
                    "replica %s of blocks %d:%d failed: %s",
                    session.chain.peer_ids,
                    span.start_block,
                    span.end_block,
                    answer,
                )
                await self._drop(span, index)
            else:
                outputs[index] = answer
        result = vote(outputs, self.tolerance)
        if result is None:
            self.checks["no_consensus"] += 1
            peers = tuple(peer for session in span.replicas if session for peer in session.chain.peer_ids)
            raise NoConsensusError(
                f"the {len(span.replicas)} replicas of blocks {span.start_block}:{span.end_block} disagree: no output "
                f"has a strict majority",
                peer_ids=peers,
            )
        winner, backing = result
        losers = [index for index, output in enumerate(outputs) if output is not None and index not in backing]
        self.checks["outvoted" if losers else "agreed"] += 1
        for index in losers:
            session = span.replicas[index]
            peers = session.chain.peer_ids
            logger.warning("outvoted on blocks %d:%d: %s (banned)", span.start_block, span.end_block, ", ".join(peers))
            span.outvoted.extend(peers)
            # a replica of one node: that node computed it. Of several (a sub-chain), which of them did is not known:
            # each is banned for a failure only (lifted early when needed), so a throwaway identity that joins an
            # honest node's sub-chain and loses the vote on purpose cannot have that node banned for a fault
            alone = len(peers) == 1
            for peer in peers:
                self.swarm.ban(peer, base_s=600.0 if alone else 15.0, fault=alone)
            await self._drop(span, index)
        return outputs[winner]

    async def _drop(self, span: VotedSpan, index: int) -> None:
        session, span.replicas[index] = span.replicas[index], None
        if session is not None:
            with contextlib.suppress(Exception):
                await session.close()

    async def close(self) -> None:
        for span in self.spans:
            for index in range(len(span.replicas)):
                await self._drop(span, index)

    async def __aenter__(self) -> MajoritySession:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


async def open_majority_session(
    model,
    chain: Chain,
    *,
    replicas: int,
    voted_blocks: tuple[int, int] | None,
    batch: int,
    max_length: int,
    adapter: str | None,
    adapter_block_bytes: float,
) -> MajoritySession:
    """Open a MajoritySession over `chain` (chosen by `model`, an AsyncDistributedModel): its hops that overlap
    `voted_blocks` (default: all) get `replicas` disjoint replicas each. NoRouteError when a span has too few
    disjoint nodes."""
    lossless = model.config.replace(compression=WireCodec("none"))
    spans: list[VotedSpan] = []
    plain: list = []  # consecutive hops outside the voted blocks, run as one sub-chain

    def voted(hop) -> bool:
        if voted_blocks is None:
            return True
        return hop.start_block < voted_blocks[1] and voted_blocks[0] < hop.end_block

    def session_on(hops, config, reroute) -> InferenceSession:
        return InferenceSession(
            model.swarm,
            Chain(hops=tuple(hops)),
            config,
            batch=batch,
            max_length=max_length,
            reroute=reroute,
            adapter=adapter,
            own_adapter=model.own_adapters.get(adapter) if adapter is not None else None,
            adapter_block_bytes=adapter_block_bytes,
            hidden_size=model.model_config.hidden_size,
        )

    def flush_plain() -> None:
        if plain:
            session = session_on(plain, model.config, model.router.reachable_chain)
            spans.append(VotedSpan(plain[0].start_block, plain[-1].end_block, [session], voted=False))
            plain.clear()

    for hop in chain.hops:
        if not voted(hop):
            plain.append(hop)
            continue
        flush_plain()
        chains = [(hop,)]
        used = {hop.peer_id}
        for _ in range(replicas - 1):
            request = ChainRequest(
                start_block=hop.start_block,
                end_block=hop.end_block,
                batch=batch,
                max_length=max_length,
                step_tokens=model.config.step_tokens(batch, max_length),
                exclude=frozenset(used),
                adapter=adapter,
                adapter_block_bytes=adapter_block_bytes,
            )
            try:
                other = await model.router.reachable_chain(request)
            except NoRouteError as error:
                raise NoRouteError(
                    f"majority:{replicas} needs {replicas} disjoint replicas of blocks {hop.start_block}:"
                    f"{hop.end_block}; found {len(chains)} ({error})"
                ) from None
            chains.append(other.hops)
            used.update(item.peer_id for item in other.hops)

        def disjoint_reroute(request: ChainRequest, mine=frozenset(), used=frozenset(used)):
            return model.router.reachable_chain(replace(request, exclude=request.exclude | (used - mine)))

        sessions = [
            session_on(
                hops, lossless, lambda request, mine=frozenset(h.peer_id for h in hops): disjoint_reroute(request, mine)
            )
            for hops in chains
        ]
        spans.append(VotedSpan(hop.start_block, hop.end_block, list(sessions), voted=True))
    flush_plain()
    # the widest of the dtypes the replicas compute in (each node's record says its own; one not known counts as
    # bfloat16) and the client's: a bfloat16 replica beside float32 ones is held to bfloat16's rounding
    dtypes = {str(model.dtype).removeprefix("torch.")}
    for span in spans:
        for replica in span.replicas if span.voted else ():
            for peer_id in replica.chain.peer_ids:
                dtypes.update(model.swarm.answer_dtypes(peer_id) or ("bfloat16",))
    session = MajoritySession(
        spans,
        model.swarm,
        replicas=replicas,
        tolerance=max(TOLERANCE.get(dtype, TOLERANCE["bfloat16"]) for dtype in dtypes),
        max_length=max_length,
        batch=batch,
    )
    try:
        for span in spans:
            await asyncio.gather(*(replica.open() for replica in span.replicas))
    except BaseException:
        await session.close()
        raise
    return session


__all__ = ["TOLERANCE", "MajoritySession", "agree", "open_majority_session", "vote"]
