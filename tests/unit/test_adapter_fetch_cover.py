"""Which peers a node asks for an adapter's blocks (server/adapter_fetch.py `cover`), how it bounds the peers asking
it (`AnswerGate`), and the shape check a node applies to slices it did not read itself (sharding/lora.py
`check_fits_model`)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nesa_node.errors import AdapterError, AdapterMissingError, QuotaExceededError
from nesa_node.protocol.records import NodeInfo, NodeState
from nesa_node.server import adapter_fetch
from nesa_node.server.adapter_fetch import AnswerGate, cover
from nesa_node.sharding.lora import AdapterSlice, LoraFactors, check_fits_model


def info(peer: str, start: int, end: int) -> NodeInfo:
    return NodeInfo(peer_id=peer, state=NodeState.online, start_block=start, end_block=end, dtype="float32")


spans = st.lists(st.tuples(st.integers(0, 7), st.integers(1, 8)).filter(lambda span: span[0] < span[1]), max_size=6)


@given(spans, st.integers(0, 7), st.integers(1, 8))
def test_cover_asks_each_range_of_peers_that_hold_all_of_it_or_names_a_missing_block(pairs, start, end):
    if start >= end:
        return
    holders = [info(f"p{index}", first, stop) for index, (first, stop) in enumerate(pairs)]
    served = {block for holder in holders for block in holder.blocks}
    if not served.issuperset(range(start, end)):
        with pytest.raises(AdapterMissingError, match="serves block"):
            cover(start, end, holders)
        return
    ranges = cover(start, end, holders)
    assert ranges[0][0] == start and ranges[-1][1] == end
    assert all(stop == following[0] for (_, stop, _), following in zip(ranges, ranges[1:], strict=False))
    for first, stop, peers in ranges:
        assert peers and all(peer.start_block <= first and stop <= peer.end_block for peer in peers)


def test_cover_without_a_wide_claimant_uses_the_peers_that_have_the_blocks():
    honest = [info("a", 0, 4), info("b", 4, 8)]
    wide = info("h", 0, 8)
    assert [(first, stop, [peer.peer_id for peer in peers]) for first, stop, peers in cover(0, 8, [*honest, wide])] == [
        (0, 8, ["h"])
    ]
    # the fetcher covers a range again without a peer that failed it: the honest halves remain
    assert [(first, stop) for first, stop, _ in cover(0, 8, honest)] == [(0, 4), (4, 8)]


class Config:
    hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, num_hidden_layers = 8, 2, 1, 16, 4


def piece(out_features: int) -> AdapterSlice:
    factors = {(1, "self_attn.k_proj"): LoraFactors(torch.zeros(2, 8), torch.zeros(out_features, 2), 1.0)}
    return AdapterSlice(1, 2, factors)


def test_a_slice_must_fit_the_models_projections():
    check_fits_model(piece(4), Config())  # k_proj: 8 -> 1 head of 4
    with pytest.raises(AdapterError, match="does not fit this model"):
        check_fits_model(piece(8), Config())  # a model with 2 key/value heads


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_answer_gate_bounds_streams_per_peer_and_in_all_and_frees_them_once():
    gate = AnswerGate(
        max_running=3, max_running_per_peer=2, max_per_window=100, window_s=60.0, what="adapter requests", now=Clock()
    )
    first, second = gate.enter("a"), gate.enter("a")
    with pytest.raises(QuotaExceededError, match="2 adapter requests under way"):
        gate.enter("a")
    third = gate.enter("b")
    with pytest.raises(QuotaExceededError, match="3 adapter requests at once"):
        gate.enter("c")
    first()
    first()  # a second call frees nothing more
    assert gate.running == {"a": 1, "b": 1}
    fourth = gate.enter("c")
    for leave in (second, third, fourth):
        leave()
    assert not gate.running


def test_answer_gate_counts_each_peers_requests_per_window_and_forgets_quiet_peers():
    clock = Clock()
    gate = AnswerGate(
        max_running=8, max_running_per_peer=2, max_per_window=3, window_s=60.0, what="adapter requests", now=clock
    )
    for _ in range(3):
        gate.enter("a")()
    with pytest.raises(QuotaExceededError, match="3 times per 60 s"):
        gate.enter("a")
    gate.enter("b")()  # another peer has its own count
    clock.t += 30
    with pytest.raises(QuotaExceededError):
        gate.enter("a")
    clock.t += 30.5  # the window has passed every one of a's requests
    gate.enter("a")()
    clock.t += 61
    gate.enter("c")()
    assert set(gate.recent) == {"c"}  # peers quiet for a whole window are gone from the table


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.booleans(), st.floats(0, 30)), max_size=60))
def test_answer_gate_never_exceeds_its_limits(moves):
    clock = Clock()
    gate = AnswerGate(
        max_running=3, max_running_per_peer=2, max_per_window=5, window_s=60.0, what="adapter requests", now=clock
    )
    open_calls, started = [], {}
    for peer, enter, wait in moves:
        clock.t += wait
        if enter:
            try:
                open_calls.append(gate.enter(peer))
                started.setdefault(peer, []).append(clock.t)
            except QuotaExceededError:
                pass
        elif open_calls:
            open_calls.pop(0)()
        assert sum(gate.running.values()) <= 3 and all(count <= 2 for count in gate.running.values())
        for times in started.values():
            assert len([t for t in times if t > clock.t - 60.0]) <= 5


class Lookups:
    """The swarm's records as an AdapterFetcher looks them up: `delay_s` per lookup, counted."""

    def __init__(self, delay_s: float, records: list[NodeInfo]):
        self.delay_s, self.records, self.count = delay_s, records, 0

    async def __call__(self) -> list[NodeInfo]:
        self.count += 1
        await asyncio.sleep(self.delay_s)
        return self.records

    def fetcher(self) -> adapter_fetch.AdapterFetcher:
        return adapter_fetch.AdapterFetcher(None, "me", self, None, deadline_s=5.0, peer_s=1.0, max_frame_bytes=1 << 20)


async def fetch_unknown(fetcher: adapter_fetch.AdapterFetcher, count: int) -> None:
    """`count` fetches at once of adapter ids nobody announces: each refused as missing."""
    ids = [f"{index:064x}" for index in range(count)]
    answers = await asyncio.gather(*(fetcher.fetch(i, 0, 2) for i in ids), return_exceptions=True)
    assert all(isinstance(a, AdapterMissingError) and "no peer announces it" in a.message for a in answers)


def test_fetches_of_adapters_nobody_announces_share_one_records_lookup_a_second(monkeypatch):
    """A peer naming unknown adapter ids open after open: the node looks the swarm's records up once for all of them
    (concurrent or within RECORDS_FRESH_S), and again once they are that old."""
    monkeypatch.setattr(adapter_fetch, "RECORDS_FRESH_S", 0.5)
    lookups = Lookups(0.05, [info("other", 0, 4)])

    async def run() -> list[int]:
        fetcher, counts = lookups.fetcher(), []
        for pause_s, count in ((0.0, 20), (0.1, 5), (0.6, 5)):
            await asyncio.sleep(pause_s)
            await fetch_unknown(fetcher, count)
            counts.append(lookups.count)
        return counts

    assert asyncio.run(run()) == [1, 1, 2]


def test_a_records_lookup_slower_than_its_freshness_is_shared_not_queued(monkeypatch):
    """Lookups that take longer than RECORDS_FRESH_S: callers arriving meanwhile wait for the one under way (not each
    for a lookup of its own, one after another)."""
    monkeypatch.setattr(adapter_fetch, "RECORDS_FRESH_S", 0.05)
    lookups = Lookups(0.3, [])

    async def run() -> float:
        started = asyncio.get_running_loop().time()
        await fetch_unknown(lookups.fetcher(), 10)
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(run()) < 1.5 and lookups.count == 1


def test_holders_that_never_deliver_are_asked_last_by_the_fetches_after():
    """Three identities announce an adapter they never send, ahead of its real holder in the records: the first
    fetch waits out each of them before the real holder delivers; the fetches after ask the real holder alone (those
    that failed lately are asked only if the others cannot cover the blocks), so free identities cannot take every
    fetch's time."""
    from types import SimpleNamespace

    from nesa_node.protocol.records import AdapterInfo
    from nesa_node.sharding.lora_identity import adapter_manifest

    generator = torch.Generator().manual_seed(0)
    whole = AdapterSlice(
        0, 4, {(block, "self_attn.q_proj"): LoraFactors(torch.randn(2, 8, generator=generator),
                                                       torch.randn(8, 2, generator=generator), 1.0)
               for block in range(4)},
    )  # fmt: skip
    manifest = adapter_manifest(whole, 4)
    held = AdapterInfo(adapter_id=manifest.adapter_id, name="a", slice_sha256=whole.sha256, rank=2, slice_bytes=1)
    records = [
        info(peer, 0, 4).model_copy(update={"adapters": (held,)}) for peer in ("fake0", "fake1", "fake2", "real")
    ]
    fetcher = Lookups(0.0, records).fetcher()
    fetcher.peer_s = 0.05
    fetcher._rng = SimpleNamespace(sample=lambda peers, count: list(peers))  # the records' order: the fakes first
    asked: list[str] = []

    async def ask(peer_id, adapter_id, start, end):
        asked.append(peer_id)
        if peer_id != "real":
            await asyncio.sleep(10)  # never answers
        return manifest, whole

    fetcher._ask = ask

    async def run() -> list[list[str]]:
        rounds = []
        for _ in range(2):
            asked.clear()
            _, _, piece = await fetcher.fetch(manifest.adapter_id, 0, 4)
            assert piece.sha256 == whole.sha256
            rounds.append(list(asked))
        return rounds

    assert asyncio.run(run()) == [["fake0", "fake1", "fake2", "real"], ["real"]]


def test_a_holder_that_failed_lately_is_still_asked_when_no_other_has_the_blocks():
    from nesa_node.protocol.records import AdapterInfo
    from nesa_node.sharding.lora_identity import adapter_manifest

    whole = AdapterSlice(0, 4, {(0, "self_attn.q_proj"): LoraFactors(torch.ones(2, 8), torch.ones(8, 2), 1.0)})
    manifest = adapter_manifest(whole, 4)
    held = AdapterInfo(adapter_id=manifest.adapter_id, name="a", slice_sha256=whole.sha256, rank=2, slice_bytes=1)
    fetcher = Lookups(0.0, [info("only", 0, 4).model_copy(update={"adapters": (held,)})]).fetcher()
    answers = iter([ConnectionError("reset"), None])

    async def ask(peer_id, adapter_id, start, end):
        error = next(answers)
        if error is not None:
            raise error
        return manifest, whole

    fetcher._ask = ask

    async def run():
        with pytest.raises(AdapterMissingError):
            await fetcher.fetch(manifest.adapter_id, 0, 4)
        return await fetcher.fetch(manifest.adapter_id, 0, 4)

    assert asyncio.run(run())[2].sha256 == whole.sha256
