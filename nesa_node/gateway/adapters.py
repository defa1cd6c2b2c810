"""LoRA adapters through the gateway: which adapter a request's `model` names, the adapters `/v1/models` lists, and
`POST /v1/adapters/load|unload`.

A request names the base model (`--model-name`), an adapter as `base:adapter` or by the adapter's name alone. Names
come from two places: what the swarm's nodes announce (their preloaded adapters, `nesa-node run --adapters`) and
what was loaded into this gateway from a folder under `--adapter-dir`; a loaded adapter is the gateway's own, sent
to the nodes of each request's chain that lack it (client/session_chain.py OwnAdapter), and wins over an announced
one of the same name. Only folders under `--adapter-dir` can be loaded: an HTTP client never makes the gateway read
another path. Without `--adapter-dir`, loading answers 403. Loading and unloading take the gateway's API key, and
without keys are answered only on this machine (gateway/auth.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nesa_node.errors import AdapterError, AdapterMissingError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # as records.AdapterInfo.name allows, and no ':'
MAX_LOADED = 64  # adapters loaded into one gateway at once (each is held whole in its memory)
# names no node announces: at most one DHT read for them per period (requests naming made-up models in a loop would
# otherwise each read the swarm's records afresh); within it such names are looked up in the records at hand
FRESH_READ_PERIOD_S = 1.0


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    path: str = Field(min_length=1, max_length=4096)  # relative to --adapter-dir, or absolute inside it

    @field_validator("path")
    @classmethod
    def _a_file_name(cls, path: str) -> str:
        """A path the file system can take: no NUL, no lone surrogate (either would fail the folder's lookup)."""
        if "\0" in path or any(0xD800 <= ord(c) <= 0xDFFF for c in path):
            raise ValueError("an adapter path holds no NUL character and no lone surrogate")
        return path


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)


class GatewayAdapters:
    """The adapters a gateway serves (see the module docstring); `model` is its AsyncDistributedModel."""

    def __init__(self, model, *, base_name: str, adapter_dir: str | None = None):
        self.model = model
        self.base_name = base_name
        self.adapter_dir = Path(adapter_dir).resolve() if adapter_dir else None
        self.loaded: dict[str, str] = {}  # name -> adapter id, loaded here from a folder
        self._loading = asyncio.Lock()
        self._fresh_read_at = -math.inf  # monotonic s of the last DHT read for a name that turned out missing

    async def resolve(self, requested: str) -> str | None:
        """The adapter id a request's `model` names; None for the base model. Raises AdapterMissingError for a
        name neither loaded here nor announced by the swarm (the caller answers 404)."""
        if requested == self.base_name:
            return None
        prefix = self.base_name + ":"
        name = requested[len(prefix) :] if requested.startswith(prefix) else requested
        if name in self.loaded:
            return self.loaded[name]
        now = time.monotonic()
        if now - self._fresh_read_at < FRESH_READ_PERIOD_S:  # a name just read for and not found, or made up:
            ids = (await self.model.announced_adapters()).get(name, set())  # the records at hand, no new read
            if len(ids) == 1:
                return next(iter(ids))
            raise AdapterMissingError(
                f"adapter {name!r}: no node announces it (as of {now - self._fresh_read_at:.1f} s ago)"
            )
        try:
            return await self.model.adapter_by_name(name)
        except AdapterMissingError:
            self._fresh_read_at = now  # names nobody announces cost the DHT one read a period, however many come
            raise

    def label(self, adapter_id: str | None) -> str:
        """The metrics label of a request's adapter: "base", the name it was loaded here under, or "swarm" (an
        announced one: names any peer can make up must not grow the label's values)."""
        if adapter_id is None:
            return "base"
        return next((name for name, loaded in self.loaded.items() if loaded == adapter_id), "swarm")

    async def listed(self) -> list[tuple[str, str]]:
        """(name, where from) of every adapter a request may name: "gateway" (loaded here) or "swarm"."""
        announced = await self.model.announced_adapters(max_age_s=0.0)  # a listing shows the swarm as it is now
        names = {name: "swarm" for name, ids in announced.items() if len(ids) == 1}
        names.update({name: "gateway" for name in self.loaded})
        return sorted(names.items())

    async def load(self, request: LoadAdapter) -> dict:
        """Load the adapter folder `request.path` under `request.name`. Raises PermissionError without an
        adapter directory or for a path outside it, AdapterError for a folder that is not an adapter of the
        model."""
        if self.adapter_dir is None:
            raise PermissionError("this gateway loads no adapters: start it with --adapter-dir DIR")
        if request.name not in self.loaded and len(self.loaded) >= MAX_LOADED:
            raise AdapterError(f"{MAX_LOADED} adapters are loaded already: unload one first")
        folder = (self.adapter_dir / request.path).resolve()
        if not folder.is_relative_to(self.adapter_dir):
            raise PermissionError(f"{request.path!r} is outside the gateway's adapter directory")
        if not await asyncio.to_thread(folder.is_dir):
            raise AdapterError(f"no adapter folder {request.path!r} in the gateway's adapter directory")
        async with self._loading:  # one folder read at a time: each holds a whole adapter in memory
            if request.name not in self.loaded and len(self.loaded) >= MAX_LOADED:  # (loads that waited meanwhile)
                raise AdapterError(f"{MAX_LOADED} adapters are loaded already: unload one first")
            adapter_id = await self.model.resolve_adapter(str(folder))
            replaced = self.loaded.get(request.name)
            self.loaded[request.name] = adapter_id
            if replaced is not None and replaced not in self.loaded.values():  # a name loaded again from another folder
                self.model.own_adapters.pop(replaced, None)
        return {"name": request.name, "id": adapter_id, "parent": self.base_name}

    def unload(self, request: UnloadAdapter) -> dict:
        """Forget the adapter loaded as `request.name` (requests already running keep it to their end). Raises
        AdapterMissingError for a name not loaded here."""
        adapter_id = self.loaded.pop(request.name, None)
        if adapter_id is None:
            raise AdapterMissingError(f"no adapter {request.name!r} was loaded into this gateway")
        if adapter_id not in self.loaded.values():
            self.model.own_adapters.pop(adapter_id, None)
        return {"name": request.name, "unloaded": True}


__all__ = ["GatewayAdapters", "LoadAdapter", "UnloadAdapter"]
