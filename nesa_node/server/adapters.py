"""The LoRA adapters a node serves (Nesa sec. 2.4, eq. 6): slices of PEFT adapters for the node's blocks, kept in
an AdapterStore (server/adapter_store.py) under a byte budget, announced in the node's record, and held by the
sessions that run with them.

- Preloaded (`nesa-node run --adapters DIR ...`): each folder is read whole once (its manifest of per-block hashes
  names the adapter the same way on every node, sharding/lora.py), and the node keeps the slice of its span. They
  stay resident; a node that moves reloads them for its new span.
- A session opened with an adapter holds it (never evicted) until it closes; a step runs its rows with it
  (server/compute.py), also inside a decode batch with other sessions' adapters.
- A client's own adapter comes on the session stream right before the session's open (AdapterBlocks, the node's
  span): the manifest is checked against the adapter id and every block against the manifest (a changed byte is
  refused) and the slices against the model's shapes; it is held under the same budget while sessions naming it
  are open (whoever opened them: its id is its content), not announced, and dropped when the last one closes.
- An adapter the node does not hold is fetched from the peers that announce it (server/adapter_fetch.py), then kept
  and announced like a preloaded one but evicted least recently used first; one no peer can deliver is refused with
  AdapterMissingError, and the client routes around the node (or sends its own).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from nesa_node.errors import AdapterBudgetError, AdapterError, AdapterMissingError, BadRequestError
from nesa_node.protocol.channel import Frame
from nesa_node.protocol.messages import AdapterBlocks
from nesa_node.protocol.records import AdapterInfo
from nesa_node.protocol.tensors import bytes_from_proto
from nesa_node.server.adapter_fetch import AdapterFetcher
from nesa_node.server.adapter_store import AdapterStore
from nesa_node.sharding.lora import (
    AdapterManifest,
    AdapterSlice,
    adapter_manifest,
    check_fits_model,
    load_adapter_slice,
    slice_from_blocks,
)
from nesa_node.sharding.lora_identity import MAX_MANIFEST_BYTES

logger = logging.getLogger(__name__)

__all__ = ["NodeAdapters"]


class NodeAdapters:
    """The adapters of one node (see the module docstring). `folders`: the preloaded adapter folders;
    `budget_bytes`: what their slices and fetched ones may take together, each charged its bytes plus the float32
    copies running it on `device` makes (AdapterSlice.run_bytes)."""

    def __init__(self, model_config, folders: tuple[str, ...] = (), *, budget_bytes: int, device: str = "cpu"):
        self.model_config = model_config
        self.folders = tuple(folders)
        self.budget_bytes = budget_bytes
        self.device = device
        self.store = self._new_store()
        self._private: set[str] = set()  # ids in the store a client sent for its sessions alone
        self.span: tuple[int, int] | None = None  # the blocks served, once loaded
        self.fetcher: AdapterFetcher | None = None  # fetches from peers (server/adapter_fetch.py), once connected
        self.request_timeout_s = 30.0  # what a peer asking for blocks may take to ask
        # ends one idle session holding an adapter (SessionTable.preempt_idle_adapter_session); False: none idle
        self.make_room: Callable[[], bool] = lambda: False
        # seconds until one could be ended (SessionTable.adapter_preemptible_in_s); None: no session holds one
        self.room_in_s: Callable[[], float | None] = lambda: None
        self.max_wait_s = 0.0  # what an open waits at most for that (as for the KV cache: open_when_room)
        self.sessions = None  # the node's SessionTable (`connect`): sessions moved to a widened slice (`_adopt`)

    async def load_span(self, start: int, end: int) -> None:
        """Hold the preloaded adapters' slices of blocks [start, end) in a fresh store (no session may be open: a
        node loads them at start and after a move). Raises AdapterError (and its kinds) for a folder that is not a
        LoRA adapter of this model, AdapterBudgetError when they do not fit the budget together."""
        store = self._new_store()
        for folder in self.folders:
            name, manifest, piece = await asyncio.to_thread(self._read, folder, start, end)
            store.add(name, manifest, piece, preloaded=True)
            logger.info("adapter %s (%s, rank %d): %d bytes for blocks %d:%d", name, manifest.adapter_id[:12],
                        manifest.rank, piece.nbytes, start, end)  # fmt: skip
        self.store, self._private, self.span = store, set(), (start, end)

    def _new_store(self) -> AdapterStore:
        return AdapterStore(self.budget_bytes, weigh=self.weigh)

    def weigh(self, piece) -> int:
        """What a slice costs the budget here: its bytes and the float32 copies running it on this device makes (the
        unit of the store's charges and of each peer's share)."""
        return piece.nbytes + piece.run_bytes(self.device)

    def connect(self, fetcher: AdapterFetcher, *, request_timeout_s: float, sessions=None, max_wait_s: float = 0.0):
        """Fetch adapters this node lacks from its peers with `fetcher`; with `sessions` (the SessionTable), end idle
        sessions holding adapters when the budget is full of adapters in use, waiting at most `max_wait_s` for one
        to become idle enough."""
        self.fetcher, self.request_timeout_s = fetcher, request_timeout_s
        if sessions is not None:
            self.make_room, self.room_in_s = sessions.preempt_idle_adapter_session, sessions.adapter_preemptible_in_s
            self.max_wait_s = max_wait_s
            self.sessions = sessions

    def _adopt(self, adapter_id: str, piece: AdapterSlice) -> None:
        """Open sessions holding a narrower slice of `adapter_id` run from `piece`, the wider one now in its place
        (the blocks both hold are the same bytes): the store charges one slice an adapter, and only one stays in
        memory, however many widenings its sessions saw."""
        for session in self.sessions.sessions.values() if self.sessions is not None else ():
            if session.adapter_id == adapter_id and session.adapter is not None:
                session.adapter = piece

    async def _add(
        self,
        name: str,
        manifest: AdapterManifest,
        piece: AdapterSlice,
        *,
        private: bool,
        admit: Callable[[int], None] | None = None,
    ) -> None:
        """Add a fetched or sent (`private`: a client's own) slice, or hold it in place of a narrower slice of the
        same adapter a client sent; nothing when the store holds its blocks already (another session's meanwhile).
        Preempts idle sessions that hold adapters while the budget is full of adapters in use (waiting up to
        `max_wait_s` for one to become idle long enough); AdapterBudgetError when it still does not fit. What the
        store holds is looked at again after every wait. `admit(bytes)` (the asking peer's share: hold_or_fetch) runs
        before every try, with no wait between it and the store taking the slice, so the share it checks is the one
        the slice goes in under (other opens of the same peer may have come in during a wait)."""
        deadline = time.monotonic() + self.max_wait_s
        adapter_id = manifest.adapter_id
        # the store checks each block's hash: serialized and hashed here, in a thread, not on the node's event loop
        # (a slice merged from a fetch or an upload has no hashes yet; computed once, kept in the slice)
        await asyncio.to_thread(piece.block_hashes)
        while True:
            if admit is not None:
                admit(self.weigh(piece))
            try:
                entry = self.store.get(adapter_id) if adapter_id in self.store else None
                if entry is None:
                    self.store.add(name, manifest, piece)
                    if private:
                        self._private.add(adapter_id)
                else:
                    held = (entry.piece.start, entry.piece.end)
                    if piece.start <= held[0] and held[1] <= piece.end and held != (piece.start, piece.end):
                        self.store.widen(manifest, piece, None if private else name)  # a wider one: in its place
                        self._adopt(adapter_id, piece)
                return
            except AdapterBudgetError:
                if self.make_room():
                    continue
                wait_s = self.room_in_s()
                if wait_s is None or time.monotonic() + wait_s > deadline:
                    raise
            await asyncio.sleep(wait_s + 0.01)

    def _read(self, folder: str, start: int, end: int):
        whole = load_adapter_slice(folder, self.model_config, 0, None)
        manifest = adapter_manifest(whole, self.model_config.num_hidden_layers)
        return Path(folder).resolve().name[:64], manifest, whole.narrow(start, end)

    def hold(self, adapter_id: str, blocks: tuple[int, int]) -> tuple[AdapterSlice, Callable[[], None]]:
        """The slice of adapter `adapter_id`, pinned for a session, and the call that releases it (once). Raises
        AdapterMissingError when this node does not hold it."""
        store, private = self.store, self._private
        entry = store.get(adapter_id)
        if entry is None:
            raise AdapterMissingError(
                f"adapter {adapter_id} is not held by this node for blocks {blocks[0]}:{blocks[1]}; route to a node "
                "that announces it"
            )
        if not entry.piece.start <= blocks[0] < blocks[1] <= entry.piece.end:
            raise AdapterMissingError(
                f"this node holds adapter {adapter_id} for blocks {entry.piece.start}:{entry.piece.end}, not "
                f"{blocks[0]}:{blocks[1]}"
            )
        store.pin(adapter_id)
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            store.unpin(adapter_id)
            if adapter_id in private and entry.pins == 0:  # a client's own adapter leaves with its last session
                store.remove(adapter_id)
                private.discard(adapter_id)

        return entry.piece, release

    async def hold_or_fetch(
        self, adapter_id: str, blocks: tuple[int, int], *, admit: Callable[[int], None] | None = None
    ) -> tuple[AdapterSlice, Callable[[], None]]:
        """`hold`, first fetching the adapter's slice of this node's span from the peers announcing it when the node
        lacks it (kept and announced from then on, evicted least recently used first). Raises AdapterMissingError
        when no peer delivers it, AdapterBudgetError when it does not fit beside what open sessions use. `admit`
        checks the asking peer's share (raising AdapterBudgetError): with 1 byte before a fetch (a peer at its share
        gets none), then with the fetched slice's bytes right before the store takes it (`_add`: where making room
        may preempt idle sessions), so a peer over its share disturbs no one."""
        if not self._covers(adapter_id, blocks) and self.fetcher is not None and self.span is not None:
            # lacking it, or holding a narrower slice a client sent for its own sessions (the same adapter: its id
            # is its content), which must not hide the adapter its peers announce
            if admit is not None:
                admit(1)  # a peer already at its share gets nothing more: refused before the fetch
            store, span = self.store, self.span
            name, manifest, piece = await self.fetcher.fetch(adapter_id, *span)
            if self.store is not store or self.span != span:  # the node moved meanwhile: a slice of other blocks
                raise AdapterMissingError(
                    f"this node moved to blocks {self.span[0]}:{self.span[1]} while fetching adapter {adapter_id} "
                    f"for blocks {span[0]}:{span[1]}"
                )
            await self._add(name, manifest, piece, private=False, admit=admit)
            if self._covers(adapter_id, self.span):  # whole: kept and announced as any fetched adapter
                self._private.discard(adapter_id)
            logger.info("fetched adapter %s (%s) for blocks %d:%d from peers", name, adapter_id[:12], *self.span)
        return self.hold(adapter_id, blocks)

    def _covers(self, adapter_id: str, blocks: tuple[int, int]) -> bool:
        entry = self.store.get(adapter_id) if adapter_id in self.store else None
        return entry is not None and entry.piece.start <= blocks[0] < blocks[1] <= entry.piece.end

    def shared(self, adapter_id: str, start: int, end: int) -> tuple[AdapterManifest, AdapterSlice]:
        """The manifest and the slice this node holds of an adapter it announces, which covers blocks [start, end),
        for a peer that fetches them (a client's own adapter is not shared); the caller narrows it, off the event
        loop (a slice serializes itself to hash). Raises AdapterMissingError otherwise."""
        entry = self.store.get(adapter_id)
        if entry is None or adapter_id in self._private:
            raise AdapterMissingError(f"this node does not announce adapter {adapter_id}")
        if not entry.piece.start <= start < end <= entry.piece.end:
            raise AdapterMissingError(
                f"this node holds adapter {adapter_id} for blocks {entry.piece.start}:{entry.piece.end}, not "
                f"{start}:{end}"
            )
        return entry.manifest, entry.piece

    async def hold_uploaded(
        self, message: AdapterBlocks, upload: Frame, *, admit: Callable[[int], None] | None = None
    ) -> tuple[AdapterSlice, Callable[[], None]]:
        """A client's own adapter (AdapterBlocks and its frame), checked by hash, held for one session as `hold`
        holds a resident one. Raises AdapterHashError for bytes that do not match, AdapterError or BadRequestError
        for a malformed upload, AdapterBudgetError when it does not fit beside what open sessions use. `admit`: as
        for `hold_or_fetch`, with the checked slice's bytes right before the store takes it."""
        blocks = (message.start_block, message.end_block)
        if not self._covers(message.adapter_id, blocks):  # (a narrower slice a client sent: widened to this one)
            manifest, piece = await asyncio.to_thread(self._check_upload, message, upload)
            await self._add(f"private-{manifest.adapter_id[:8]}", manifest, piece, private=True, admit=admit)
        return self.hold(message.adapter_id, blocks)

    def _check_upload(self, message: AdapterBlocks, upload: Frame):
        count = message.end_block - message.start_block
        if len(upload.tensors) != count + 1:
            raise BadRequestError(f"adapter blocks: expected a manifest and {count} block(s), got "
                                  f"{len(upload.tensors)} tensors")  # fmt: skip
        manifest = AdapterManifest.from_bytes(
            bytes_from_proto(upload.tensors[0], max_bytes=MAX_MANIFEST_BYTES), message.adapter_id
        )
        if manifest.num_blocks != self.model_config.num_hidden_layers:
            raise AdapterError(
                f"the adapter's manifest has {manifest.num_blocks} blocks, the model {self.model_config.num_hidden_layers}"
            )
        blobs = [bytes_from_proto(tensor, max_bytes=self.budget_bytes) for tensor in upload.tensors[1:]]
        piece = slice_from_blocks(manifest, message.start_block, message.end_block, blobs)
        check_fits_model(piece, self.model_config)  # before any session's batch runs it
        return manifest, piece

    def announced(self) -> tuple[AdapterInfo, ...]:
        """What the node's record says it holds (clients' own adapters are theirs: not announced)."""
        sizes = {entry.adapter_id: entry.piece.nbytes for entry in self.store.entries()}  # what a fetcher gets
        return tuple(
            AdapterInfo(
                adapter_id=adapter_id,
                name=name,
                slice_sha256=slice_sha256,
                rank=rank,
                slice_bytes=sizes[adapter_id],
            )
            for adapter_id, name, slice_sha256, rank in self.store.announced(leave_out=self._private)
        )  # (left out before the list is cut to its length: clients' own adapters take none of its places)
