"""LoRA adapters between nodes: a node asked for an adapter it lacks fetches its span's blocks from the peers that
announce the adapter (RPC ADAPTER, one stream per peer, all at once), and answers such requests from its peers.

Nothing a peer sends is trusted: the manifest must hash to the adapter id the session named, every block to the
manifest's hash for that block (sharding/lora_identity.py). A peer that answers with anything else (or not at all)
is skipped and the range asked of the next peer announcing it, or covered again by the others; a range no peer
delivers within the deadline ends the fetch with AdapterMissingError, and the client leaves the node out of that
session's chain. Concurrent sessions naming the same missing adapter share one fetch.

Answering is bounded (AnswerGate): a few streams per peer and in all at once, a number of requests per peer a minute,
and a short wait for the request, so peers asking without end (or opening streams and saying nothing) cannot keep a
node copying slices or hold its answer slots; they get QuotaExceededError, and an honest fetcher asks the next holder.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from nesa_node.errors import AdapterError, AdapterMissingError, NesaError, QuotaExceededError
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import frame, read
from nesa_node.protocol.framing import StreamChannel, open_stream
from nesa_node.protocol.messages import (
    ADAPTER_ANSWERS,
    ADAPTER_REQUESTS,
    AdapterBlocks,
    AdapterRequest,
    ErrorReply,
    expect,
)
from nesa_node.protocol.records import NodeInfo
from nesa_node.protocol.stream_gate import AnswerGate
from nesa_node.protocol.tensors import bytes_from_proto, bytes_to_proto
from nesa_node.sharding.lora import (
    AdapterManifest,
    AdapterSlice,
    check_fits_model,
    merge_slices,
    slice_blobs,
    slice_from_blocks,
)
from nesa_node.sharding.lora_identity import MAX_MANIFEST_BYTES

logger = logging.getLogger(__name__)

MAX_PEERS_PER_RANGE = 4  # holders asked in turn for one range before it is covered again by the others (guess)
# a holder that failed to deliver is asked last, after the others, for this long: records cost nothing, so identities
# announcing an adapter they never send could otherwise take every fetch's time, fetch after fetch (guess)
FAILED_HOLDER_S = 300.0
FAILED_HOLDERS_KEPT = 4096
LATELY = "failed lately"
# answering peers' fetches (guesses: a node fetches an adapter once per range and holder, so honest peers need few)
MAX_ANSWERS = 8  # ADAPTER streams a node serves at once, from all peers
MAX_ANSWERS_PER_PEER = 2  # ... from one peer
MAX_REQUESTS_PER_PEER = 240  # ADAPTER streams one peer may open per REQUEST_WINDOW_S (a node thrashing its budget
# refetches often: tests/swarm/test_lora_eviction.py fetches about 40 in 6 s)
REQUEST_WINDOW_S = 60.0
REQUEST_WAIT_S = 5.0  # a fetching peer sends its request right after opening the stream
# the swarm's records, looked up at most once in this many seconds for all fetches: a peer naming adapters nobody
# announces, open after open, costs the node no DHT lookup each (guess: records change on the announce period's
# scale, tens of seconds; an adapter announced in the last second is fetched on the next open)
RECORDS_FRESH_S = 1.0


def adapter_answer_gate() -> AnswerGate:
    """The admission of peers' ADAPTER streams (see the module docstring)."""
    return AnswerGate(
        max_running=MAX_ANSWERS,
        max_running_per_peer=MAX_ANSWERS_PER_PEER,
        max_per_window=MAX_REQUESTS_PER_PEER,
        window_s=REQUEST_WINDOW_S,
        what="adapter requests",
        hint="ask again later or ask another holder",
    )


__all__ = ["AdapterFetcher", "AnswerGate", "adapter_answer_gate", "answer_adapter_request", "cover"]


def cover(start: int, end: int, holders: list[NodeInfo]) -> list[tuple[int, int, list[NodeInfo]]]:
    """Blocks [start, end) cut into ranges, each with the holders whose spans contain it, fewest ranges first
    (greedy: from each range's start, the holder reaching furthest). Raises AdapterMissingError for a block no
    holder serves."""
    ranges, block = [], start
    while block < end:
        serving = [info for info in holders if info.start_block <= block < info.end_block]
        if not serving:
            raise AdapterMissingError(f"no peer announcing the adapter serves block {block}")
        stop = min(end, max(info.end_block for info in serving))
        ranges.append((block, stop, [info for info in serving if info.end_block >= stop]))
        block = stop
    return ranges


class AdapterFetcher:
    """Fetches an adapter's blocks from the peers announcing it. `records`: the model's NodeInfo records on the DHT
    (an awaitable call); the node's own P2P host, peer id and model config; `deadline_s` bounds a whole fetch (kept
    well under what a client waits for its open: a node that fetches too long is passed over anyway), `peer_s` each
    peer's answer; `max_frame_bytes` bounds an answer."""

    def __init__(
        self,
        p2p,
        peer_id: str,
        records: Callable[[], Awaitable[list[NodeInfo]]],
        model_config,
        *,
        deadline_s: float,
        peer_s: float,
        max_frame_bytes: int,
    ):
        self.p2p = p2p
        self.peer_id = peer_id
        self.records = records
        self.model_config = model_config
        self.deadline_s = deadline_s
        self.peer_s = peer_s
        self.max_frame_bytes = max_frame_bytes
        self._under_way: dict[tuple[str, int, int], asyncio.Task] = {}
        self._records: tuple[float, list[NodeInfo]] | None = None  # (when it came, what) of the last lookup
        self._lookup: asyncio.Future | None = None  # the lookup under way, which every caller meanwhile awaits
        # this node's own streams to one holder at once: never beyond what the holder's AnswerGate admits per peer
        self._per_holder: dict[str, asyncio.Semaphore] = {}
        self._failed: dict[str, float] = {}  # holder -> until when (monotonic s) it is asked last (FAILED_HOLDER_S)
        self._rng = random.Random()

    async def fetch(self, adapter_id: str, start: int, end: int) -> tuple[str, AdapterManifest, AdapterSlice]:
        """(name, manifest, slice of blocks [start, end)) of adapter `adapter_id`, checked by hash. Raises
        AdapterMissingError when the peers announcing it cannot deliver it within the deadline. Sessions asking
        for the same blocks at once share one fetch, which a caller that goes away does not cancel."""
        key = (adapter_id, start, end)
        task = self._under_way.get(key)
        if task is None:
            task = asyncio.ensure_future(self._fetch(adapter_id, start, end))
            self._under_way[key] = task
            task.add_done_callback(lambda _: self._under_way.pop(key, None))
        return await asyncio.shield(task)

    async def recent_records(self) -> list[NodeInfo]:
        """The swarm's records, looked up again only when the last lookup is `RECORDS_FRESH_S` old (concurrent
        callers share one lookup)."""
        if self._records is not None and time.monotonic() - self._records[0] < RECORDS_FRESH_S:
            return self._records[1]
        if self._lookup is None or self._lookup.done():
            self._lookup = asyncio.ensure_future(self._look_up())
        return await asyncio.shield(self._lookup)  # a caller that goes away does not cancel the others' lookup

    async def _look_up(self) -> list[NodeInfo]:
        async with asyncio.timeout(self.deadline_s):  # one that hangs must not hold every fetch after it
            records = list(await self.records())
        self._records = (time.monotonic(), records)  # fresh from when it came, however long it took
        return records

    async def _fetch(self, adapter_id: str, start: int, end: int) -> tuple[str, AdapterManifest, AdapterSlice]:
        failed: dict[str, str] = {}  # peer id -> why it was left out
        try:
            async with asyncio.timeout(self.deadline_s):  # the records' lookup and the blocks' transfer together
                holders = [
                    info
                    for info in await self.recent_records()
                    if info.peer_id != self.peer_id and any(held.adapter_id == adapter_id for held in info.adapters)
                ]
                if not holders:
                    raise AdapterMissingError(f"adapter {adapter_id}: no peer announces it")
                names = Counter(
                    held.name for info in holders for held in info.adapters if held.adapter_id == adapter_id
                )
                now = time.monotonic()
                lately = {info.peer_id for info in holders if self._failed.get(info.peer_id, 0.0) > now}
                failed.update(dict.fromkeys(lately, LATELY))  # not asked while the others cover the blocks
                try:
                    pieces = await self._cover(adapter_id, start, end, holders, failed)
                except AdapterMissingError:
                    if not lately:
                        raise
                    for peer in lately:  # the others cannot: asked after all
                        if failed.get(peer) == LATELY:
                            del failed[peer]
                    pieces = await self._cover(adapter_id, start, end, holders, failed)
        except TimeoutError:
            raise AdapterMissingError(f"adapter {adapter_id} blocks {start}:{end}: not fetched within "
                                      f"{self.deadline_s:.0f} s ({_why(failed)})") from None  # fmt: skip
        finally:
            self._note_failed([peer for peer, why in failed.items() if why != LATELY])
        return names.most_common(1)[0][0], pieces[0][0], merge_slices(piece for _, piece in pieces)

    def _note_failed(self, failed: list[str]) -> None:
        now = time.monotonic()
        if len(self._failed) >= FAILED_HOLDERS_KEPT:
            self._failed = {peer: until for peer, until in self._failed.items() if until > now}
        for peer in failed:
            if len(self._failed) < FAILED_HOLDERS_KEPT:
                self._failed[peer] = now + FAILED_HOLDER_S

    async def _cover(
        self, adapter_id: str, start: int, end: int, holders: list[NodeInfo], failed: dict[str, str]
    ) -> list[tuple[AdapterManifest, AdapterSlice]]:
        """Blocks [start, end) from the holders not failed yet, every range at once; a range whose peers all fail
        is covered again by the others (a peer claiming a wide span cannot hide those with the blocks)."""
        alive = [info for info in holders if info.peer_id not in failed]
        try:
            ranges = cover(start, end, alive)
        except AdapterMissingError as exc:
            raise AdapterMissingError(f"adapter {adapter_id}: {exc.message} ({_why(failed)})") from None
        tasks = [
            asyncio.create_task(self._range(adapter_id, first, stop, peers, holders, failed))
            for first, stop, peers in ranges
        ]
        try:
            parts = await asyncio.gather(*tasks)
        except Exception:  # a range no peer could give: the others stop asking (gather would let them go on)
            for task in tasks:
                task.cancel()
            raise
        return [piece for part in parts for piece in part]

    async def _range(
        self, adapter_id, start, end, peers, holders, failed
    ) -> list[tuple[AdapterManifest, AdapterSlice]]:
        # in random order: the order of records is not a peer's to choose (one claiming the widest span is in every
        # range's list)
        for info in self._rng.sample(peers, len(peers))[:MAX_PEERS_PER_RANGE]:
            if info.peer_id in failed:
                continue
            try:
                async with asyncio.timeout(self.peer_s):
                    return [await self._ask(info.peer_id, adapter_id, start, end)]
            except Exception as exc:  # any answer but the checked blocks: the next peer
                logger.debug("adapter %s blocks %d:%d from %s: %r", adapter_id[:12], start, end, info.peer_id, exc)
                failed[info.peer_id] = exc.message if isinstance(exc, NesaError) else type(exc).__name__
        return await self._cover(adapter_id, start, end, holders, failed)

    async def _ask(self, peer_id: str, adapter_id: str, start: int, end: int) -> tuple[AdapterManifest, AdapterSlice]:
        turns = self._per_holder.setdefault(peer_id, asyncio.Semaphore(MAX_ANSWERS_PER_PEER))
        async with turns:
            return await self._ask_now(peer_id, adapter_id, start, end)

    async def _ask_now(self, peer_id, adapter_id, start, end) -> tuple[AdapterManifest, AdapterSlice]:
        channel = await open_stream(self.p2p, peer_id, rpc.ADAPTER, max_frame_bytes=self.max_frame_bytes)
        try:
            channel.send(frame(AdapterRequest(adapter_id=adapter_id, start_block=start, end_block=end)))
            answer = await channel.receive()
        finally:
            channel.close()
        if answer is None:
            raise AdapterMissingError(f"{peer_id} ended the stream without an answer")
        message = read(answer, ADAPTER_ANSWERS)
        if isinstance(message, ErrorReply):
            raise message.error()
        if (message.adapter_id, message.start_block, message.end_block) != (adapter_id, start, end):
            raise AdapterError("the peer answered with other blocks than those asked for")
        return await asyncio.to_thread(_check, message, answer, self.max_frame_bytes, self.model_config)


def _why(failed: dict[str, str]) -> str:
    return "; ".join(f"{peer[-8:]}: {why}" for peer, why in failed.items()) or "no peer answered"


def _check(message: AdapterBlocks, answer, max_bytes: int, model_config) -> tuple[AdapterManifest, AdapterSlice]:
    count = message.end_block - message.start_block
    if len(answer.tensors) != count + 1:
        raise AdapterError(f"expected a manifest and {count} block(s), got {len(answer.tensors)} tensors")
    manifest = AdapterManifest.from_bytes(
        bytes_from_proto(answer.tensors[0], max_bytes=MAX_MANIFEST_BYTES), message.adapter_id
    )
    blobs = [bytes_from_proto(tensor, max_bytes=max_bytes) for tensor in answer.tensors[1:]]
    piece = slice_from_blocks(manifest, message.start_block, message.end_block, blobs)
    check_fits_model(piece, model_config)
    return manifest, piece


async def answer_adapter_request(channel: StreamChannel, adapters, peer: str, gate: AnswerGate) -> None:
    """One ADAPTER stream of `peer`: its AdapterRequest, answered from `adapters` (the node's NodeAdapters) with the
    blocks it announces, or a typed error; admitted by `gate` (QuotaExceededError, answered at once, beyond it)."""
    try:
        leave = gate.enter(peer)
    except QuotaExceededError as exc:
        channel.send(frame(ErrorReply.of(exc)))
        return
    try:
        try:
            async with asyncio.timeout(min(adapters.request_timeout_s, REQUEST_WAIT_S)):
                request = await channel.receive()
        except TimeoutError:  # a peer that opened the stream and said nothing
            return
        if request is None:
            return
        try:
            message = expect(read(request, ADAPTER_REQUESTS), AdapterRequest)
            manifest, held = adapters.shared(message.adapter_id, message.start_block, message.end_block)
            blobs = await asyncio.to_thread(
                lambda: slice_blobs(held.narrow(message.start_block, message.end_block))
            )  # (narrowing serializes the part: off the event loop, as its blocks' bytes are)
            blocks = [bytes_to_proto(manifest.to_bytes()), *map(bytes_to_proto, blobs)]
            channel.send(frame(message_of(message), blocks))
        except NesaError as exc:
            channel.send(frame(ErrorReply.of(exc)))
        # the answer (a whole slice) counts against the gate until it has left: a peer that does not read it has the
        # stream aborted and its bytes dropped, so requests never read cannot pin slices in memory
        try:
            async with asyncio.timeout(adapters.request_timeout_s):
                await channel.drain()
        except TimeoutError:
            channel.abort()
    finally:
        leave()


def message_of(request: AdapterRequest) -> AdapterBlocks:
    return AdapterBlocks(adapter_id=request.adapter_id, start_block=request.start_block, end_block=request.end_block)
