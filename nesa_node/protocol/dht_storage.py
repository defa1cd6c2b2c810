"""A bound on what other peers can make a peer keep in its DHT storage.

hivemind keeps every record a peer is asked to store (`rpc_store`) until it expires, with no limit: one peer
storing 24,000 junk records grew a victim by about 200 MB in 6 s. Every DHT peer of a process that imports
nesa_node.peer (nodes, bootstrap peers, clients) accounts each record another peer stored with it (key, subkey and
value bytes, and a count) in a `StorageLedger`, per sender (the peer that called `rpc_store`) and in total:

- a sender over its own share is refused: its store answers False for those records, and nothing of anyone else
  is evicted for it, so one identity cannot push out the records of others;
- when the total is full, records are evicted, the oldest of the sender holding most of its share first (a
  refresh is a new insertion): many identities together cycle the storage but cannot grow it, and push out
  each other's records before the few an honest node stores;
- records a peer stores for itself (its own announcements, the values its reads cache) are not accounted, so
  they are never refused or evicted.

A peer's storage and its cache (stores marked `in_cache`) share one ledger. `install()` wraps
`DHTProtocol.rpc_store` to know the sender and `DHTProtocol.create` to give each protocol bounded storages;
`set_storage_limits` sets the limits of the peers started afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import itertools
import logging
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import TimedStorage

logger = logging.getLogger(__name__)

DEFAULT_TOTAL_BYTES = 64 * 1024 * 1024  # guess: a swarm's NodeInfo records (a few KiB per node and model) use far less
DEFAULT_TOTAL_RECORDS = 100_000  # bounds the Python objects per record, which its bytes do not count
SENDER_SHARE = 1 / 16  # of each total, per sender: room for a peer that hands a joining peer the records it holds
HEAP_SLACK = 1024  # stale expiration-heap entries tolerated beyond twice the live ones before a rebuild


@dataclass(frozen=True)
class StorageLimits:
    """Per peer: what all other peers together (`total_*`) and one sender (`sender_*`) may make it store."""

    total_bytes: int = DEFAULT_TOTAL_BYTES
    total_records: int = DEFAULT_TOTAL_RECORDS
    sender_bytes: int = int(DEFAULT_TOTAL_BYTES * SENDER_SHARE)
    sender_records: int = int(DEFAULT_TOTAL_RECORDS * SENDER_SHARE)

    def __post_init__(self) -> None:
        if min(self.total_bytes, self.total_records, self.sender_bytes, self.sender_records) < 1:
            raise ValueError(f"storage limits must be positive: {self}")
        if self.sender_bytes > self.total_bytes or self.sender_records > self.total_records:
            raise ValueError(f"a sender's share cannot exceed the total: {self}")

    @classmethod
    def from_totals(cls, total_bytes: int, total_records: int, share: float = SENDER_SHARE) -> StorageLimits:
        """Totals, and `share` of each for one sender (at least one record of at most the whole byte budget)."""
        return cls(total_bytes, total_records, max(1, int(total_bytes * share)), max(1, int(total_records * share)))


@dataclass
class Usage:
    records: int = 0
    bytes: int = 0


@dataclass
class _Entry:
    sender: Hashable
    size: int
    expiration: float


@dataclass
class _SenderRecords:
    usage: Usage = field(default_factory=Usage)
    records: OrderedDict[tuple, None] = field(default_factory=OrderedDict)  # this sender's, oldest first


class StorageLedger:
    """Records other peers stored here: per sender and in total, in insertion order, with their expirations.

    Pure bookkeeping over opaque record ids `(group, item)` (a group is one DHT key: the records under it go
    together when a regular value and a dictionary replace each other). The caller asks `admits` before a store,
    calls `add` once the store succeeded and deletes the records `add` returns.

    When the total is full, the oldest record of the heaviest sender (the largest fraction of its share, in records
    or bytes) goes first, rather than the oldest record overall: identities are free, so many senders each
    filling their share would otherwise push out, oldest first, the one record an honest node announced."""

    def __init__(self, limits: StorageLimits) -> None:
        self.limits = limits
        self.total = Usage()
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()  # oldest insertion first
        self._senders: dict[Hashable, _SenderRecords] = {}
        self._groups: dict[Hashable, set[tuple]] = {}
        self._expirations: list[tuple[float, int, tuple, _Entry]] = []  # lazy heap: replaced entries stay a while
        self._weights: list[tuple[float, int, Hashable]] = []  # lazy max-heap of (-weight, order, sender)
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, record_id: tuple) -> bool:
        return record_id in self._entries

    def usage(self, sender: Hashable) -> Usage:
        found = self._senders.get(sender)
        return Usage(found.usage.records, found.usage.bytes) if found else Usage()

    def admits(self, sender: Hashable, record_id: tuple, size: int, now: float) -> bool:
        """Whether `sender` may store this record (`size` bytes) without going over its own share."""
        self.expire(now)
        usage = self.usage(sender)
        records, size_after = usage.records + 1, usage.bytes + size
        previous = self._entries.get(record_id)
        if previous is not None and previous.sender == sender:  # a refresh replaces the sender's own record
            records, size_after = records - 1, size_after - previous.size
        return records <= self.limits.sender_records and size_after <= self.limits.sender_bytes

    def add(self, sender: Hashable, record_id: tuple, size: int, expiration: float, now: float) -> list[tuple]:
        """Account a record `sender` just stored (replacing any earlier one with this id, whoever stored it).
        Returns the records to delete so that the totals hold again (never this one)."""
        self.forget(record_id)
        entry = _Entry(sender, size, expiration)
        self._entries[record_id] = entry
        self._senders.setdefault(sender, _SenderRecords()).records[record_id] = None
        self._groups.setdefault(record_id[0], set()).add(record_id)
        self._charge(entry, 1)
        heapq.heappush(self._expirations, (expiration, next(self._order), record_id, entry))
        self._compact()
        self.expire(now)
        return self._evict_over_total(keep=record_id)

    def forget(self, record_id: tuple) -> None:
        """Stop accounting a record (gone from the storage, or now the peer's own)."""
        entry = self._entries.pop(record_id, None)
        if entry is None:
            return
        del self._senders[entry.sender].records[record_id]
        self._charge(entry, -1)
        group = self._groups[record_id[0]]
        group.discard(record_id)
        if not group:
            del self._groups[record_id[0]]

    def forget_group(self, group: Hashable) -> None:
        for record_id in list(self._groups.get(group, ())):
            self.forget(record_id)

    def expire(self, now: float) -> None:
        """Forget records past their expiration: the storage drops them on its own (at its next access)."""
        while self._expirations and self._expirations[0][0] < now:
            _, _, record_id, entry = heapq.heappop(self._expirations)
            if self._entries.get(record_id) is entry:
                self.forget(record_id)

    def _evict_over_total(self, keep: tuple) -> list[tuple]:
        evicted = []
        while self.total.records > self.limits.total_records or self.total.bytes > self.limits.total_bytes:
            victim = self._oldest_of_heaviest(keep)
            if victim is None:  # only `keep` is left: cannot happen while a sender's share fits in the total
                break
            self.forget(victim)
            evicted.append(victim)
        return evicted

    def _oldest_of_heaviest(self, keep: tuple) -> tuple | None:
        while self._weights:
            negative_weight, _, sender = self._weights[0]
            found = self._senders.get(sender)
            if found is not None and -negative_weight == self._weight(found.usage):
                oldest = next(iter(found.records))
                if oldest != keep:
                    return oldest
                break  # the heaviest sender holds only the record being added: fall back to the oldest overall
            heapq.heappop(self._weights)  # stale: the sender's usage changed since
        return next((record_id for record_id in self._entries if record_id != keep), None)

    def _weight(self, usage: Usage) -> float:
        return max(usage.records / self.limits.sender_records, usage.bytes / self.limits.sender_bytes)

    def _charge(self, entry: _Entry, sign: int) -> None:
        found = self._senders[entry.sender]
        for counted in (found.usage, self.total):
            counted.records += sign
            counted.bytes += sign * entry.size
        if found.usage.records == 0:
            del self._senders[entry.sender]
        else:
            heapq.heappush(self._weights, (-self._weight(found.usage), next(self._order), entry.sender))

    def _compact(self) -> None:
        """Rebuild the lazy heaps once stale entries dominate them: a sender refreshing one record keeps them small."""
        if len(self._expirations) > 2 * len(self._entries) + HEAP_SLACK:
            self._expirations = [item for item in self._expirations if self._entries.get(item[2]) is item[3]]
            heapq.heapify(self._expirations)
        if len(self._weights) > 2 * len(self._senders) + HEAP_SLACK:
            self._weights = [
                (-self._weight(found.usage), next(self._order), sender) for sender, found in self._senders.items()
            ]
            heapq.heapify(self._weights)


# ---- hivemind storage that keeps to a ledger --------------------------------------------------------------------

_sender: contextvars.ContextVar[Hashable | None] = contextvars.ContextVar("nesa_dht_store_sender", default=None)


class _RegularValue:
    """The item id of a key's regular value (any msgpack value, None included, can be a dictionary subkey)."""

    def __repr__(self) -> str:
        return "<regular value>"


REGULAR = _RegularValue()


def record_size(key: DHTID, subkey: object, value: object) -> int:
    """Bytes a record is accounted for: its key, its serialized subkey (none for a regular value) and its value."""
    size = len(key.to_bytes())
    if subkey is not REGULAR:
        size += len(MSGPackSerializer.dumps(subkey))
    return size + (len(value) if isinstance(value, bytes) else len(MSGPackSerializer.dumps(value)))


class StorageBound:
    """One peer's ledger and the storages it bounds: its DHTProtocol's storage and cache."""

    def __init__(self, limits: StorageLimits) -> None:
        self.ledger = StorageLedger(limits)
        self.storages: list[BoundedDHTStorage] = []

    def drop(self, record_ids: list[tuple]) -> None:
        for (slot, key), item in record_ids:
            self.storages[slot].drop(key, item)
        if record_ids:
            logger.debug("DHT storage full: evicted the %d oldest records of other peers", len(record_ids))


class BoundedDHTStorage(DHTLocalStorage):
    """hivemind's DHTLocalStorage, accounting the records other peers store in its peer's ledger."""

    def __init__(self, bound: StorageBound, maxsize: int | None = None) -> None:
        super().__init__(maxsize)
        self.bound = bound
        self.slot = len(bound.storages)
        bound.storages.append(self)

    def store(self, key: DHTID, value, expiration_time: float, subkey=None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        record_id = ((self.slot, key), REGULAR)
        size = record_size(key, REGULAR, value)
        if not self._admits(record_id, size):
            return False
        stored = super().store(key, value, expiration_time)
        if stored:
            self.bound.ledger.forget_group(record_id[0])  # the value replaced whatever the key held
            self._account(record_id, size, expiration_time)
        _compact_heap(self)
        return stored

    def store_subkey(self, key: DHTID, subkey, value, expiration_time: float) -> bool:
        record_id = ((self.slot, key), subkey)
        size = record_size(key, subkey, value)
        if not self._admits(record_id, size):
            return False
        previous = self.get(key)
        stored = super().store_subkey(key, subkey, value, expiration_time)
        if stored:
            if previous is not None and not isinstance(previous.value, DictionaryDHTValue):
                self.bound.ledger.forget_group(record_id[0])  # the new dictionary replaced a regular value
            self._account(record_id, size, expiration_time)
        current = self.data.get(key)
        if current is not None and isinstance(current.value, DictionaryDHTValue):
            _compact_heap(current.value)
        _compact_heap(self)
        return stored

    def drop(self, key: DHTID, item) -> None:
        """Delete one record the ledger evicted: a regular value, or one subkey (and the dictionary once empty)."""
        found = self.data.get(key)
        if found is None:
            return
        if item is REGULAR:
            if not isinstance(found.value, DictionaryDHTValue):
                del self[key]
            return
        if isinstance(found.value, DictionaryDHTValue):
            if item in found.value.data:
                del found.value[item]
            if not found.value.data:
                del self[key]

    def _admits(self, record_id: tuple, size: int) -> bool:
        sender = _sender.get()
        if sender is None:  # this peer's own store
            return True
        if self.bound.ledger.admits(sender, record_id, size, get_dht_time()):
            return True
        logger.debug("refused a DHT record of %d bytes from %s: over its share of this peer's storage", size, sender)
        return False

    def _account(self, record_id: tuple, size: int, expiration_time: float) -> None:
        sender = _sender.get()
        if sender is None:
            self.bound.ledger.forget(record_id)  # now this peer's own record, whoever stored it before
            return
        self.bound.drop(self.bound.ledger.add(sender, record_id, size, expiration_time, get_dht_time()))


def _compact_heap(storage: TimedStorage) -> None:
    """Drop stale entries of a TimedStorage's expiration heap. hivemind pushes one per store, refused or not, and
    removes them only as they expire, so a peer repeating stores to one key grew it for up to a record's lifetime."""
    if len(storage.expiration_heap) > 2 * len(storage.data) + HEAP_SLACK:
        storage.expiration_heap = list(storage.key_to_heap.values())
        heapq.heapify(storage.expiration_heap)


# ---- installation --------------------------------------------------------------------------------------------------

_limits = StorageLimits()


RECORD_BYTES_FLOOR = 256  # a record costs at least this much (Python objects around its bytes), for the count


def limits_of_mib(mib: float) -> StorageLimits:
    """Limits for a total of `mib` MiB (what `--dht-storage-mb` sets): records at most one per RECORD_BYTES_FLOOR
    bytes and never more than the default count, each sender SENDER_SHARE of both."""
    total_bytes = max(1, int(mib * 2**20))
    return StorageLimits.from_totals(
        total_bytes, max(16, min(DEFAULT_TOTAL_RECORDS, total_bytes // RECORD_BYTES_FLOOR))
    )


def set_storage_limits(limits: StorageLimits) -> StorageLimits:
    """Limits for the DHT peers this process starts from now on (running ones keep theirs); returns the previous."""
    global _limits
    previous, _limits = _limits, limits
    return previous


def storage_limits() -> StorageLimits:
    return _limits


def bind(protocol: DHTProtocol) -> StorageBound:
    """Give `protocol` bounded storage and cache sharing one ledger (what they already hold counts as its own)."""
    bound = StorageBound(_limits)
    for name in ("storage", "cache"):
        old: DHTLocalStorage = getattr(protocol, name)
        new = BoundedDHTStorage(bound, old.maxsize)
        new.data, new.expiration_heap, new.key_to_heap = old.data, old.expiration_heap, old.key_to_heap
        setattr(protocol, name, new)
    return bound


def ledger_of(protocol: DHTProtocol) -> StorageLedger | None:
    storage = protocol.storage
    return storage.bound.ledger if isinstance(storage, BoundedDHTStorage) else None


@contextlib.contextmanager
def stored_by(sender: Hashable):
    """Within this block, stores to bounded storages are accounted to `sender` (a peer id)."""
    token = _sender.set(sender)
    try:
        yield
    finally:
        _sender.reset(token)


def _with_sender(original):
    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        with stored_by(context.remote_id):
            return await original(self, request, context)

    rpc_store.__doc__ = original.__doc__
    rpc_store.nesa_bounded = True
    return rpc_store


def _bounding(original):
    async def create(cls, *args, **kwargs) -> DHTProtocol:
        protocol = await original(cls, *args, **kwargs)
        bind(protocol)
        return protocol

    create.nesa_bounded = True
    return create


def install() -> None:
    """Bound the DHT storage of every peer this process starts (idempotent; called when nesa_node.peer is
    imported, before any peer exists: the protocol registers `rpc_store` as its handler when it is created)."""
    if installed():
        return
    DHTProtocol.rpc_store = _with_sender(DHTProtocol.rpc_store)
    DHTProtocol.create = classmethod(_bounding(DHTProtocol.__dict__["create"].__func__))


def installed() -> bool:
    return getattr(DHTProtocol.rpc_store, "nesa_bounded", False) and getattr(
        DHTProtocol.__dict__["create"].__func__, "nesa_bounded", False
    )


__all__ = [
    "DEFAULT_TOTAL_BYTES",
    "DEFAULT_TOTAL_RECORDS",
    "SENDER_SHARE",
    "BoundedDHTStorage",
    "StorageLedger",
    "StorageLimits",
    "Usage",
    "install",
    "installed",
    "ledger_of",
    "set_storage_limits",
    "storage_limits",
    "stored_by",
]
