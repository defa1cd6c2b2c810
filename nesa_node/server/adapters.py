"""The LoRA adapters a node serves (Nesa sec. 2.4, eq. 6): slices of PEFT adapters for the node's blocks, kept in
an AdapterStore (server/adapter_store.py) under a byte budget, announced in the node's record, and held by the
sessions that run with them.

- Preloaded (`nesa-node run --adapters DIR ...`): each folder is read whole once (its manifest of per-block hashes
  names the adapter the same way on every node, sharding/lora.py), and the node keeps the slice of its span. They
  stay resident; a node that moves reloads them for its new span.
- A session opened with an adapter holds it (never evicted) until it closes; a step runs its rows with it
  (server/compute.py), also inside a decode batch with other sessions' adapters.
- An adapter the node does not hold is refused with AdapterMissingError: the client routes to nodes that hold it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from nesa_node.errors import AdapterMissingError
from nesa_node.protocol.records import AdapterInfo
from nesa_node.server.adapter_store import AdapterStore
from nesa_node.sharding.lora import AdapterSlice, adapter_manifest, load_adapter_slice

logger = logging.getLogger(__name__)

__all__ = ["NodeAdapters"]


class NodeAdapters:
    """The adapters of one node (see the module docstring). `folders`: the preloaded adapter folders;
    `budget_bytes`: what their slices and fetched ones may take together."""

    def __init__(self, model_config, folders: tuple[str, ...] = (), *, budget_bytes: int):
        self.model_config = model_config
        self.folders = tuple(folders)
        self.budget_bytes = budget_bytes
        self.store = AdapterStore(budget_bytes)

    async def load_span(self, start: int, end: int) -> None:
        """Hold the preloaded adapters' slices of blocks [start, end) in a fresh store (no session may be open: a
        node loads them at start and after a move). Raises AdapterError (and its kinds) for a folder that is not a
        LoRA adapter of this model, AdapterBudgetError when they do not fit the budget together."""
        store = AdapterStore(self.budget_bytes)
        for folder in self.folders:
            name, manifest, piece = await asyncio.to_thread(self._read, folder, start, end)
            store.add(name, manifest, piece, preloaded=True)
            logger.info("adapter %s (%s, rank %d): %d bytes for blocks %d:%d", name, manifest.adapter_id[:12],
                        manifest.rank, piece.nbytes, start, end)  # fmt: skip
        self.store = store

    def _read(self, folder: str, start: int, end: int):
        whole = load_adapter_slice(folder, self.model_config, 0, None)
        manifest = adapter_manifest(whole, self.model_config.num_hidden_layers)
        return Path(folder).resolve().name[:64], manifest, whole.narrow(start, end)

    def hold(self, adapter_id: str, blocks: tuple[int, int]) -> tuple[AdapterSlice, Callable[[], None]]:
        """The slice of adapter `adapter_id`, pinned for a session, and the call that releases it (once). Raises
        AdapterMissingError when this node does not hold it."""
        store = self.store
        if store.get(adapter_id) is None:
            raise AdapterMissingError(
                f"adapter {adapter_id} is not held by this node for blocks {blocks[0]}:{blocks[1]}; route to a node "
                "that announces it"
            )
        entry = store.pin(adapter_id)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                store.unpin(adapter_id)

        return entry.piece, release

    def announced(self) -> tuple[AdapterInfo, ...]:
        """What the node's record says it holds."""
        return tuple(
            AdapterInfo(adapter_id=adapter_id, name=name, slice_sha256=slice_sha256, rank=rank)
            for adapter_id, name, slice_sha256, rank in self.store.announced()
        )
