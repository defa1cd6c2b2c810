"""Client failover of an inference session: when a node of the chain fails, ban it, route a replacement for exactly
its span, rebuild the replacement's KV cache by replaying the span's input history, point the neighbours at it, and
retry the step under the same step id (README, "Client SDK"; RELIABILITY.md A).

`Failover` is a part of RemoteInferenceSession (it uses the session's links, inputs, response queue and reroute).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from hivemind.proto import runtime_pb2

from nesa_node.client.chain_links import ChainLink, LinkFailed, stale_report
from nesa_node.errors import PeerUnavailableError
from nesa_node.protocol.wire import error_from_metadata, pack_metadata, raise_if_error, tensor_to_proto
from nesa_node.routing.chain import Chain, ChainRequest, Hop

logger = logging.getLogger(__name__)

MAX_HIDDEN = 1 << 16  # widest hidden state accepted in a replayed history, elements
REPLAY_CHUNK_TOKENS = 1024  # history replayed per message: well under a node's max_tokens_per_step


class Failover:
    """Recovery from a failed node of the session's chain (see the module docstring)."""

    @contextlib.contextmanager
    def _timed(self, phase: str):
        """Add the time spent in the block to `phase` of the recovery in progress (its failover entry's "phases")."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._phases[phase] = self._phases.get(phase, 0.0) + time.perf_counter() - started

    def _recover(self, failure: LinkFailed) -> None:
        started = time.perf_counter()
        self._phases = {}
        with self._timed("find"):
            index = self._find_failed(failure)
        lost = self._links[index].hop
        self.swarm.ban(lost.peer_id)
        logger.info(
            "node %s failed (%s); replacing blocks %d:%d", lost.peer_id, failure, lost.start_block, lost.end_block
        )
        for attempt in range(self.max_replacement_attempts):
            request = ChainRequest(
                batch=self.batch,
                max_length=self.max_length,
                exclude=frozenset(link.hop.peer_id for link in self._links),  # reroute adds the banned peers
                start_block=lost.start_block,
                end_block=lost.end_block,
            )
            with self._timed("route"):
                replacement = self.reroute(request)  # raises NoRouteError naming the missing blocks
            try:
                self.swarm.call(self._replace(index, replacement.hops), timeout=self.swarm.request_timeout_s * 4)
                break
            except LinkFailed as failed:  # _replace banned a replacement that could not open or replay
                if failed.link is not self._links[index] or attempt + 1 == self.max_replacement_attempts:
                    raise
                logger.info("replacement for blocks %d:%d failed: %s", lost.start_block, lost.end_block, failed)
        self.failovers.append(
            {
                "failed": lost.peer_id,
                "replacements": [hop.peer_id for hop in replacement.hops],
                "blocks": [lost.start_block, lost.end_block],
                "position": self.position,
                "seconds": time.perf_counter() - started,
                "banned": sorted(self.swarm.banned()),  # when the recovery ended (bans expire: see SwarmClient.ban)
                "phases": {phase: round(seconds, 4) for phase, seconds in self._phases.items()},
            }
        )

    def _find_failed(self, failure: LinkFailed) -> int:
        """Index of the failed node: the one whose stream broke, else the first that does not answer rpc_info."""
        if failure.link is not None and failure.link in self._links:
            return self._links.index(failure.link)
        for index, link in enumerate(self._links):
            try:
                self.swarm.info(link.hop.peer_id, timeout_s=self.probe_timeout_s)
            except Exception:
                return index
        raise PeerUnavailableError(f"{failure.message}; every node of the chain still answers") from None

    async def _replace(self, index: int, hops: tuple[Hop, ...]) -> None:
        previous = self._links[index - 1] if index > 0 else None
        following = self._links[index + 1] if index + 1 < len(self._links) else None
        self._close_links([self._links[index]])
        # the lost span's inputs: what the client sent to it (first span, or any in relay mode), or else the
        # previous node's outputs
        relay = self.mode == "relay"
        if self.position == 0:
            history = None
        elif previous is None or relay:
            history = torch.cat(self._inputs[index], dim=1)  # (batch, position, hidden)
        else:
            previous.outbox.put_nowait(
                runtime_pb2.ExpertRequest(metadata=pack_metadata({"control": "history", "position": self.position}))
            )
            with self._timed("history"):
                history = await self._control_answer(previous, "history", self.position * self.batch * MAX_HIDDEN)
        upstream = previous.hop.peer_id if previous is not None else self.swarm.peer_id
        new_links: list[ChainLink] = []
        try:
            with self._timed("open"):
                new_links = await self._open_links(hops, upstream, following)
            with self._timed("replay"):
                replayed_inputs = await self._replay(new_links, history) if history is not None else None
        except LinkFailed as failure:
            # a replacement that cannot open or replay is banned; the lost span is still the one to replace
            self._close_links(new_links)
            replacements = {hop.peer_id for hop in hops}
            failed = failure.link.hop.peer_id if failure.link is not None else None
            if failed not in replacements:
                raise
            self.swarm.ban(failed)
            raise LinkFailed(f"replacement {failed} failed: {failure.message}", self._links[index]) from None
        except BaseException:
            self._close_links(new_links)
            raise
        try:
            # direct mode: the neighbours now talk to the replacement (previous pushes to it, following accepts
            # its pushes); in relay mode every node talks to the client only
            if previous is not None and not relay:
                first = new_links[0]
                lanes = {"out": first.key_in.hex(), "next": self.swarm.lane_address(first.hop.peer_id)}
                await self._retarget(previous, next=first.hop.peer_id, **({"lane": lanes} if self.lanes else {}))
                previous.key_out = first.key_in
            if following is not None and not relay:
                lanes = {"in": new_links[-1].key_out.hex()}
                await self._retarget(
                    following, upstream=new_links[-1].hop.peer_id, **({"lane": lanes} if self.lanes else {})
                )
                following.key_in = new_links[-1].key_out
        except BaseException:
            self._close_links(new_links)
            raise
        if relay and self._inputs:  # the replacement links' own inputs, for a later failover of one of them
            self._inputs[index : index + 1] = replayed_inputs or [[] for _ in new_links]
        self._links[index : index + 1] = new_links
        self.chain = Chain(hops=tuple(link.hop for link in self._links))
        with self._timed("lanes"):
            await self._connect_lanes()  # a new first or last node: the client's lanes to it

    async def _retarget(self, link: ChainLink, **peers: str | dict) -> None:
        link.outbox.put_nowait(runtime_pb2.ExpertRequest(metadata=pack_metadata({"control": "retarget", **peers})))
        with self._timed("retarget"):
            await self._control_answer(link, "retarget", 0)

    async def _control_answer(self, link: ChainLink, control: str, max_elements: int) -> torch.Tensor | None:
        while True:
            answered, metadata, response = await self._next_response(self.swarm.request_timeout_s)
            if metadata.get("error") == PeerUnavailableError.code:
                continue  # a node reporting that its next node is gone: the failure being recovered from
            raise_if_error(metadata)
            if answered is link and metadata.get("control") == control:
                break
        if control != "history":
            return None
        return self._read_hidden(link, response, metadata, max_elements)

    async def _replay(self, links: list[ChainLink], history: torch.Tensor) -> list[list[torch.Tensor]]:
        """Rebuild the replacement nodes' caches: the history goes through them one by one, via the client.
        Returns each link's input history (one tensor per link)."""
        inputs = []
        for link in links:
            inputs.append([history])
            outputs = []
            for start in range(0, history.shape[1], REPLAY_CHUNK_TOKENS):
                chunk = history[:, start : start + REPLAY_CHUNK_TOKENS]  # (batch, <= chunk, hidden)
                step_id = f"{self.session_id}:replay:{start}"
                link.outbox.put_nowait(
                    runtime_pb2.ExpertRequest(
                        tensors=[tensor_to_proto(chunk)],
                        metadata=pack_metadata({"step_id": step_id, "position": start, "replay": True}),
                    )
                )
                while True:
                    try:
                        answered, metadata, response = await self._next_response(self.swarm.request_timeout_s)
                    except LinkFailed as failure:  # only the replayed node owes an answer now: silence is its
                        raise LinkFailed(failure.message, failure.link or link) from None
                    if stale_report(answered, metadata, [link]):
                        continue
                    if metadata.get("error") == PeerUnavailableError.code:  # the replayed node gave up (timeout)
                        raise LinkFailed(error_from_metadata(metadata).message, link)
                    raise_if_error(metadata)
                    if answered is link and metadata.get("step_id") == step_id:
                        break
                outputs.append(self._read_hidden(link, response, metadata, chunk.numel()))
            history = torch.cat(outputs, dim=1)
        return inputs


__all__ = ["Failover"]
