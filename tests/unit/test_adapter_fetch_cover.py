"""Which peers a node asks for an adapter's blocks (server/adapter_fetch.py `cover`), and the shape check a node
applies to slices it did not read itself (sharding/lora.py `check_fits_model`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nesa_node.errors import AdapterError, AdapterMissingError
from nesa_node.protocol.records import NodeInfo, NodeState
from nesa_node.server.adapter_fetch import cover
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
