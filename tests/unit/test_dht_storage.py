"""The DHT storage bound (nesa_node.protocol.dht_storage) without a network: the ledger's accounting, and hivemind's
storage kept consistent with it as records are stored, replaced, refused and evicted."""

from __future__ import annotations

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import get_dht_time
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.protocol.dht_storage import (
    REGULAR,
    BoundedDHTStorage,
    StorageBound,
    StorageLedger,
    StorageLimits,
    Usage,
    record_size,
    stored_by,
)

NOW = 1000.0
LATER = NOW + 100


def ledger(total_bytes=1000, total_records=10, sender_bytes=400, sender_records=4) -> StorageLedger:
    return StorageLedger(StorageLimits(total_bytes, total_records, sender_bytes, sender_records))


def rid(key: int, item: object = REGULAR) -> tuple:
    return ((0, key), item)


def test_limits_refuse_nonsense():
    with pytest.raises(ValueError):
        StorageLimits(0, 10, 0, 1)
    with pytest.raises(ValueError):
        StorageLimits(100, 10, 200, 1)
    limits = StorageLimits.from_totals(1600, 160)
    assert (limits.sender_bytes, limits.sender_records) == (100, 10)
    assert StorageLimits.from_totals(10, 3).sender_records == 1


def test_a_sender_over_its_share_is_refused_and_evicts_nobody():
    book = ledger()
    assert book.add("other", rid(0), 50, LATER, NOW) == []
    for key in range(1, 5):
        assert book.admits("flood", rid(key), 10, NOW)
        assert book.add("flood", rid(key), 10, LATER, NOW) == []
    assert not book.admits("flood", rid(5), 10, NOW)  # a fifth record
    assert book.admits("flood", rid(4), 10, NOW)  # refreshing its own record is no new record
    assert not book.admits("big", rid(9), 401, NOW)  # one record over a sender's bytes
    assert rid(0) in book and book.usage("other") == Usage(1, 50)


def test_a_refresh_replaces_the_record_it_refreshes():
    book = ledger()
    book.add("a", rid(1), 100, LATER, NOW)
    book.add("a", rid(1), 30, LATER + 10, NOW)
    assert book.usage("a") == Usage(1, 30) and book.total == Usage(1, 30)
    book.add("b", rid(1), 40, LATER + 20, NOW)  # stored again by another sender: now charged to that one
    assert book.usage("a") == Usage() and book.usage("b") == Usage(1, 40) and book.total == Usage(1, 40)


def test_the_heaviest_senders_oldest_record_goes_first_when_the_total_is_full():
    book = ledger(total_records=6, sender_records=4)
    book.add("honest", rid(0), 1, LATER, NOW)
    for key in (1, 2, 3, 4):
        book.add("a", rid(key), 1, LATER, NOW)
    book.add("b", rid(5), 1, LATER, NOW)
    book.add("a", rid(1), 1, LATER + 1, NOW)  # a refresh: rid 1 is now a's newest
    assert book.add("b", rid(6), 1, LATER, NOW) == [rid(2)]  # a holds all its share, b half of it
    assert book.add("b", rid(7), 1, LATER, NOW) == [rid(3)]  # a (3 of 4) still outweighs b (3 of 4 after the add)
    assert rid(0) in book and book.total == Usage(6, 6)


def test_many_identities_at_their_share_cycle_each_other_and_not_an_honest_record():
    """The guarantee holds while the identities are fewer than the records the total holds: with as many, each
    could be down to one record, as light as an honest sender's one."""
    book = ledger(total_records=12, sender_records=4, total_bytes=10_000, sender_bytes=1000)
    book.add("honest", rid(-1), 100, LATER, NOW)  # a NodeInfo is a small part of a sender's bytes
    evictions = 0
    for step in range(400):
        identity, key = step % 10, step
        if book.admits(identity, rid(key), 1, NOW):
            evictions += len(book.add(identity, rid(key), 1, LATER, NOW))
        assert book.total.records <= 12
    assert rid(-1) in book and evictions > 0


def test_bytes_over_the_total_evict_as_many_records_as_needed():
    book = ledger(total_bytes=100, sender_bytes=100)
    for key in range(4):
        book.add("small", rid(key), 25, LATER, NOW)
    assert book.add("big", rid(9), 60, LATER, NOW) == [rid(0), rid(1), rid(2)]
    assert book.total == Usage(2, 85)


def test_expired_records_are_forgotten_and_free_their_sender():
    book = ledger()
    for key in range(4):
        book.add("a", rid(key), 10, NOW + key, NOW)
    assert not book.admits("a", rid(9), 10, NOW)
    assert book.admits("a", rid(9), 10, NOW + 1.5)  # records 0 and 1 have expired
    assert book.usage("a") == Usage(2, 20) and len(book) == 2


def test_forget_group_drops_every_record_of_a_key():
    book = ledger()
    book.add("a", rid(1, b"x"), 10, LATER, NOW)
    book.add("b", rid(1, b"y"), 10, LATER, NOW)
    book.add("a", rid(2, b"x"), 10, LATER, NOW)
    book.forget_group((0, 1))
    assert len(book) == 1 and book.total == Usage(1, 10) and book.usage("b") == Usage()


def test_refreshing_one_record_keeps_the_expiration_heap_small():
    book = ledger()
    for step in range(20_000):
        book.add("a", rid(1), 10, LATER + step, NOW)
    assert len(book._expirations) < 2_000


operations = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c", "d", "e"]),  # sender
        st.integers(0, 12),  # key
        st.sampled_from([REGULAR, b"x", b"y"]),  # item
        st.integers(1, 120),  # size
        st.floats(1, 50),  # lifetime
        st.floats(0, 5),  # time step
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_the_ledger_never_exceeds_its_limits_and_its_sums_agree(ops):
    limits = StorageLimits(total_bytes=500, total_records=12, sender_bytes=200, sender_records=5)
    book = StorageLedger(limits)
    now = NOW
    for sender, key, item, size, lifetime, step in ops:
        now += step
        record_id = rid(key, item)
        before = {other: book.usage(other) for other in "abcde"}
        if not book.admits(sender, record_id, size, now):
            assert book.usage(sender).records >= 1  # refused only for what it already holds
            continue
        evicted = book.add(sender, record_id, size, now + lifetime, now)
        assert record_id in book and record_id not in evicted
        assert all(evictee not in book for evictee in evicted)
        assert book.total.records <= limits.total_records and book.total.bytes <= limits.total_bytes
        for other in "abcde":
            usage = book.usage(other)
            assert usage.records <= limits.sender_records and usage.bytes <= limits.sender_bytes
            if other != sender:  # another sender's records never grow by this store
                assert usage.records <= before[other].records
        senders = [book.usage(other) for other in "abcde"]
        assert book.total == Usage(sum(u.records for u in senders), sum(u.bytes for u in senders))
        assert book.total.records == len(book)


# ---- hivemind's storage kept consistent --------------------------------------------------------------------------


def storage(total_records=4, sender_records=3, total_bytes=100_000, sender_bytes=10_000) -> BoundedDHTStorage:
    bound = StorageBound(StorageLimits(total_bytes, total_records, sender_bytes, sender_records))
    return BoundedDHTStorage(bound)


def key(name: str) -> DHTID:
    return DHTID.generate(source=name)


def test_records_stored_by_the_peer_itself_are_not_accounted_nor_refused():
    store = storage(total_records=1, sender_records=1)
    expiration = get_dht_time() + 60
    for index in range(5):
        assert store.store(key(f"own{index}"), b"value", expiration)
    assert len(store.bound.ledger) == 0 and len(store) == 5
    with stored_by("peer"):
        assert store.store(key("theirs"), b"value", expiration)
    store.store(key("theirs"), b"newer", expiration + 1)  # the peer's own value replaces it: no longer accounted
    assert len(store.bound.ledger) == 0


def test_eviction_deletes_subkeys_and_empty_dictionaries_from_the_storage():
    store = storage(total_records=3, sender_records=3)
    expiration = get_dht_time() + 60
    with stored_by("a"):  # two large subkeys: "a" is the heaviest sender
        assert store.store(key("dict"), b"1" * 4000, expiration, subkey=b"s1")
        assert store.store(key("dict"), b"2" * 4000, expiration, subkey=b"s2")
    for sender, name in (("b", "plain"), ("c", "other"), ("d", "more")):
        with stored_by(sender):
            assert store.store(key(name), b"v", expiration)
        if sender == "c":  # evicted s1
            dictionary = store.get(key("dict")).value
            assert isinstance(dictionary, DictionaryDHTValue) and list(dictionary.data) == [b"s2"]
    assert store.get(key("dict")) is None  # s2 went too, and the dictionary with its last subkey
    assert store.bound.ledger.total.records == 3 and len(store) == 3


def test_a_regular_value_and_a_dictionary_replacing_each_other_stay_accounted_once():
    store = storage(total_records=10, sender_records=10)
    now = get_dht_time()
    with stored_by("a"):
        assert store.store(key("k"), b"x" * 10, now + 10, subkey=b"s1")
        assert store.store(key("k"), b"x" * 10, now + 10, subkey=b"s2")
        assert store.store(key("k"), b"regular", now + 20)  # replaces the dictionary
        assert store.bound.ledger.total.records == 1
        assert store.store(key("k"), b"x", now + 30, subkey=b"s3")  # a newer dictionary replaces the value
    assert store.bound.ledger.total == Usage(1, record_size(key("k"), b"s3", b"x"))


def test_a_sender_over_its_share_gets_false_and_the_storage_is_unchanged():
    store = storage(total_records=10, sender_records=2)
    expiration = get_dht_time() + 60
    with stored_by("flood"):
        assert store.store(key("1"), b"v", expiration) and store.store(key("2"), b"v", expiration)
        assert not store.store(key("3"), b"v", expiration)
        assert not store.store_subkey(key("4"), b"s", b"v", expiration)
    assert key("3") not in store and key("4") not in store and len(store) == 2


def test_stale_heap_entries_of_repeated_stores_are_dropped():
    store = storage(total_records=10, sender_records=10)
    now = get_dht_time()
    with stored_by("a"):
        for step in range(5000):
            store.store(key("k"), b"v", now + 600 - step * 0.01)  # refused (older), yet hivemind keeps a heap entry
            store.store(key("d"), b"v", now + 10 + step * 0.01, subkey=b"s")
    assert len(store.expiration_heap) < 2000
    assert len(store.get(key("d")).value.expiration_heap) < 2000


def test_limits_of_a_size_in_mib_bound_bytes_records_and_each_sender():
    from nesa_node.protocol.dht_storage import DEFAULT_TOTAL_RECORDS, SENDER_SHARE, limits_of_mib

    small = limits_of_mib(1.0)
    assert small.total_bytes == 2**20 and small.total_records == 2**20 // 256
    assert small.sender_bytes == int(2**20 * SENDER_SHARE)
    assert limits_of_mib(1024.0).total_records == DEFAULT_TOTAL_RECORDS
