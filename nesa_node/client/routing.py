"""Choosing chains for a client: eq. 18 routing (nesa_node.routing) on a live snapshot of the swarm, with the
client's own round trips to first-block candidates, banned peers left out, and fallbacks when the records at hand
give no chain (ask the nodes seen lately directly, then wait for a complete DHT read).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from nesa_node.client.config import ClientConfig
from nesa_node.client.swarm import MAX_PROBED_NODES, Swarm
from nesa_node.errors import NoRouteError, WeightsManifestError
from nesa_node.protocol.records import NodeInfo, NodeState
from nesa_node.routing.chain import Chain, ChainRequest, SwarmSnapshot, select_chain
from nesa_node.sharding.weights_manifest import WeightsManifest

logger = logging.getLogger(__name__)

ChainSelector = Callable[[SwarmSnapshot, ChainRequest], Chain]

# nodes that missed the probe, without which no chain is left, are pinged again with this many times its timeout
# before they are banned (guess: a host busy starting processes stalls a node's event loop for a second or two; a
# frozen or dead node fails any timeout)
LAST_NODES_PROBE_FACTOR = 4.0


def explain_missing(
    snapshot: SwarmSnapshot,
    request: ChainRequest,
    banned: frozenset[str],
    other_weights: frozenset[str] = frozenset(),
    *,
    faulty: frozenset[str] = frozenset(),
) -> str:
    """Why the nodes of the requested block range were not used: what a NoRouteError adds for its reader. `faulty`:
    banned peers whose ban is for something wrong they sent (client/swarm.py Swarm.ban)."""
    end = request.end_block if request.end_block is not None else snapshot.num_blocks
    seen = []
    for node in snapshot.nodes:
        if node.end_block <= request.start_block or node.start_block >= end:
            continue
        if node.peer_id in banned and node.peer_id in faulty:
            reason = "banned for sending something wrong"
        elif node.peer_id in banned:
            reason = "banned after a failure"
        elif node.peer_id in other_weights:
            reason = "announces other weights than the manifest's"
        elif node.peer_id in request.exclude:
            reason = "left out (in the chain already, or refused this session)"
        elif not node.online:
            reason = "not online"
        elif request.adapter is not None and request.adapter not in node.adapters:
            reason = f"without adapter {request.adapter[:12]}"
        elif request.step_tokens and 0 < (node.max_step_tokens or request.unannounced_tokens) < request.step_tokens:
            reason = (
                f"takes {node.max_step_tokens} tokens a step, {request.step_tokens} asked"
                if node.max_step_tokens
                else f"announces no step limit (held to {request.unannounced_tokens} tokens), {request.step_tokens} asked"
            )
        else:
            reason = f"{node.cache_tokens_left} cache tokens left"
        seen.append(f"{node.peer_id[-8:]} (blocks {node.start_block}:{node.end_block}, {reason})")
    return f"nodes seen for blocks {request.start_block}:{end}: " + (", ".join(seen) or "none")


class Router:
    """Chains over `swarm` for a model of `num_blocks` blocks of width `hidden_size`."""

    def __init__(
        self,
        swarm: Swarm,
        config: ClientConfig,
        *,
        num_blocks: int,
        hidden_size: int,
        chain_selector: ChainSelector | None = None,
    ):
        self.swarm = swarm
        self.config = config
        self.num_blocks = num_blocks
        self.hidden_size = hidden_size
        self.chain_selector = chain_selector or functools.partial(select_chain, params=config.routing_params)
        self.last_chain: Chain | None = None
        # with a manifest, only nodes announcing its weights for their span are routed to (sharding/weights_manifest.py)
        self.weights_manifest: WeightsManifest | None = None
        # the nodes that can get a LoRA adapter (AdapterLookup.adapter_reachable), for requests that name an adapter
        # without saying (a failover's replacement): else any node would be taken for one that can
        self.adapter_reachable: Callable[[str], Awaitable[frozenset[str] | None]] | None = None
        self._warned: set[str] = set()

    def other_weights(self) -> frozenset[str]:
        """The nodes, among the records at hand, whose announced source hash is not the manifest's for their span
        (none without a manifest); each is logged once."""
        if self.weights_manifest is None:
            return frozenset()
        other = frozenset(
            record.info.peer_id
            for record in self.swarm.records_at_hand()
            if not self._announces_manifest_weights(record.info)
        )
        for peer_id in other - self._warned:
            logger.warning("%s announces other weights than the weights manifest's: not routed to", peer_id)
        self._warned |= other
        return other

    def _announces_manifest_weights(self, info: NodeInfo) -> bool:
        try:
            return info.source_hash == self.weights_manifest.span_hash(info.start_block, info.end_block)
        except WeightsManifestError:  # a span outside the model
            return False

    def _select(self, snapshot: SwarmSnapshot, request: ChainRequest) -> Chain:
        return self.chain_selector(snapshot, replace(request, exclude=request.exclude | self.other_weights()))

    async def snapshot(self, *, fresh: bool = False) -> SwarmSnapshot:
        """The routing snapshot of the swarm for this model (records, links and the client's round trips)."""
        return await self.swarm.snapshot(self.num_blocks, fresh=fresh, hidden_size=self.hidden_size)

    async def choose_chain(self, request: ChainRequest) -> Chain:
        """The chain for a new session (or a cacheless forward): first-block candidates the client has no recent
        round trip to are pinged first, so the first hop is chosen on the client's own measurement."""
        await self._ping_first_candidates(request)
        chain = await self.reachable_chain(request)
        self.last_chain = chain
        return chain

    async def _ping_first_candidates(self, request: ChainRequest) -> None:
        if self.config.max_pinged_candidates <= 0:
            return
        banned = self.swarm.banned() | request.exclude
        try:
            records = await self.swarm.node_records()
        except Exception as exc:  # reroute reads again and raises the error a user should see
            logger.debug("no records to choose ping candidates from: %r", exc)
            return
        candidates = sorted(
            record.info.peer_id
            for record in records
            if record.info.start_block <= request.start_block < record.info.end_block
            and record.info.state == NodeState.online
            and record.info.peer_id not in banned
        )
        await self.swarm.measure_rtts(candidates[: self.config.max_pinged_candidates])

    async def reachable_chain(self, request: ChainRequest) -> Chain:
        """A chain for `request` whose nodes answer a ping now: nodes that do not are left out and the chain chosen
        again (records of crashed nodes linger until they expire; opening a stream to one waits out a dial timeout),
        and banned once a chain is found without them. When none is, the silent nodes get a longer ping first: a
        node on a loaded host can miss the short one, and banning the last node of a span would end every session
        needing it. For the same reason, nodes of the range banned earlier for a failure (not a fault: Swarm.ban)
        get a second chance once: those that answer the longer ping are unbanned and routed to again. Raises
        NoRouteError when no chain of answering nodes is left."""
        if request.adapter is not None and request.adapter_reachable is None and self.adapter_reachable is not None:
            request = replace(request, adapter_reachable=await self.adapter_reachable(request.adapter))
        silent: set[str] = set()
        second_chance: list[str] | None = None  # the peers unbanned by it, once it was given
        for _ in range(self.config.max_open_attempts):
            try:
                chain = await self.reroute(replace(request, exclude=request.exclude | silent))
            except NoRouteError:
                if not silent:
                    if second_chance is None:
                        second_chance = await self._unban_answering(request)
                        if second_chance:
                            continue
                    for peer_id in second_chance or ():  # no chain with them either: banned again
                        self.swarm.ban(peer_id)
                    raise
                timeout_s = self.config.probe_timeout_s * LAST_NODES_PROBE_FACTOR
                self._ban_silent(await self.swarm.unreachable(sorted(silent), timeout_s=timeout_s))
                silent = set()  # those that answered now are routed to again (their ping is fresh), the rest banned
                continue
            missed = await self.swarm.unreachable(list(chain.peer_ids), timeout_s=self.config.probe_timeout_s)
            if not missed:
                self._ban_silent(silent)
                return chain
            silent.update(missed)
        self._ban_silent(silent)
        return await self.reroute(request)

    async def _unban_answering(self, request: ChainRequest) -> list[str]:
        """Lift the bans of the range's nodes banned for a failure that answer a ping of LAST_NODES_PROBE_FACTOR
        short probes now (Swarm.second_chance); returns those unbanned."""
        end = request.end_block if request.end_block is not None else self.num_blocks
        seen = [peer for peer in self.swarm.recent_nodes(request.start_block, end) if peer not in request.exclude]
        candidates = self.swarm.second_chance(seen)[:MAX_PROBED_NODES]  # the freshest records' nodes, pinged at once
        if not candidates:
            return []
        timeout_s = self.config.probe_timeout_s * LAST_NODES_PROBE_FACTOR
        silent = await self.swarm.unreachable(candidates, timeout_s=timeout_s, fresh_s=0.0)
        unbanned = [peer for peer in candidates if peer not in silent and self.swarm.unban(peer)]
        for peer_id in unbanned:
            logger.info("%s, banned after a failure, answers again and no chain is left without it: unbanned", peer_id)
        return unbanned

    def _ban_silent(self, peer_ids) -> None:
        for peer_id in peer_ids:
            logger.info("%s does not answer; routing around it", peer_id)
            self.swarm.ban(peer_id)

    async def reroute(self, request: ChainRequest) -> Chain:
        """A chain for `request` (its block range; banned peers excluded) from a fresh view of the swarm. Raises
        NoRouteError naming the missing blocks and why each node seen for them was not used."""
        request = replace(
            request,
            exclude=request.exclude | self.swarm.banned(),
            partial_spans=self.config.partial_spans,
            codec=self.config.compression.name,
        )
        with contextlib.suppress(NoRouteError):
            return self._select(await self.snapshot(), request)
        # The records at hand may be stale or lack a live node (its announcements missed the DHT replicas read, or a
        # replica that stopped answering slows every read): ask the nodes seen lately for these blocks directly, and
        # if that gives no chain either, decide on a completed DHT read.
        end = request.end_block if request.end_block is not None else self.num_blocks
        candidates = [peer for peer in self.swarm.recent_nodes(request.start_block, end) if peer not in request.exclude]
        if candidates and await self.swarm.probe_nodes(candidates, timeout_s=self.config.probe_timeout_s):
            with contextlib.suppress(NoRouteError):
                return self._select(await self.snapshot(), request)
        snapshot = await self.snapshot(fresh=True)
        try:
            return self._select(snapshot, request)
        except NoRouteError as error:
            why = explain_missing(
                snapshot, request, self.swarm.banned(), self.other_weights(), faulty=self.swarm.faulty()
            )
            raise NoRouteError(f"{error.message}; {why}") from None


__all__ = ["ChainSelector", "Router", "explain_missing"]
