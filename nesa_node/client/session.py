"""Client side of an inference session over a chain of nodes, async.

Direct mode (fig. 2 of the Nesa paper): the client opens one stream per node, sends each step to the first node,
every node pushes its output straight to the next, and the last node answers the client. Relay mode: the client
sends each step to every node in turn and forwards the outputs itself (kept for comparison). Caches stay on the
nodes in both modes; only hidden states of the new tokens travel.

When a node fails during a step (and a rerouter is given), the session's Failover (client/failover.py) replaces it
and the step is sent again under the same step id: nodes that already did it answer from their record, so every
cache advances exactly once. At most `max_failovers` recoveries per step, not counting one cut short by another node
of the chain found lost (a neighbour whose kept outputs it needed: that node's recovery is counted instead), and
at most twice that many in all.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import torch

from nesa_node.client.chain_links import LinkFailed, link_ended
from nesa_node.client.codec_choice import codec_for
from nesa_node.client.config import ClientConfig
from nesa_node.client.failover import Failover, Rerouter
from nesa_node.client.session_chain import Deadline, OwnAdapter, SessionChain
from nesa_node.client.swarm import Swarm
from nesa_node.compression.codec import all_finite
from nesa_node.compression.names import AUTO
from nesa_node.errors import (
    BadRequestError,
    NesaError,
    PeerUnavailableError,
    SessionStateError,
)
from nesa_node.protocol.channel import frame
from nesa_node.protocol.messages import MAX_SEALS, ErrorReply, Step, StepResult
from nesa_node.protocol.push_tag import seal_chain
from nesa_node.protocol.tensors import as_received, tensor_to_wire
from nesa_node.routing.chain import Chain
from nesa_node.verification.receipts import HopRecord, ReceiptsBuilder

logger = logging.getLogger(__name__)

MIN_STEP_DEADLINE_S = 1.0  # a decode step is ms on a healthy chain; 1 s leaves room for a GC pause (guess)


@dataclass
class StepTiming:
    wall_s: float  # client-observed time of the step
    compute_s: float  # time the nodes report spending in their blocks
    bytes_sent: int = 0  # serialized request bytes the client sent for this step
    bytes_received: int = 0  # serialized response bytes the client received for this step
    failovers: int = 0  # recoveries during this step (wall_s then spans failed step to next good step)
    codec: str = "none"  # the codec the client sent this step to the first node with (under "auto", its choice)
    # in relay mode, the codec of each node's input, which the client sends (chosen per hop); direct: the first's alone
    hop_codecs: tuple[str, ...] = ()


class InferenceSession:
    """An open inference session along a chain. One step at a time; many sessions may share one Swarm.

    Use `async with` (or open/close): `await session.step(hidden)` returns the last block's hidden states."""

    def __init__(
        self,
        swarm: Swarm,
        chain: Chain,
        config: ClientConfig,
        *,
        batch: int,
        max_length: int,
        reroute: Rerouter | None = None,
        session_id: str | None = None,
        adapter: str | None = None,
        own_adapter: OwnAdapter | None = None,
        adapter_block_bytes: float = 0.0,
        commit: bool = False,
        hidden_size: int | None = None,
    ):
        self.swarm = swarm
        self.config = config
        self.batch = batch
        self.max_length = max_length
        self.reroute = reroute
        self.session_id = session_id or uuid.uuid4().hex
        self.adapter = adapter  # LoRA adapter id (records.AdapterInfo) every node runs this session with; None: base
        self.links = SessionChain(
            swarm,
            config,
            session_id=self.session_id,
            batch=batch,
            max_length=max_length,
            adapter=adapter,
            own_adapter=own_adapter,
            adapter_block_bytes=adapter_block_bytes,
            commit=commit,
            hidden_size=hidden_size,  # the model's, when the caller knows it: every answer bounded from the first
        )
        self.commit = commit  # nodes sign hop records of each window; `fetch_records` collects them (client/audit.py)
        self.records: list[HopRecord] = []  # every record fetched, checked, in arrival order
        self.receipts = ReceiptsBuilder()
        self.step_codecs: list[str] = []  # per step, the codec the client sent it with (what the first node decoded)
        self.failover = Failover(
            self.links,
            swarm,
            reroute,
            max_replacement_attempts=config.max_open_attempts,
            probe_timeout_s=config.probe_timeout_s,
        )
        self._hops = chain.hops
        self.position = 0  # tokens the nodes' caches hold
        self.timings: list[StepTiming] = []
        # what the client sent, per step, for replay: direct mode to the first span only, relay mode to every link
        self._inputs: list[list[torch.Tensor]] = []  # [link][step] (batch, seq, hidden)
        self._opened = self._closed = False
        self._stepping = False  # a step is under way: the answers of the chain belong to it
        self._broken: str | None = None  # why no step may be sent any more (a prompt failed part-way)
        self._sent_codecs: list[str] = []  # the last step's, per node the client fed
        self._step_codecs: tuple[str, dict] = ("", {})  # (step id, codec per peer it was sent to)
        # (step id, per attempt of it: the chain's peer ids, the step's tokens a row, the seals sent with it)
        self._seals_sent: tuple[str, list] = ("", [])
        # per peer fed by the client: (step id, what identified the content last sent it under that id (position,
        # codec, tensor as sent: what a node compares a step id's content by), that input, whether the client ever
        # sent it other content under that id: a step interrupted and taken again, a relay input recomputed upstream)
        self._fed: dict[str, tuple[str, tuple, torch.Tensor, bool]] = {}
        self._taken: dict[str, int] = {}  # per peer fed by the client: the most tokens (rows x seq) of a step it took

    @property
    def chain(self) -> Chain:
        return Chain(hops=self.links.hops or self._hops)

    @property
    def failovers(self) -> list[dict]:
        """One entry per recovery: failed peer, replacements, blocks, position, seconds, bans, phases."""
        return self.failover.recoveries

    @property
    def output_codecs(self) -> dict[str, str]:
        """Per node of the chain, the codec it sends its outputs with (chosen at open; "auto" resolved per hop)."""
        return dict(self.links.output_codecs)

    @property
    def mode(self) -> str:
        return self.config.mode

    # ---- lifecycle ---------------------------------------------------------------------------------------------------

    async def open(self) -> InferenceSession:
        """Open a stream on every node of the chain and wait for each to reserve its cache. Raises LinkFailed naming
        a node that failed, or the RequestError a node refused with (`peer_id` set)."""
        limit_s = self.swarm.request_timeout_s * 2
        try:
            async with asyncio.timeout(limit_s):
                self.links.links = await self.links.open_segment(self._hops, self.swarm.peer_id, None)
                await self.links.connect_client_lanes()
        except TimeoutError:
            await self.close()
            raise PeerUnavailableError(f"the chain did not open within {limit_s} s") from None
        except BaseException:
            await self.close()
            raise
        self._opened = True
        self.swarm.open_sessions.add(self)
        if self.config.compression.name == AUTO:  # "auto" needs the bandwidth of the client's own links
            self.swarm.measure_bandwidths_soon([self.links.links[0].peer_id, self.links.links[-1].peer_id])
        return self

    async def fetch_records(self, final: bool = False) -> list[HopRecord]:
        """Fetch the chain's new signed hop records (`final`: the windows under way closed first), keep them in
        `records` and `receipts`, and return them. Between steps only. ReceiptError (its `peer_id` set) for a node
        whose records are not its own or not of this session."""
        if not self.commit:
            raise SessionStateError('this session was opened without hop records (verify="audit:...")')
        if self._stepping:
            raise SessionStateError("records are fetched between steps")
        fetched = []
        for link in self.links.links:
            der, records = await self.links.records(link, final=final, position=self.position)
            for record in records:
                self.receipts.add(record, der)
            fetched.extend(records)
        self.records.extend(fetched)
        return fetched

    async def close(self) -> None:
        if self._closed:
            return
        if self.commit and self._opened and not self._stepping:
            try:  # the last windows' records, while the nodes still hold the session
                await self.fetch_records(final=True)
            except (NesaError, LinkFailed) as error:
                logger.info("session %s: final hop records not fetched: %s", self.session_id, error)
        self._closed = True
        self.swarm.open_sessions.discard(self)
        await self.links.close()
        self.swarm.refresh_soon()  # the next session's routing finds recent records without waiting for a read

    async def __aenter__(self) -> InferenceSession:
        return await self.open() if not self._opened else self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # ---- steps -------------------------------------------------------------------------------------------------------

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run the new tokens' hidden states (batch, seq, hidden) through the chain; returns the last block's."""
        if self._closed or not self._opened:
            raise SessionStateError("the inference session is not open")
        if self._broken is not None:
            raise SessionStateError(self._broken)
        if self._stepping:
            raise SessionStateError("a step is already under way on this session: steps go one at a time")
        if hidden.shape[0] != self.batch:
            raise SessionStateError(f"session opened for batch {self.batch}, got {hidden.shape[0]} rows")
        if hidden.dim() >= 2 and hidden.shape[1] == 0:
            raise SessionStateError("a step takes at least one token")
        if self.position + hidden.shape[1] > self.max_length:
            raise SessionStateError(
                f"{self.position + hidden.shape[1]} tokens exceed the session's max_length {self.max_length}"
            )
        self._stepping = True
        try:
            if hidden.shape[1] == 1:
                return await self._step_with_failover(hidden)
            outputs, done = [], 0
            while done < hidden.shape[1]:  # a prompt longer than the chain takes a step goes in steps it takes
                tokens = hidden.shape[1] - done
                if (bound := self._chain_step_tokens()) and hidden.shape[0] * tokens > bound:
                    tokens = max(1, bound // hidden.shape[0])
                try:
                    outputs.append(await self._step_with_failover(hidden[:, done : done + tokens]))
                except BaseException as exc:
                    if done:  # the nodes took part of the prompt: the session cannot take it again, nor go on
                        self._broken = (
                            f"this session failed after its nodes took {done} of a prompt's {hidden.shape[1]} tokens "
                            f"({type(exc).__name__}): open another session"
                        )
                    raise
                done += tokens
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        finally:
            self._stepping = False

    def _chain_step_tokens(self) -> int:
        """Rows x tokens of the largest step every node of the chain takes (`SessionChain.step_tokens`: announced, or
        the floor the session asked; each node is sent the whole step, in either mode); 0 when there is no bound.
        Asked again for each part of a long prompt: a replacement may announce a smaller one."""
        bounds = [bound for link in self.links.links if (bound := self.links.step_tokens(link))]
        return min(bounds, default=0)

    async def _step_with_failover(self, hidden: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        failovers = charged = 0  # recoveries this step; those counted against max_failovers
        deadline_s = self.deadline(hidden.shape[0] * hidden.shape[1])
        # what a replacement must take at once: this step (a prompt's part), and what any node of the chain must
        step_tokens = max(
            hidden.shape[0] * hidden.shape[1] if hidden.shape[1] > 1 else 0,
            self.links.floor_tokens(),
        )
        failure: LinkFailed | None = None
        kept = False
        while True:
            recovering = False
            try:
                # a replacement that fails while its cache is rebuilt fails like any node; a chain kept (slow, not
                # gone: see Failover.recover) gets the step again, once a step. Either way the step sent again gets
                # the request timeout: the kept chain was slow, and a replacement's first step is a cold one (new
                # channels to and from it, its first compute), which a deadline of recent warm steps would take for
                # a failure of the replacement
                if failure is not None:
                    recovering = True
                    if not await self.failover.recover(
                        failure, position=self.position, inputs=self._inputs, may_keep=not kept, step_tokens=step_tokens
                    ):
                        kept = True
                    recovering = False
                    deadline_s = max(deadline_s, self.swarm.request_timeout_s)
                output, compute_s, sent, received, inputs = await self._step(hidden, deadline_s)
                break
            except LinkFailed as failed:
                named = failure.link.peer_id if failure is not None and failure.link is not None else None
                if recovering and failed.link is not None and failed.link.peer_id != named:
                    # the recovery under way was cut short by another node lost (a neighbour whose outputs it
                    # needed): that node's recovery is counted, this one is tried again after it
                    charged -= 1
                limit = self.config.max_failovers
                if self.reroute is None or charged >= limit or failovers >= 2 * limit:
                    raise PeerUnavailableError(f"{failed.message} (no failover left)") from None
                failovers += 1
                charged += 1
                failure = failed
        wall_s = time.perf_counter() - started
        if failovers == 0 and hidden.shape[1] == 1:  # a decode step through an unchanged chain
            self._measure_nodes(wall_s)
        self.timings.append(
            StepTiming(
                wall_s=wall_s,
                compute_s=compute_s,
                bytes_sent=sent,
                bytes_received=received,
                failovers=failovers,
                codec=self._sent_codecs[0] if self._sent_codecs else "none",
                hop_codecs=tuple(self._sent_codecs),
            )
        )
        self.step_codecs.append(self.timings[-1].codec)
        if self.reroute is not None or self.commit:  # replayed into a replacement of a span that fails; audits
            if not self._inputs:
                self._inputs = [[] for _ in inputs]
            for history, sent_input in zip(self._inputs, inputs, strict=True):
                history.append(sent_input.detach().clone())
        self.position += hidden.shape[1]
        return output

    def _measure_nodes(self, wall_s: float) -> None:
        """Give the swarm's per-node timings this step: its wall time less the client's round trips to the chain's
        ends (Swarm.step_rtt_ms: the network's, not the nodes' answers; client/timings.py splits the rest among the
        nodes)."""
        hops = [(link.peer_id, link.hop.end_block - link.hop.start_block) for link in self.links.links]
        if not hops:
            return
        legs_ms = (self.swarm.step_rtt_ms(hops[0][0]) + self.swarm.step_rtt_ms(hops[-1][0])) / 2
        # a round trip measured at a busy moment can exceed a whole step: the ends are pinged again (the least ping
        # is kept), and meanwhile a step is never charged below a quarter of its wall time, so every step still counts
        floor_ms = wall_s * 1000.0 / 4
        if wall_s * 1000.0 - legs_ms < floor_ms:
            self.swarm.recheck_rtts_soon([hops[0][0], hops[-1][0]])
        compute_ms = max(wall_s * 1000.0 - legs_ms, floor_ms)
        self.swarm.timings.observe(hops, compute_ms, 1, self.swarm.believed_block_ms)

    def deadline(self, tokens: int) -> float:
        """Seconds a step may take before the chain is presumed broken (a node killed mid-step may leave its
        stream open). Given, or: for a decode step once a few are measured, 10x the slowest recent one that went
        through no recovery (a kept chain's step waited out a deadline) and at least MIN_STEP_DEADLINE_S, at most the
        request timeout; the request timeout otherwise (prefill can be slow), and always where no failover would take
        the step again (no rerouter, or max_failovers 0: canary checks, audits' re-executions, sessions on a fixed
        chain): there a short deadline would only turn a node held up for a moment into a failed session."""
        if self.config.step_timeout_s is not None:
            return self.config.step_timeout_s
        if self.reroute is None or self.config.max_failovers <= 0:
            return self.swarm.request_timeout_s
        recent = [timing.wall_s for timing in self.timings[-8:] if timing.failovers == 0]
        if tokens <= 8 and len(recent) >= 3:
            return min(self.swarm.request_timeout_s, max(MIN_STEP_DEADLINE_S, 10 * max(recent)))
        return self.swarm.request_timeout_s

    async def _step(
        self, hidden: torch.Tensor, deadline_s: float
    ) -> tuple[torch.Tensor, float, int, int, list[torch.Tensor]]:
        """One step through the chain: (output, compute seconds, bytes sent, bytes received, the input the client
        sent to each link it feeds, as that node decoded it: the first in direct mode, all in relay mode)."""
        step_id = f"{self.session_id}:{self.position}"  # the same on a retry: nodes that did it answer from record
        links = self.links.links
        relay = not self.links.direct
        fed = links if relay else links[:1]
        compute_s, sent, received, inputs = 0.0, 0, 0, []
        if self._step_codecs[0] != step_id:
            self._step_codecs = (step_id, {})
        chosen = self._step_codecs[1]  # a step sent again keeps its codec: a node refuses a step id's other content
        self._sent_codecs = []
        for link in fed:
            codec = chosen.get(link.peer_id) or codec_for(
                None,
                link.hop,
                self.config.compression,
                elements=hidden.numel(),
                bandwidth_mbps=self.swarm.bandwidth_mbps(link.peer_id, None),
                lossless_bits=8 * hidden.element_size(),
            )
            tensor, codec = tensor_to_wire(hidden, codec)  # lossless where the codec cannot carry these values
            # kept as the node decodes it: a replacement of the node replays exactly what it saw
            inputs.append(as_received(hidden, tensor, codec))
            chosen[link.peer_id] = codec
            self._sent_codecs.append(codec.name)
            # in a direct chain, the seals of this step for the nodes after the first (protocol/push_tag.py)
            seals = {} if relay or len(links) < 2 else {"seals": self._seal(links, step_id, hidden.shape[1])}
            request = frame(Step(step_id=step_id, position=self.position, codec=codec, **seals), [tensor])
            self._note_fed(link.peer_id, step_id, (self.position, codec, tensor), hidden)
            sent += request.ByteSize()
            try:
                link.send_step(request)
            except PeerUnavailableError as exc:
                if (said := self.links.said(link)) is not None:  # the node said why it closed (ended the session)
                    self._raise_step_error(link, *said, step_id=step_id, fed=link, shape=tuple(hidden.shape))
                raise LinkFailed(f"channel to {link.peer_id} closed: {exc.message}", link) from None
            expected = link if relay else links[-1]
            until = Deadline.after(deadline_s)  # for this answer, however many others come first
            while True:
                answered, message, answer = await self.links.next_answer(until)
                self._raise_step_error(answered, message, answer, step_id=step_id, fed=link, shape=tuple(hidden.shape))
                if answered is expected and isinstance(message, StepResult) and message.step_id == step_id:
                    break
            received += answer.ByteSize()
            self._taken[link.peer_id] = max(self._taken.get(link.peer_id, 0), hidden.shape[0] * hidden.shape[1])
            hidden = self.links.read_hidden(answered, answer, message.codec, hidden.numel(), tuple(hidden.shape))
            compute_s += message.compute_s
        return hidden, compute_s, sent, received, inputs

    def _raise_step_error(self, answered, message, answer, *, step_id: str, fed, shape: tuple[int, ...]) -> None:
        """A node's refusal as the typed error it names. A node that could not push a step to its next node reports
        peer_unavailable: that next node failed. A node that ended the session (preempted it: idle, or holding lent cache; or did not
        compute a step within its step timeout) or cannot grow its cache for it failed itself: it is replaced like a
        lost node. A node of a direct chain that refuses the pushed step `step_id` (of `shape`) accuses the node
        that pushed it: the pushed step it returns under the pusher's tag (protocol/push_tag.py) shows which of the two
        is at fault; without it, the pusher's record of its outputs is checked before either is blamed
        (Failover.judge). A refusal of another step (an earlier one's, answered or failed since), or of a push of an
        earlier attempt of this step (its seals show it), is stale: passed over, as is, in relay mode, any refusal
        from a node other than `fed` (the one the client is sending this step's input: the first node, or each in
        turn in relay mode; the others answered it already or were not sent it). `fed` refusing the step although the input passes every check an honest node makes failed
        (`_own_input_sane`): it is replaced, the user's request not refused; and so is a node of a direct chain
        refusing a step for anything but its input (an unknown session, an adapter it no longer has)."""
        if not isinstance(message, ErrorReply):
            return
        error = message.error()
        if (ended := link_ended(error, answered)) is not None:
            raise ended  # this node dropped the session, or has no room
        links = self.links.links
        index = links.index(answered) if answered in links else -1
        if not isinstance(error, PeerUnavailableError):
            if answered is fed and message.step_id is None:  # about no step: this one is all the client awaits
                raise LinkFailed(f"{answered.peer_id} refused ({error.code}): {error.message}", answered)
            if message.step_id != step_id or index < 0 or (answered is not fed and not self.links.direct):
                return  # stale, or from a node with nothing of this step's to refuse
            if answered is fed:
                if self._own_input_sane(answered, step_id):
                    refused = f"{answered.peer_id} refused a well-formed step ({error.code}): {error.message}"
                    raise LinkFailed(refused, answered)
                raise error  # the caller's input: the caller's error
            if not isinstance(error, BadRequestError):
                raise LinkFailed(f"{answered.peer_id} refused the step ({error.code}): {error.message}", answered)
        if isinstance(error, BadRequestError) and self.links.direct and index > 0:
            # in a direct chain a node's input is its previous node's output, pushed with its step: a refused one
            # (NaN, a wrong shape) is that node's fault, if the refusing node tells the truth
            accused, accuser = links[index - 1], links[index]
            attempts = self._seals_sent[1] if self._seals_sent[0] == step_id else []
            claimed = _claimed_attempt(attempts, accused.peer_id, message.evidence)
            tokens = shape[1] if claimed is None else attempts[claimed][1]  # that attempt's step's tokens a row
            expected = Step(step_id=step_id, position=self.position)
            shown = self.links.pushed_malformed(
                accused, message, answer, expected=expected, shape=(shape[0], tokens, shape[2])
            )
            if shown is False and attempts:
                # the pusher's own input was sealed with the step, so it pushes on exactly the seals the client sent
                # after it: others are its doing. Those of an earlier attempt of the step (before a failover changed
                # the chain after it) are genuine, its push then too: the refusal is stale, the attempt under way follows
                if claimed is None:
                    shown = True
                elif claimed != len(attempts) - 1:
                    return
            if shown is True:  # what the accused pushed, under its own tag: its fault
                refused = f"{accuser.peer_id} refused its input, which {accused.peer_id}'s own tag shows malformed"
                raise LinkFailed(f"{refused}: {error.message}", accused, fault=True)
            if shown is False:  # a well-formed input under the pusher's tag: the refusing node failed
                raise LinkFailed(f"{accuser.peer_id} refused a well-formed input: {error.message}", accuser)
            refused = f"{accuser.peer_id} refused its input: {error.message}"
            raise LinkFailed(refused, accused, accuser=accuser, through=self.position + shape[1])
        # only peer_unavailable is left here: every other refusal was passed over or raised above
        if self.links.direct and 0 <= index < len(links) - 1:  # its word about its next node (Failover.weigh_report)
            raise LinkFailed(error.message, links[index + 1], reporter=answered)
        raise LinkFailed(error.message, answered)

    def _seal(self, links: list, step_id: str, tokens: int) -> tuple[str, ...]:
        """The seals of step `step_id` of `tokens` tokens a row for the nodes after the first of a direct chain
        (protocol/push_tag.py), noted with the others sent under that id."""
        if len(links) - 1 > MAX_SEALS:
            raise BadRequestError(f"a direct chain holds at most {MAX_SEALS + 1} nodes, not {len(links)}: use relay")
        seals = seal_chain([link.push_key for link in links[1:]], step_id, self.position, tokens)
        if self._seals_sent[0] != step_id:
            self._seals_sent = (step_id, [])
        self._seals_sent[1].append((tuple(link.peer_id for link in links), tokens, seals))
        return seals

    def _note_fed(self, peer_id: str, step_id: str, content: tuple, hidden: torch.Tensor) -> None:
        """Note the input sent to `peer_id` under `step_id`, with what identifies its content (`content`: position,
        codec and the tensor message as sent), and whether other content went to it under that id before."""
        record = self._fed.get(peer_id)
        changed = record is not None and record[0] == step_id and (record[3] or record[1] != content)
        self._fed[peer_id] = (step_id, content, hidden, changed)
        if len(self._fed) > len(self.links.links):  # peers replaced since: nothing more is sent them
            current = {link.peer_id for link in self.links.links} | {peer_id}
            self._fed = {peer: record for peer, record in self._fed.items() if peer in current}

    def _own_input_sane(self, link, step_id: str) -> bool:
        """Whether the input this client sent `link` under `step_id` passes every check an honest node makes of it:
        three dimensions, finite, of the model's width (once known) and the session's rows, within its max_length
        (`step` checked those two), the only content the client sent it under that id, and no more tokens (rows x
        seq) than the node takes (`SessionChain.step_tokens`: what it announces, or for a node announcing nothing the
        floor the session asks of its chain; a client splits longer prompts) or than in a step it took before, or one token a
        row (a node refuses at open a batch over its step limit). So a node cannot make a prompt the user's error by
        announcing no limit. A longer step (with min_step_tokens 0, to a node announcing none) may be refused
        honestly: the caller's error."""
        record = self._fed.get(link.peer_id)
        if record is None or record[0] != step_id or record[3]:
            return False
        sent, known = record[2], self.links.hidden_size
        if sent.dim() != 3 or known is None:
            return False
        rows, tokens, width = sent.shape
        within = tokens == 1 or rows * tokens <= max(self._taken.get(link.peer_id, 0), self.links.step_tokens(link))
        return width == known and rows > 0 and within and all_finite(sent)


def _claimed_attempt(attempts: list, peer_id: str, evidence: Step | None) -> int | None:
    """The latest of a step's `attempts` (peer ids, tokens, seals) in which the seals after `peer_id` are those of
    the step `evidence` it pushed; None if there is none."""
    for number in range(len(attempts) - 1, -1, -1):
        peers, _, seals = attempts[number]
        if evidence is not None and peer_id in peers and seals[peers.index(peer_id) :] == evidence.seals:
            return number
    return None


__all__ = ["MIN_STEP_DEADLINE_S", "InferenceSession", "StepTiming"]
