"""Client failover of an inference session: when a node of the chain fails, ban it, route a replacement for exactly
its span, rebuild the replacement's KV cache by replaying the span's input history, point the neighbours at it, and
let the session retry the step under the same step id (README, "Client SDK"; RELIABILITY.md A).

A replacement that fails or refuses its open or replay, for whatever reason (dead, full, moved, or an id someone
else holds there), is banned and the next candidate tried: a refusal is a typed answer, but for this span it ends
that node's chance just as silence does (RELIABILITY.md G5).

A node that went quiet (the step's deadline passed and it missed the short probe) while no other node can take its
span is asked again with a longer probe before the session gives up: a node on a loaded host (a flood of DHT stores,
a busy machine) is slow, not gone. If it answers, it is not banned and the chain stays as it is: the session sends
the step again under the same step id and waits longer for it. A node named by the failure (its channel broke, or it
failed the step) that no other node can replace gets the same longer probe: if it answers, the session opens there
again, as on a replacement (a node ends its owner's old session of the same id at the reopen). A node that sent
something wrong never gets either chance.

`Failover` works on the session's links only through SessionChain (client/session_chain.py); it gets the rest of the
session's state (position, the inputs the client kept) as arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from nesa_node.client.bans import ACCUSATIONS_TO_BLAME
from nesa_node.client.chain_links import ChainLink, LinkFailed, link_ended
from nesa_node.client.open_refusals import ADAPTER_REFUSALS
from nesa_node.client.routing import LAST_NODES_PROBE_FACTOR
from nesa_node.client.session_chain import SessionChain
from nesa_node.client.swarm import Swarm
from nesa_node.errors import (
    BadRequestError,
    CacheBudgetError,
    NoRouteError,
    PeerUnavailableError,
    QuotaExceededError,
    RequestError,
)
from nesa_node.protocol.messages import ErrorReply, LaneSettings, Retarget
from nesa_node.routing.chain import ChainRequest, Hop

logger = logging.getLogger(__name__)

# how long an accused node may take to show the outputs of the step it was accused over (the step may still be
# on its way to it through the chain: a step time, seconds at most; guess)
JUDGE_WAIT_S = 5.0


# a chain for a block range, banned peers excluded (Router.reachable_chain: its nodes answered a ping just now)
Rerouter = Callable[[ChainRequest], Awaitable]


def _with_cause(no_route: NoRouteError, lost: Hop, failure: LinkFailed) -> NoRouteError:
    """The NoRouteError of a failover that found no replacement, saying what the lost node failed with (its room for
    the session, say): the route's message alone names the node only as banned."""
    return NoRouteError(
        f"{no_route.message}; the session lost {lost.peer_id[-8:]} (blocks {lost.start_block}:{lost.end_block}) to: "
        f"{failure.message}"
    )


class Failover:
    """Recovery from a failed node of one session's chain (see the module docstring)."""

    def __init__(
        self,
        chain: SessionChain,
        swarm: Swarm,
        reroute: Rerouter,
        *,
        max_replacement_attempts: int,
        probe_timeout_s: float = 1.0,
    ):
        self.chain = chain
        self.swarm = swarm
        self.reroute = reroute
        # replacements tried for one lost span: records of crashed nodes linger until they expire, so a failover
        # during churn can meet several dead nodes in a row; each is banned and the next one tried
        self.max_replacement_attempts = max_replacement_attempts
        self.probe_timeout_s = probe_timeout_s  # asking a node for its NodeInfo, to find which of a silent chain died
        self.recoveries: list[dict] = []  # one entry per recovery: failed peer, replacements, seconds, phases
        self._phases: dict[str, float] = {}  # seconds per phase of the recovery in progress (see _timed)
        self._passed_over: set[str] = set()  # of the recovery in progress: replacements left out, not banned

    @contextlib.contextmanager
    def _timed(self, phase: str):
        """Add the time spent in the block to `phase` of the recovery in progress (its entry's "phases")."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._phases[phase] = self._phases.get(phase, 0.0) + time.perf_counter() - started

    async def recover(
        self,
        failure: LinkFailed,
        *,
        position: int,
        inputs: list[list[torch.Tensor]],
        may_keep: bool = True,
        step_tokens: int = 0,
    ) -> bool:
        """Replace the failed node. `position`: tokens the nodes' caches hold; `inputs`: what the client sent per link
        and step (the first link's in direct mode, every link's in relay mode), updated for replaced links in relay
        mode; `step_tokens`: rows x tokens of the step to be sent again (a replacement must announce it takes that many,
        or announce no limit when that is within the session's floor). Returns True when the node was replaced, False
        when the chain was kept (only if `may_keep`): it went quiet yet every node answers the probe, or the node that
        did not had no other node to take its span and answered the longer probe; the step is to be sent again. Raises
        NoRouteError when no node can take the span, LinkFailed when every replacement failed, PeerUnavailableError when
        the chain went quiet yet every node still answers (and it may not be kept), or a replacement took over four
        request timeouts to set up."""
        started = time.perf_counter()
        self._phases = {}
        chain = self.chain
        if failure.accuser is not None:
            with self._timed("judge"):
                failure = await self.judge(failure)
        elif failure.reporter is not None:
            with self._timed("judge"):
                failure = await self.weigh_report(failure)
        with self._timed("find"):
            index = await self._find_failed(failure)
        if index is not None and failure.link is None and chain.links[index].closed:
            failure = LinkFailed(failure.message, chain.links[index])  # its session is over: not a slow chain to keep
        if index is None:
            if not may_keep:
                # one of them takes steps and never answers them, which no probe tells: each gets a failure's ban
                # (lifted when no chain is left without it: client/routing.py), so the next session is not routed
                # through the same chain at once
                for link in chain.links:
                    self.swarm.ban(link.peer_id)
                raise PeerUnavailableError(f"{failure.message}; every node of the chain still answers")
            logger.info("the chain went quiet (%s) yet every node answers: kept", failure)
            self._record(None, [], position, started, kept=True, reason=failure.message)
            return False
        lost = chain.links[index].hop
        self.swarm.ban(lost.peer_id, fault=failure.fault)
        logger.info(
            "node %s failed (%s); replacing blocks %d:%d", lost.peer_id, failure, lost.start_block, lost.end_block
        )
        self._passed_over = set()  # replacements that could not get or hold the session's adapter
        for attempt in range(self.max_replacement_attempts):
            request = ChainRequest(
                batch=chain.batch,
                max_length=chain.max_length,
                step_tokens=step_tokens,
                unannounced_tokens=chain.floor_tokens(),  # one announcing no limit is held to the floor
                # reroute adds the banned peers
                exclude=frozenset(link.peer_id for link in chain.links) | frozenset(self._passed_over),
                start_block=lost.start_block,
                end_block=lost.end_block,
                adapter=chain.adapter,
                adapter_block_bytes=chain.adapter_block_bytes,
            )
            try:
                with self._timed("route"):
                    hops = (await self.reroute(request)).hops  # raises NoRouteError naming the missing blocks
            except NoRouteError as no_route:
                quiet = failure.link is None and may_keep  # slow, maybe: the chain may stay as it is
                # its channel broke, or it failed the step (not: sent something wrong, or has no room for the session)
                named = failure.link is not None and not failure.fault and not failure.full
                if attempt > 0 or not (quiet or named) or not await self._answers_longer(lost.peer_id):
                    raise _with_cause(no_route, lost, failure) from None
                if not self.swarm.unban(lost.peer_id):
                    # banned meanwhile for a fault (another session's finding)
                    raise _with_cause(no_route, lost, failure) from None
                if quiet:
                    logger.info("node %s was slow, not gone, and no other node serves its blocks: kept", lost.peer_id)
                    self._record(lost, [], position, started, kept=True, reason=failure.message)
                    return False
                # it answers, and no other node serves its blocks: the session opens there again (the node ends its
                # old session of this id when the owner reopens it) and its cache is rebuilt from the history
                logger.info("node %s answers and no other node serves its blocks: the session opens there again",
                            lost.peer_id)  # fmt: skip
                hops = (lost,)
            limit_s = self.swarm.request_timeout_s * 4
            try:
                async with asyncio.timeout(limit_s):
                    await self._replace(index, hops, position, inputs)
                break
            except TimeoutError:
                message = f"replacing blocks {lost.start_block}:{lost.end_block} took over {limit_s} s"
                raise PeerUnavailableError(message) from None
            except LinkFailed as failed:  # _replace banned a replacement that could not open or replay
                if failed.link is not chain.links[index] or attempt + 1 == self.max_replacement_attempts:
                    raise
                logger.info("replacement for blocks %d:%d failed: %s", lost.start_block, lost.end_block, failed)
        self._record(lost, [hop.peer_id for hop in hops], position, started, kept=False, reason=failure.message)
        return True

    def _record(
        self, lost: Hop | None, replacements: list[str], position: int, started: float, *, kept: bool, reason: str
    ) -> None:
        self.recoveries.append(
            {
                "failed": lost.peer_id if lost is not None else None,  # None: the chain was slow, every node answered
                "reason": reason,  # what the client met: a broken stream, a node's typed refusal, a step deadline
                "replacements": replacements,
                "kept": kept,  # the chain stays as it was: see recover
                "blocks": [lost.start_block, lost.end_block] if lost is not None else None,
                "position": position,
                "seconds": time.perf_counter() - started,
                "banned": sorted(self.swarm.banned()),  # when the recovery ended (bans expire: see Swarm.ban)
                "phases": {phase: round(seconds, 4) for phase, seconds in self._phases.items()},
            }
        )

    async def judge(self, accusation: LinkFailed) -> LinkFailed:
        """Who failed, when a node of a direct chain refused the input its previous node pushed it (`accusation`:
        the accused as its link, the accuser, the tokens through the refused step). The accused is asked for its
        kept outputs through that step (what it pushed, lossless), asked again while it has fewer (the step may
        still be on its way to it) for JUDGE_WAIT_S at most. Malformed ones (NaN, another shape) are its fault on
        its own word. Anything else (sane ones, none, no answer) leaves word against word: the accused is replaced
        for a failure only, unless the accuser's word now stands against ACCUSATIONS_TO_BLAME different nodes,
        when the accuser is replaced instead (client/bans.py). A failure of another node meanwhile is that node's."""
        accused, accuser = accusation.link, accusation.accuser
        if accused is None or accused not in self.chain.links or accuser not in self.chain.links:
            return LinkFailed(accusation.message, accused)
        shows = "its record is sane"
        try:
            async with asyncio.timeout(min(JUDGE_WAIT_S, self.swarm.request_timeout_s)):
                wait_s = 0.02
                while True:
                    try:
                        await self.chain.history(accused, accusation.through)
                        break
                    except BadRequestError:  # fewer outputs kept (so it says) than the step gives: not yet there?
                        await asyncio.sleep(wait_s)
                        wait_s = min(2 * wait_s, 0.5)
        except LinkFailed as shown:
            if shown.link is not None and shown.link is not accused:  # another node failed meanwhile: that one
                return shown
            if shown.fault:  # its own record of what it pushed is wrong
                return LinkFailed(f"{accusation.message}; its record agrees: {shown.message}", accused, fault=True)
            shows = "it showed no record"
        except (RequestError, PeerUnavailableError, TimeoutError):
            shows = "it showed no record"
        if self.swarm.accuse(accuser.peer_id, accused.peer_id) >= ACCUSATIONS_TO_BLAME:
            logger.warning("node %s refused inputs of %d different nodes whose records showed no fault: replaced",
                           accuser.peer_id, ACCUSATIONS_TO_BLAME)  # fmt: skip
            message = (
                f"{accuser.peer_id} refused the inputs of {ACCUSATIONS_TO_BLAME} nodes whose records show no fault"
            )
            return LinkFailed(message, accuser)
        return LinkFailed(f"{accusation.message}; {shows}: replaced, not blamed", accused)

    async def weigh_report(self, report: LinkFailed) -> LinkFailed:
        """Who failed, when a node of a direct chain (`report.reporter`) said its next node (`report.link`) did not
        take its pushes, which the client cannot see. A next node that does not answer a ping is the lost one; one
        that meanwhile said it ended the session itself (its blocks failed a step, say) failed by its own word. One
        that answers otherwise leaves word against word: it is replaced for a failure only, unless the reporter's
        word now stands against ACCUSATIONS_TO_BLAME different nodes that answered, when the reporter is replaced
        instead (client/bans.py): a node saying so of every next node cannot have them banned one after another."""
        named, reporter = report.link, report.reporter
        if named is None or named not in self.chain.links or reporter not in self.chain.links:
            return LinkFailed(report.message, named)
        with self._timed("probe"):
            unreachable = await self.swarm.unreachable([named.peer_id], timeout_s=self.probe_timeout_s, fresh_s=0.0)
        if unreachable:
            return LinkFailed(report.message, named)
        said = SessionChain.said(named)  # the next node's own word, come meanwhile: it ended the session itself
        if said is not None and isinstance(said[0], ErrorReply) and (ended := link_ended(said[0].error(), named)):
            return ended
        if self.swarm.accuse(reporter.peer_id, named.peer_id) >= ACCUSATIONS_TO_BLAME:
            logger.warning("node %s said %d different next nodes that answer took none of its pushes: replaced",
                           reporter.peer_id, ACCUSATIONS_TO_BLAME)  # fmt: skip
            message = f"{reporter.peer_id} said {ACCUSATIONS_TO_BLAME} next nodes that answer took none of its pushes"
            return LinkFailed(message, reporter)
        return LinkFailed(f"{report.message} (so says {reporter.peer_id}; the node answers): replaced", named)

    async def _answers_longer(self, peer_id: str) -> bool:
        """Whether a node that missed the short probe answers a ping within LAST_NODES_PROBE_FACTOR of it."""
        with self._timed("probe_longer"):
            timeout_s = self.probe_timeout_s * LAST_NODES_PROBE_FACTOR
            return not await self.swarm.unreachable([peer_id], timeout_s=timeout_s, fresh_s=0.0)

    async def _find_failed(self, failure: LinkFailed) -> int | None:
        """Index of the failed node: the one whose stream broke, else one whose link the client closed and has not
        replaced yet (lost while a neighbour was being replaced: its node may still answer, but its session there is
        over), else the first that does not answer an info call; None when every node answers."""
        links = self.chain.links
        if failure.link is not None and failure.link in links:
            return links.index(failure.link)
        for index, link in enumerate(links):
            if link.closed:
                return index
        for index, link in enumerate(links):
            try:
                await self.swarm.info(link.peer_id, timeout_s=self.probe_timeout_s)
            except Exception:
                return index
        return None

    async def _replace(
        self, index: int, hops: tuple[Hop, ...], position: int, inputs: list[list[torch.Tensor]]
    ) -> None:
        chain = self.chain
        previous = chain.links[index - 1] if index > 0 else None
        following = chain.links[index + 1] if index + 1 < len(chain.links) else None
        chain.close_links([chain.links[index]])
        # the lost span's inputs: what the client sent to it (first span, or any in relay mode), or else the
        # previous node's outputs
        relay = not chain.direct
        if position == 0:
            history = None
        elif previous is None or relay:
            history = torch.cat(inputs[index], dim=1)  # (batch, position, hidden)
        else:
            if previous.closed:  # lost too (a failure met while replacing it): replaced first, then this one
                raise LinkFailed(f"{previous.peer_id}, whose outputs a replacement needs, is lost too", previous)
            with self._timed("history"):
                try:
                    history = await chain.history(previous, position)
                except (RequestError, PeerUnavailableError) as failure:  # it holds the outputs of every step it took
                    link = (failure.link or previous) if isinstance(failure, LinkFailed) else previous
                    raise LinkFailed(
                        f"{previous.peer_id} gave no outputs for a replacement: {failure.message}", link
                    ) from None
        upstream = previous.peer_id if previous is not None else self.swarm.peer_id
        new_links: list[ChainLink] = []
        try:
            with self._timed("open"):
                new_links = await chain.open_segment(hops, upstream, following)
            with self._timed("replay"):
                replayed_inputs = await chain.replay(new_links, history) if history is not None else None
        except (LinkFailed, RequestError) as failure:
            # a replacement that cannot open or replay, or refuses to, is banned; the lost span is still the one to
            # replace
            chain.close_links(new_links)
            failed = _failed_peer(failure)
            if failed not in {hop.peer_id for hop in hops}:
                named = next((link for link in chain.links if link.peer_id == failed), None)
                if isinstance(failure, RequestError) and named is not None:  # a node of the chain, not the user
                    raise LinkFailed(f"{failed} refused during a replacement: {failure.message}", named) from None
                raise
            if isinstance(failure, ADAPTER_REFUSALS):  # it cannot get or hold the adapter: no fault, nor a failure
                self._passed_over.add(failed)  # (its other work is fine: routed around for this recovery only)
            else:
                self.swarm.ban(failed, fault=getattr(failure, "fault", False))
            # without room for the session: marks the lost node's link only when it was the node opened again
            full = failed == chain.links[index].peer_id and (
                getattr(failure, "full", False) or isinstance(failure, CacheBudgetError | QuotaExceededError)
            )
            raise LinkFailed(f"replacement {failed} failed: {failure.message}", chain.links[index], full=full) from None
        except BaseException:
            chain.close_links(new_links)
            raise
        try:
            # direct mode: the neighbours now talk to the replacement (previous pushes to it, following accepts
            # its pushes); in relay mode every node talks to the client only
            # (a neighbour already closed, lost too, is replaced in turn: the step through it fails next)
            with self._timed("retarget"):
                if previous is not None and not relay and not previous.closed:
                    first = new_links[0]
                    lanes = LaneSettings(key_out=first.key_in.hex(), next=self.swarm.lane_address(first.peer_id))
                    message = Retarget(
                        next=first.peer_id,
                        lane=lanes if chain.lanes else None,
                        output_codec=chain.push_codec(previous.hop, first.hop),  # what the replacement accepts
                    )
                    await _retarget(chain, previous, message)
                    previous.key_out = first.key_in
                if following is not None and not relay and not following.closed:
                    lanes = LaneSettings(key_in=new_links[-1].key_out.hex())
                    message = Retarget(upstream=new_links[-1].peer_id, lane=lanes if chain.lanes else None)
                    await _retarget(chain, following, message)
                    following.key_in = new_links[-1].key_out
                elif following is not None and not following.closed:
                    # relay mode: the step may come again with the replacement's recomputed output (other last
                    # bits); a node told its upstream changed answers such a resend from its record
                    await _retarget(chain, following, Retarget(upstream=self.swarm.peer_id))
        except BaseException:
            chain.close_links(new_links)
            raise
        if relay and inputs:  # the replacement links' own inputs, for a later failover of one of them
            inputs[index : index + 1] = replayed_inputs or [[] for _ in new_links]
        chain.links[index : index + 1] = new_links
        with self._timed("lanes"):
            await chain.connect_client_lanes()  # a new first or last node: the client's lanes to it


async def _retarget(chain: SessionChain, link: ChainLink, message: Retarget) -> None:
    """Tell a neighbour of a replacement to talk to it; a neighbour that refuses (an honest one of a live session
    takes it) or cannot be reached failed, as a node of the chain, not as the user's error."""
    try:
        await chain.retarget(link, message)
    except LinkFailed as failure:  # silence: the neighbour's, the only node that owes an answer
        raise LinkFailed(failure.message, failure.link or link) from None
    except (RequestError, PeerUnavailableError) as failure:
        raise LinkFailed(f"{link.peer_id} did not take a retarget: {failure.message}", link) from None


def _failed_peer(failure: LinkFailed | RequestError) -> str | None:
    """The node a failure of opening or replaying names: the link that failed, or the node that refused."""
    if isinstance(failure, LinkFailed):
        return failure.link.peer_id if failure.link is not None else None
    return getattr(failure, "peer_id", None)


__all__ = ["Failover", "Rerouter"]
