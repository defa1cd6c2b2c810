"""How a client names and finds LoRA adapters: by id, by the folder it holds, or by the name nodes announce; which
nodes can get an adapter they lack, and what getting it costs routing. AsyncDistributedModel inherits these."""

from __future__ import annotations

import asyncio
import re
import statistics
from pathlib import Path

from nesa_node.client.session_chain import OwnAdapter
from nesa_node.client.train_edges import with_edge_weights
from nesa_node.errors import AdapterError, AdapterMissingError
from nesa_node.sharding.lora import adapter_manifest, load_adapter_slice, read_adapter_config, slice_blobs
from nesa_node.sharding.lora_edges import edges_of_modules_to_save, peft_edge_key, read_edge_weights


def own_adapter_of_folder(folder: str, model_config, *, edges: tuple[str, ...] = ()) -> OwnAdapter:
    """The PEFT LoRA adapter in `folder`, whole, as the client sends it to nodes (sharding/lora.py); `edges`: its
    edge layers (modules_to_save) left out, for a client that applies them itself (any other tensor outside the
    blocks is refused)."""
    allowed = {peft_edge_key(name) for name in edges}
    whole = load_adapter_slice(folder, model_config, 0, None, outside_allowed=allowed)
    return OwnAdapter(adapter_manifest(whole, model_config.num_hidden_layers), tuple(slice_blobs(whole)))


def edges_of_folder(text: str) -> tuple[str, ...]:
    """The edge layers the adapter in folder `text` trains whole (none for an id, a name or a plain LoRA)."""
    if re.fullmatch(r"[0-9a-f]{64}", text) or not Path(text).is_dir():
        return ()
    return edges_of_modules_to_save(read_adapter_config(text).modules_to_save, text)


def adapter_id_of_folder(folder: str, model_config) -> str:
    """The id of the PEFT LoRA adapter in `folder` for this model (the sha256 of its manifest of block hashes)."""
    return own_adapter_of_folder(folder, model_config).adapter_id


class AdapterLookup:
    """Adapter lookups over `self.swarm`, `self.own_adapters` and `self.model_config` (AsyncDistributedModel's)."""

    edge_adapter: str | None = None  # the adapter whose trained edge layers this client's own layers carry

    async def resolve_model_adapter(self, adapter: str | Path) -> str:
        """resolve_adapter for the model's own adapter (`from_pretrained(adapter=...)`): a folder whose adapter also
        trained the embeddings, the final norm or the LM head whole (peft's modules_to_save, a fine-tuning session's
        LoraSpec.edges) has them put into this client's layers; nodes get only its blocks."""
        text = str(adapter)
        names = await asyncio.to_thread(edges_of_folder, text)
        if not names:
            return await self.resolve_adapter(adapter)
        weights = await asyncio.to_thread(read_edge_weights, text, names, self.model_config)
        own = await asyncio.to_thread(own_adapter_of_folder, text, self.model_config, edges=names)
        self.edges = with_edge_weights(self.edges, weights)
        self.own_adapters[own.adapter_id] = own
        self.edge_adapter = own.adapter_id
        return own.adapter_id

    def check_session_adapter(self, adapter_id: str | None) -> None:
        """AdapterError when this client's layers carry an adapter's edge layers and a session would run another, or
        when a session with an adapter would run blocks here (private_edges), which run the base weights only."""
        edge_blocks = getattr(self, "edge_blocks", None)
        if adapter_id is not None and edge_blocks is not None and (edge_blocks.front or edge_blocks.back):
            raise AdapterError(
                "this client runs its first and last blocks itself (private_edges) with the base weights: a session "
                "with a LoRA adapter would run those blocks without it. Use a client without private_edges for "
                "adapters (boundary_noise alone runs no block here and takes them)"
            )
        if self.edge_adapter is not None and adapter_id != self.edge_adapter:
            raise AdapterError(
                f"this client's embeddings, norm and LM head are those of adapter {self.edge_adapter[:12]}… (trained "
                "with the blocks): a session with another adapter, or none, needs a client of its own"
            )

    async def resolve_adapter(self, adapter: str | Path) -> str:
        """The id of the LoRA adapter `adapter` names: an id (64 hex characters) as it is; a folder holding a PEFT
        adapter (its manifest, computed here: the id nodes announce for the same adapter; the client then sends its
        blocks to the nodes of a chain that do not hold it); else a name nodes announce (records.AdapterInfo). Raises AdapterError for a folder that is not an adapter of this model,
        AdapterMissingError for a name no node announces or two adapters share."""
        text = str(adapter)
        if re.fullmatch(r"[0-9a-f]{64}", text):
            return text
        if await asyncio.to_thread(Path(text).is_dir):
            names = await asyncio.to_thread(edges_of_folder, text)
            own = await asyncio.to_thread(own_adapter_of_folder, text, self.model_config, edges=names)
            if names and own.adapter_id != self.edge_adapter:
                raise AdapterError(
                    f"the adapter in {text} also trained {', '.join(names)} whole: they live in the client, so load "
                    "it with from_pretrained(..., adapter=FOLDER) (`nesa-node generate --adapter FOLDER`)"
                )
            self.own_adapters[own.adapter_id] = own
            return own.adapter_id
        return await self.adapter_by_name(text)

    async def adapter_reachable(self, adapter_id: str) -> frozenset[str] | None:
        """The nodes that lack adapter `adapter_id` but can fetch it: those whose blocks the other nodes announcing
        it cover; None when this client sends it (any node)."""
        if adapter_id in self.own_adapters:
            return None
        infos = [record.info for record in await self.swarm.node_records()]
        holders = [info for info in infos if any(held.adapter_id == adapter_id for held in info.adapters)]
        reachable = set()
        for info in infos:
            covered = set()
            for holder in holders:
                if holder.peer_id != info.peer_id:
                    covered.update(range(holder.start_block, holder.end_block))
            if covered.issuperset(range(info.start_block, info.end_block)):
                reachable.add(info.peer_id)
        return frozenset(reachable)

    async def adapter_block_bytes(self, adapter_id: str) -> float:
        """Bytes per block of adapter `adapter_id` that a node lacking it has to get: the client's own copy (it
        sends it), else what the nodes announcing it hold (a node fetches it from them); 0 when neither, and then
        only nodes holding it can serve it."""
        own = self.own_adapters.get(adapter_id)
        if own is not None:
            return own.block_bytes
        sizes = [
            info.slice_bytes / (record.info.end_block - record.info.start_block)
            for record in await self.swarm.node_records()
            for info in record.info.adapters
            if info.adapter_id == adapter_id and info.slice_bytes > 0
        ]
        return float(statistics.median(sizes)) if sizes else 0.0  # one peer's claim cannot set it alone

    async def announced_adapters(self, *, max_age_s: float | None = None) -> dict[str, set[str]]:
        """Adapter name -> the ids the swarm's nodes announce under it (records.AdapterInfo), from records at most
        `max_age_s` old (default: the swarm's records_stale_s)."""
        named: dict[str, set[str]] = {}
        for record in await self.swarm.node_records(max_age_s=max_age_s):
            for info in record.info.adapters:
                named.setdefault(info.name, set()).add(info.adapter_id)
        return named

    async def adapter_by_name(self, name: str) -> str:
        """The id of the adapter the swarm's nodes announce as `name`. Raises AdapterMissingError when none does or
        two different adapters share the name."""
        ids = (await self.announced_adapters()).get(name, set())
        if len(ids) != 1:  # the records at hand may predate the adapter, or a node that left: read them now
            ids = (await self.announced_adapters(max_age_s=0.0)).get(name, set())
        if len(ids) != 1:
            found = "no node announces it" if not ids else f"{len(ids)} different adapters have this name"
            raise AdapterMissingError(
                f"adapter {name!r}: {found}; name it by its folder or its id (nesa-node status lists adapters)"
            )
        return next(iter(ids))


__all__ = ["AdapterLookup", "adapter_id_of_folder", "own_adapter_of_folder"]
