"""A node's resident LoRA adapters under a byte budget (nesa_node/server/adapter_store.py), with real tiny adapter
slices built from seeded tensors: LRU eviction, pins and preloads that are never evicted, typed refusals, and a
simulation of 100 sessions cycling 200 adapters against a budget of 16 (issue 21's acceptance)."""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.errors import AdapterBudgetError, AdapterError, AdapterHashError, RequestError, error_from_code
from nesa_node.server.adapter_store import MAX_ANNOUNCED, AdapterEntry, AdapterStore
from nesa_node.sharding.lora import AdapterManifest, AdapterSlice, LoraFactors, adapter_manifest

BLOCKS = 4  # the model's blocks; the node holds 1:3
SPAN = (1, 3)


def _adapter(seed: int, rank: int = 2, features: int = 8) -> tuple[AdapterManifest, AdapterSlice]:
    """A tiny random adapter on q_proj and down_proj of every block: its manifest, and the node's slice of it."""
    generator = torch.Generator().manual_seed(seed)
    factors = {
        (block, projection): LoraFactors(
            torch.randn(rank, features, generator=generator), torch.randn(features, rank, generator=generator), 2.0
        )
        for block in range(BLOCKS)
        for projection in ("self_attn.q_proj", "mlp.down_proj")
    }
    whole = AdapterSlice(0, BLOCKS, factors)
    return adapter_manifest(whole, BLOCKS), whole.narrow(*SPAN)


ADAPTERS = [_adapter(seed) for seed in range(200)]
SIZE = ADAPTERS[0][1].nbytes  # every one of them: same shapes, same scale


def _add(store: AdapterStore, index: int, **options) -> AdapterEntry:
    manifest, piece = ADAPTERS[index]
    return store.add(f"adapter-{index}", manifest, piece, **options)


def _id(index: int) -> str:
    return ADAPTERS[index][0].adapter_id


def _resident(store: AdapterStore) -> set[int]:
    ids = {entry.adapter_id for entry in store.entries()}
    return {index for index in range(len(ADAPTERS)) if _id(index) in ids}


def test_the_tiny_adapters_are_distinct_and_equal_in_size():
    assert len({manifest.adapter_id for manifest, _ in ADAPTERS}) == len(ADAPTERS)
    assert {piece.nbytes for _, piece in ADAPTERS} == {SIZE}


def test_add_get_and_re_add():
    store = AdapterStore(3 * SIZE)
    entry = _add(store, 0)
    assert (entry.name, entry.adapter_id, entry.pins, entry.preloaded) == ("adapter-0", _id(0), 0, False)
    assert entry.piece is ADAPTERS[0][1] and entry.manifest is ADAPTERS[0][0]
    assert (store.resident, store.used_bytes, store.budget_bytes, store.pinned) == (1, SIZE, 3 * SIZE, 0)
    assert store.get(_id(0)) is entry and store.get(_id(1)) is None
    again = store.add("another name", *ADAPTERS[0])  # the same id: only marked used
    assert again is entry and again.name == "adapter-0" and store.used_bytes == SIZE
    assert _id(0) in store and _id(1) not in store
    assert _add(store, 0, preloaded=True).preloaded  # a preload of a resident adapter keeps it from then on


def test_the_least_recently_used_is_evicted_first():
    store = AdapterStore(3 * SIZE)
    for index in range(3):
        _add(store, index)
    store.get(_id(0))  # 1 is now the least recently used
    _add(store, 3)
    assert _resident(store) == {0, 2, 3}
    _add(store, 2)  # re-adding counts as a use: 0 goes next
    _add(store, 4)
    assert _resident(store) == {2, 3, 4} and store.used_bytes == 3 * SIZE
    assert [entry.name for entry in store.entries()] == ["adapter-3", "adapter-2", "adapter-4"]


def test_pinned_and_preloaded_adapters_are_never_evicted():
    store = AdapterStore(3 * SIZE)
    _add(store, 0, preloaded=True)
    _add(store, 1)
    store.pin(_id(1))
    store.pin(_id(1))  # a second session on the same adapter
    _add(store, 2)
    for index in range(3, 8):  # each evicts the one before it, never 0 or 1
        _add(store, index)
        assert _resident(store) == {0, 1, index}
    assert store.pinned == 1 and store.get(_id(1)).pins == 2
    store.unpin(_id(1))
    _add(store, 8, preloaded=True)  # takes 7's room
    with pytest.raises(AdapterBudgetError):  # 0 and 8 preloaded, 1 still pinned by one session
        _add(store, 9)
    assert _resident(store) == {0, 1, 8}
    store.unpin(_id(1))
    assert store.pinned == 0
    _add(store, 9)  # 1 is free now, the one entry not preloaded
    assert _resident(store) == {0, 8, 9}


def test_a_refused_add_evicts_nothing_and_says_what_holds_the_budget():
    store = AdapterStore(4 * SIZE)
    _add(store, 0, preloaded=True)
    _add(store, 1)
    store.pin(_id(1))
    _add(store, 2)
    store.pin(_id(2))
    _add(store, 3)  # takes the last slot; evictable
    _add(store, 4)  # evicts 3
    store.pin(_id(4))
    before = (_resident(store), store.used_bytes)
    with pytest.raises(AdapterBudgetError) as caught:
        _add(store, 5)
    assert (_resident(store), store.used_bytes) == before
    error = caught.value
    assert error.code == "adapter_budget" and isinstance(error, RequestError) and not isinstance(error, AdapterError)
    assert f"budget of {4 * SIZE} bytes" in error.message
    assert f"{3 * SIZE} bytes are held by 3 adapter(s) open sessions use and {SIZE} by 1 preloaded" in error.message
    rebuilt = error_from_code(error.code, error.message)
    assert type(rebuilt) is AdapterBudgetError and rebuilt.message == error.message


def test_an_adapter_larger_than_the_whole_budget_is_refused():
    for budget in (0, SIZE - 1):
        store = AdapterStore(budget)
        with pytest.raises(AdapterBudgetError, match="larger than this node's whole adapter budget"):
            _add(store, 0, preloaded=True)
        assert store.resident == 0 and store.used_bytes == 0
    exact = AdapterStore(SIZE)
    _add(exact, 0)
    _add(exact, 1)
    assert _resident(exact) == {1}


def test_pins_must_pair_up():
    store = AdapterStore(2 * SIZE)
    with pytest.raises(AdapterError, match="does not hold") as caught:
        store.pin(_id(0))
    assert caught.value.code == "adapter"
    _add(store, 0)
    with pytest.raises(AdapterError, match="not pinned"):
        store.unpin(_id(0))
    with pytest.raises(AdapterError, match="not pinned"):
        store.unpin(_id(1))
    assert store.pin(_id(0)).pins == 1


def test_remove_refuses_a_pinned_adapter():
    store = AdapterStore(2 * SIZE)
    _add(store, 0, preloaded=True)
    store.pin(_id(0))
    with pytest.raises(AdapterError, match="in use by 1 open session"):
        store.remove(_id(0))
    store.unpin(_id(0))
    assert store.remove(_id(0)) and not store.remove(_id(0))
    assert store.resident == 0 and store.used_bytes == 0


def test_a_slice_of_another_adapter_or_a_bad_name_is_refused():
    store = AdapterStore(4 * SIZE)
    with pytest.raises(AdapterHashError):
        store.add("mixed", ADAPTERS[0][0], ADAPTERS[1][1])
    for name in ("", "x" * 65, None):
        with pytest.raises(AdapterError, match="name"):
            store.add(name, *ADAPTERS[0])
    assert store.resident == 0


def test_announced_lists_preloaded_then_most_recent_up_to_the_record_limit():
    store = AdapterStore(200 * SIZE)
    _add(store, 0, preloaded=True)
    _add(store, 1, preloaded=True)
    for index in range(2, 80):
        _add(store, index)
    store.get(_id(0))
    store.pin(_id(5))
    announced = store.announced()
    assert len(announced) == MAX_ANNOUNCED == 64
    assert [item[1] for item in announced[:4]] == ["adapter-0", "adapter-1", "adapter-5", "adapter-79"]
    assert [item[1] for item in announced[-1:]] == ["adapter-19"]
    manifest, piece = ADAPTERS[5]
    assert announced[2] == (manifest.adapter_id, "adapter-5", piece.sha256, manifest.rank)
    assert manifest.rank == 2


def test_adapters_left_out_of_the_record_take_none_of_its_places():
    """Clients' own adapters (`leave_out`) are dropped before the list is cut to MAX_ANNOUNCED: a client keeping 70 of
    its own in recent use does not push the node's public adapters out of its record."""
    store = AdapterStore(200 * SIZE)
    for index in range(3):
        _add(store, index)
    for index in range(3, 73):  # used after the public ones: the most recent
        _add(store, index)
    private = {_id(index) for index in range(3, 73)}
    announced = store.announced(leave_out=private)
    assert sorted(item[1] for item in announced) == ["adapter-0", "adapter-1", "adapter-2"]
    assert len(store.announced()) == MAX_ANNOUNCED


# ---- 100 sessions cycling 200 adapters against a budget of 16 -----------------------------------------------------


def _simulate(seed: int, steps: int, *, preloaded: tuple[int, ...] = (0, 1)) -> Counter:
    """Sessions open (add the adapter if absent, then pin) and close (unpin) in a seeded random interleaving, as the
    node does; after every operation the store is compared with a model of what it must hold. Returns counts of
    what happened."""
    rng = np.random.default_rng(seed)
    budget = 16 * SIZE
    store = AdapterStore(budget)
    popularity = 1.0 / np.arange(1, len(ADAPTERS) + 1) ** 0.7  # a few adapters are popular, most are not
    popularity /= popularity.sum()
    sessions: dict[int, int] = {}  # open session -> its adapter
    pins: Counter = Counter()  # adapter -> open sessions using it
    last_use: dict[int, int] = {}  # adapter -> step of its last use (what the store's LRU order must follow)
    happened: Counter = Counter()
    for index in preloaded:
        _add(store, index, preloaded=True)
        last_use[index] = -1

    for step in range(steps):
        open_count = len(sessions)
        if open_count and rng.random() < open_count / (open_count + 20):  # about 20 sessions open at a time
            session = list(sessions)[rng.integers(open_count)]
            index = sessions.pop(session)
            store.unpin(_id(index))
            pins[index] -= 1
            last_use[index] = step
            happened["close"] += 1
        else:
            closed = [session for session in range(100) if session not in sessions]
            session = closed[rng.integers(len(closed))]
            index = int(rng.choice(len(ADAPTERS), p=popularity))
            if store.get(_id(index)) is None:
                before, used = _resident(store), store.used_bytes
                kept = {a for a in before if pins[a] > 0} | set(preloaded)
                expect_refusal = (len(kept) + 1) * SIZE > budget  # no room even with every other entry evicted
                try:
                    _add(store, index)
                except AdapterBudgetError:
                    assert expect_refusal, f"step {step}: refused with {len(kept)} kept of 16"
                    assert (_resident(store), store.used_bytes) == (before, used)  # nothing evicted for nothing
                    happened["refused"] += 1
                    _check(store, pins, preloaded, budget)
                    continue
                assert not expect_refusal, f"step {step}: added with {len(kept)} kept of 16"
                evicted = before - _resident(store)
                _check_lru(evicted, before, kept, last_use, used, budget)
                happened["evicted"] += len(evicted)
            store.pin(_id(index))
            sessions[session] = index
            pins[index] += 1
            last_use[index] = step
            happened["open"] += 1
        _check(store, pins, preloaded, budget)
    return happened


def _check(store: AdapterStore, pins: Counter, preloaded: tuple[int, ...], budget: int) -> None:
    resident = _resident(store)
    assert store.used_bytes == SIZE * len(resident) <= budget
    for index, count in pins.items():  # a pinned adapter is never evicted, and its pins are the open sessions'
        if count:
            assert index in resident and store.get(_id(index)).pins == count
    assert set(preloaded) <= resident
    assert store.pinned == sum(1 for count in pins.values() if count)


def _check_lru(evicted: set[int], before: set[int], kept: set[int], last_use: dict, used: int, budget: int) -> None:
    """Only evictable entries left, the least recently used of them, and no more than needed to fit the new one."""
    assert not evicted & kept
    survivors = before - evicted - kept
    if evicted and survivors:
        assert max(last_use[index] for index in evicted) < min(last_use[index] for index in survivors)
    assert used - SIZE * len(evicted) + SIZE <= budget
    assert not evicted or used - SIZE * (len(evicted) - 1) + SIZE > budget


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_100_sessions_cycling_200_adapters_against_a_budget_of_16(seed):
    happened = _simulate(seed, steps=6000)
    # every path was taken: the simulation exercised evictions and refusals, not only hits
    assert happened["open"] > 1000 and happened["close"] > 1000
    assert happened["evicted"] > 100 and happened["refused"] > 10, happened


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), preloaded=st.sets(st.integers(0, 199), max_size=6))
def test_random_interleavings_keep_the_store_invariants(seed, preloaded):
    _simulate(seed, steps=600, preloaded=tuple(sorted(preloaded)))


def test_a_slice_running_on_another_device_or_dtype_is_charged_its_float32_copies():
    """A node charges a slice its bytes plus the float32 copies running it makes (AdapterSlice.run_bytes): none for
    float32 factors on the CPU, four bytes per element for bfloat16 ones (which the CPU copies to float32) or on a
    GPU; an adapter that fits stored but not with its copies is refused, naming the charged bytes."""
    manifest, piece = ADAPTERS[0]
    elements = sum(t.numel() for f in piece.factors.values() for t in (f.lora_a, f.lora_b))
    assert piece.run_bytes("cpu") == 0
    assert piece.run_bytes("cuda:0") == piece.run_bytes("cuda") == 4 * elements
    half = AdapterSlice(
        piece.start,
        piece.end,
        {key: LoraFactors(f.lora_a.bfloat16(), f.lora_b.bfloat16(), f.scale) for key, f in piece.factors.items()},
    )
    assert half.run_bytes("cpu") == 4 * elements
    device_copies = half.device_factors(torch.device("cpu"))
    assert sum(a.nbytes + b.nbytes for a, b, _ in device_copies.values()) == half.run_bytes("cpu")  # what it makes
    assert half.resident_bytes == 2 * elements + half.run_bytes("cpu")  # bfloat16 as stored, and the copies

    charged = AdapterStore(SIZE + 4 * elements, weigh=lambda p: p.nbytes + p.run_bytes("cuda"))
    entry = charged.add("on-gpu", manifest, piece)
    assert entry.charge == charged.used_bytes == SIZE + 4 * elements
    with pytest.raises(AdapterBudgetError, match=f"{SIZE + 4 * elements} bytes on this node"):
        AdapterStore(SIZE, weigh=lambda p: p.nbytes + p.run_bytes("cuda")).add("on-gpu", manifest, piece)
    assert charged.remove(manifest.adapter_id) and charged.used_bytes == 0


def test_widen_holds_a_wider_slice_of_the_same_adapter_in_place_evicting_others_for_the_extra_bytes():
    manifest, piece = ADAPTERS[0]
    narrow = piece.narrow(1, 2)
    store = AdapterStore(SIZE + narrow.nbytes + narrow.nbytes // 2)
    entry = store.add("zero", manifest, narrow)
    store.pin(_id(0))
    _add(store, 1)  # a full slice beside it: only half of it fits with the widened one
    assert store.used_bytes == narrow.nbytes + SIZE
    widened = store.widen(manifest, piece)
    assert widened is entry and entry.piece is piece and entry.pins == 1  # same entry, pins kept
    assert _resident(store) == {0} and store.used_bytes == SIZE  # the unpinned other made room
    with pytest.raises(AdapterError, match="do not contain"):
        store.widen(manifest, narrow)  # narrower than what is held
    with pytest.raises(AdapterHashError):
        store.widen(manifest, ADAPTERS[2][1])  # another adapter's slice under this id
    with pytest.raises(AdapterError, match="does not hold"):
        store.widen(*ADAPTERS[3])
    full = AdapterStore(SIZE + narrow.nbytes)
    full.add("zero", manifest, narrow)
    _add(full, 1, preloaded=True)
    with pytest.raises(AdapterBudgetError):
        full.widen(manifest, piece)
    assert full.get(_id(0)).piece is narrow and full.used_bytes == SIZE + narrow.nbytes  # refused: nothing changed
