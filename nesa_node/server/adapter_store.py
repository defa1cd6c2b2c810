"""The LoRA adapters resident on a node: their slices under a byte budget, least recently used evicted first.

Issue 21: adapter bytes count against a node budget with LRU eviction, never evicting an adapter an open session
uses. Each entry is one adapter's slice of this node's blocks (sharding/lora.py), keyed by the adapter id (the sha256
of its manifest, sharding/lora_identity.py) and charged what the store's `weigh` says: by default
`AdapterSlice.nbytes`, the length of its canonical bytes (what it weighs stored); a node charges that plus the
float32 copies running it on its device makes (`AdapterSlice.run_bytes`: on a GPU node with bfloat16 factors, three
times the stored bytes), charged when it enters, not when a first step makes them.

An entry is kept while
- a session pins it (`pin` at open, `unpin` at close; counted, several sessions may share one adapter), or
- the operator preloaded it (`nesa-node run --adapters DIR`), or
- nothing else needs its room: `add` evicts the least recently used of the other entries until the new one fits, and
  refuses it with AdapterBudgetError (at once, evicting nothing) when even evicting all of them would not make room.

A client-private adapter (pushed for one session) is meant to leave at that session's close: `unpin`, then `remove`.

Pure bookkeeping: no I/O, no clock, no locks. Call it from the node's event loop only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable

from nesa_node.errors import AdapterBudgetError, AdapterError
from nesa_node.protocol.records import MAX_LIST_ITEMS
from nesa_node.sharding.lora import AdapterManifest, AdapterSlice, check_slice

logger = logging.getLogger(__name__)

MAX_ANNOUNCED = MAX_LIST_ITEMS  # adapters a node lists in its record (NodeInfo.adapters holds at most this many)
MAX_NAME_LENGTH = 64  # AdapterInfo.name's limit in the record (protocol/records.py)


@dataclasses.dataclass(eq=False)
class AdapterEntry:
    """One resident adapter: what people call it, its manifest, this node's slice of it, and who keeps it."""

    name: str
    manifest: AdapterManifest
    piece: AdapterSlice
    preloaded: bool = False  # the operator's --adapters: never evicted
    pins: int = 0  # open sessions using it: never evicted while above 0
    charge: int = 0  # bytes of the budget it takes (the store's weigh)

    @property
    def adapter_id(self) -> str:
        return self.manifest.adapter_id

    @property
    def evictable(self) -> bool:
        return self.pins == 0 and not self.preloaded


class AdapterStore:
    """The adapters a node holds, at most `budget_bytes` charged by `weigh` (default: slice bytes; module
    docstring)."""

    def __init__(self, budget_bytes: int, weigh: Callable[[AdapterSlice], int] | None = None):
        if type(budget_bytes) is not int or budget_bytes < 0:
            raise ValueError(f"an adapter budget is a number of bytes >= 0, not {budget_bytes!r}")
        self._budget = budget_bytes
        self._weigh = weigh or (lambda piece: piece.nbytes)
        self._entries: OrderedDict[str, AdapterEntry] = OrderedDict()  # least recently used first
        self._used = 0

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def used_bytes(self) -> int:
        """Bytes charged for the resident slices; never above budget_bytes."""
        return self._used

    @property
    def resident(self) -> int:
        """Adapters held."""
        return len(self._entries)

    @property
    def pinned(self) -> int:
        """Adapters at least one open session uses."""
        return sum(1 for entry in self._entries.values() if entry.pins > 0)

    def __contains__(self, adapter_id: object) -> bool:
        """Whether the adapter is resident; unlike `get`, does not count as a use."""
        return adapter_id in self._entries

    def entries(self) -> list[AdapterEntry]:
        """The resident entries, least recently used first; does not count as a use."""
        return list(self._entries.values())

    def add(
        self, name: str, manifest: AdapterManifest, piece: AdapterSlice, *, preloaded: bool = False
    ) -> AdapterEntry:
        """Hold `piece`, this node's slice of the adapter `manifest` names, as `name`; returns its entry.

        Already resident: the entry is marked used and returned (preloaded=True makes it preloaded from then on;
        name and slice stay those of the first add). Otherwise the least recently used entries that no session pins
        and the operator did not preload are evicted until its charge fits. Raises AdapterBudgetError, evicting
        nothing, when it cannot fit even then (or is larger than the whole budget); AdapterHashError when `piece`
        is not a slice of `manifest`'s adapter; AdapterError for a name the node record cannot carry."""
        adapter_id = manifest.adapter_id
        entry = self._entries.get(adapter_id)
        if entry is not None:
            entry.preloaded = entry.preloaded or preloaded
            self._entries.move_to_end(adapter_id)
            return entry
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_LENGTH:
            raise AdapterError(f"an adapter's name has 1 to {MAX_NAME_LENGTH} characters, not {name!r}")
        check_slice(manifest, piece)
        charge = self._weigh(piece)
        self._make_room(name, adapter_id, charge)
        entry = AdapterEntry(name, manifest, piece, preloaded=preloaded, charge=charge)
        self._entries[adapter_id] = entry
        self._used += charge
        return entry

    def widen(self, manifest: AdapterManifest, piece: AdapterSlice, name: str | None = None) -> AdapterEntry:
        """Hold `piece` in place of the resident slice of the same adapter it contains (a client sent a narrow
        span of it, a session needs more), as `name` when given: the entry, its pins and its place stay (the blocks
        both hold are the same bytes, checked against the manifest; the node moves sessions holding the old slice to
        this one: server/adapters.py NodeAdapters._adopt). Evicts others as `add` does for
        the extra bytes; AdapterBudgetError when they do not fit, AdapterError when `piece` does not contain the
        resident slice."""
        entry = self._entries.get(manifest.adapter_id)
        if entry is None:
            raise AdapterError(f"this node does not hold adapter {manifest.adapter_id[:16]}…; add it")
        if not piece.start <= entry.piece.start < entry.piece.end <= piece.end:
            raise AdapterError(
                f"blocks {piece.start}:{piece.end} do not contain the resident {entry.piece.start}:{entry.piece.end}"
            )
        if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_LENGTH):
            raise AdapterError(f"an adapter's name has 1 to {MAX_NAME_LENGTH} characters, not {name!r}")
        check_slice(manifest, piece)
        charge = self._weigh(piece)
        if charge > entry.charge:
            pinned, entry.pins = entry.pins, entry.pins + 1  # not evicted to make room for itself
            try:
                self._make_room(entry.name, entry.adapter_id, charge - entry.charge)
            finally:
                entry.pins = pinned
        if name is not None:
            entry.name = name
        self._used += charge - entry.charge
        entry.piece, entry.charge = piece, charge
        self._entries.move_to_end(entry.adapter_id)
        return entry

    def get(self, adapter_id: str) -> AdapterEntry | None:
        """The resident entry of `adapter_id`, marked used; None when the node does not hold it."""
        entry = self._entries.get(adapter_id)
        if entry is not None:
            self._entries.move_to_end(adapter_id)
        return entry

    def pin(self, adapter_id: str) -> AdapterEntry:
        """Keep `adapter_id` until a matching `unpin` (one per open session that uses it); marks it used.

        Raises AdapterError when the node does not hold it (add it first)."""
        entry = self._entries.get(adapter_id)
        if entry is None:
            raise AdapterError(f"this node does not hold adapter {adapter_id[:16]}…; fetch and add it before pinning")
        entry.pins += 1
        self._entries.move_to_end(adapter_id)
        return entry

    def unpin(self, adapter_id: str) -> None:
        """Release one `pin` (a session closed); it stays resident, as recently used, until evicted.

        Raises AdapterError for an adapter not pinned here: a pin and unpin that do not pair up."""
        entry = self._entries.get(adapter_id)
        if entry is None or entry.pins == 0:
            raise AdapterError(f"adapter {adapter_id[:16]}… is not pinned on this node; each unpin follows one pin")
        entry.pins -= 1
        self._entries.move_to_end(adapter_id)

    def remove(self, adapter_id: str) -> bool:
        """Drop `adapter_id` now, preloaded or not (an unload, or a client-private adapter at its session's close);
        False when it was not resident. Raises AdapterError while a session pins it."""
        entry = self._entries.get(adapter_id)
        if entry is None:
            return False
        if entry.pins:
            raise AdapterError(
                f"adapter {entry.name!r} ({adapter_id[:16]}…) is in use by {entry.pins} open session(s); unload it "
                "when they close"
            )
        self._evict(entry)
        return True

    def announced(self, leave_out: frozenset[str] | set[str] = frozenset()) -> list[tuple[str, str, str, int]]:
        """(adapter id, name, slice sha256, rank) of the resident adapters for the node record, but those of
        `leave_out` (clients' own): preloaded first, then the rest, each part most recently used first; at most
        MAX_ANNOUNCED. The rank is the adapter's (the manifest's), the same on every node, not this slice's."""
        newest_first = [e for e in reversed(self._entries.values()) if e.adapter_id not in leave_out]
        ordered = [e for e in newest_first if e.preloaded] + [e for e in newest_first if not e.preloaded]
        return [(e.adapter_id, e.name, e.piece.sha256, e.manifest.rank) for e in ordered[:MAX_ANNOUNCED]]

    def _make_room(self, name: str, adapter_id: str, needed: int) -> None:
        """Evict least recently used evictable entries until `needed` more bytes fit; raise first if they cannot."""
        free = self._budget - self._used
        if needed <= free:
            return
        evictable = [entry for entry in self._entries.values() if entry.evictable]  # least recently used first
        if needed > free + sum(entry.charge for entry in evictable):
            raise AdapterBudgetError(self._refusal(name, adapter_id, needed))
        for entry in evictable:
            if needed <= self._budget - self._used:
                break
            self._evict(entry)

    def _evict(self, entry: AdapterEntry) -> None:
        del self._entries[entry.adapter_id]
        self._used -= entry.charge
        logger.debug("adapter %s (%s) left the store, %d bytes", entry.name, entry.adapter_id[:16], entry.charge)

    def _refusal(self, name: str, adapter_id: str, needed: int) -> str:
        what = f"adapter {name!r} ({adapter_id[:16]}…, {needed} bytes on this node's blocks)"
        if needed > self._budget:
            return f"{what} is larger than this node's whole adapter budget of {self._budget} bytes; use a node with a larger one"
        pinned = [entry for entry in self._entries.values() if entry.pins > 0]
        preloaded = [entry for entry in self._entries.values() if entry.preloaded and entry.pins == 0]
        return (
            f"{what} does not fit this node's adapter budget of {self._budget} bytes: "
            f"{sum(e.charge for e in pinned)} bytes are held by {len(pinned)} adapter(s) open sessions use and "
            f"{sum(e.charge for e in preloaded)} by {len(preloaded)} preloaded one(s); retry when sessions "
            "close, or use another node"
        )


__all__ = ["MAX_ANNOUNCED", "AdapterEntry", "AdapterStore"]
