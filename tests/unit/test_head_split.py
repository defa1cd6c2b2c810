"""One row's LM head product on the CPU split over threads (ClientEdges.scores): the same logits bit for bit as the
head's own call, checked on a weight's first split product; a library computing otherwise keeps the head's call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nesa_node.sharding import client_edges
from nesa_node.sharding.client_edges import ClientEdges, split_parts

VOCAB, HIDDEN = 8192, 512  # 4M elements: SPLIT_MIN_ELEMENTS, the smallest head that is split


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def edges_of(vocab: int = VOCAB, dtype=torch.float32) -> ClientEdges:
    generator = torch.Generator().manual_seed(0)
    head = nn.Linear(HIDDEN, vocab, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, HIDDEN, generator=generator) * 0.02)
    head.weight.requires_grad_(False)
    return ClientEdges(nn.Embedding(vocab, HIDDEN), nn.Identity(), head).eval()


def rows(count: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(1, count, HIDDEN, generator=torch.Generator().manual_seed(count)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rows_split_product_is_the_heads_own_bit_for_bit(two_threads, dtype):
    edges = edges_of(dtype=dtype)
    assert split_parts(edges.lm_head.weight) == 2
    with torch.inference_mode():
        for seed in range(5):
            normed = torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)
            assert torch.equal(edges.scores(normed), edges.lm_head(normed))
    assert edges._split is not None and edges._split[1]  # checked exact, and split since


def test_a_weight_changed_in_place_is_checked_again_and_followed(two_threads):
    edges = edges_of()
    normed = rows(1)
    with torch.inference_mode():
        first = edges.scores(normed)
    held = edges._split
    with torch.no_grad():
        edges.lm_head.weight[7].mul_(3)
    with torch.inference_mode():
        changed = edges.scores(normed)
    assert edges._split is not held and not torch.equal(changed, first)
    assert torch.equal(changed, edges.lm_head(normed))


def test_a_split_product_that_differs_keeps_the_heads_own_call_for_that_weight(two_threads, monkeypatch):
    edges = edges_of()
    calls = []

    def rounded_otherwise(normed, part):  # a library whose product of some rows rounds otherwise
        calls.append(part.shape[0])
        return nn.functional.linear(normed, part) + 1e-6

    monkeypatch.setattr(client_edges, "head_part", rounded_otherwise)
    normed = rows(1)
    with torch.inference_mode():
        assert torch.equal(edges.scores(normed), edges.lm_head(normed))
        tried = len(calls)
        assert tried == 2 and edges._split[1] is False
        assert torch.equal(edges.scores(rows(1)), edges.lm_head(rows(1)))
    assert len(calls) == tried  # not split again


def test_small_heads_several_rows_grad_mode_and_one_thread_are_not_split(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert split_parts(edges_of(vocab=VOCAB // 2).lm_head.weight) == 1  # 2M elements: not worth the threads
        edges = edges_of()
        with torch.inference_mode():
            edges.scores(rows(2))  # several rows: the transposed copy (exact only up to rounding), no split
        assert edges._split is None
        with torch.no_grad():  # outside inference mode the split runs too (the threads take the caller's mode)
            assert torch.equal(edges.scores(rows(1)), edges.lm_head(rows(1))) and edges._split is not None
        torch.set_num_threads(1)
        assert split_parts(edges.lm_head.weight) == 1
    finally:
        torch.set_num_threads(before)


def test_under_autocast_or_while_another_split_runs_the_head_answers_itself(two_threads, monkeypatch):
    """Autocast is a thread's own setting (the head threads would not share it); a split product under way on another
    thread holds the head threads, and a second one does not wait for them."""
    edges = edges_of()
    calls = []
    monkeypatch.setattr(
        client_edges, "head_part", lambda normed, part: calls.append(1) or nn.functional.linear(normed, part)
    )
    normed = rows(1)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        scores = edges.scores(normed)
        assert torch.equal(scores, edges.lm_head(normed)) and scores.dtype == torch.bfloat16
    assert calls == [] and edges._split is None
    with client_edges._SPLIT_LOCK, torch.inference_mode():  # as if another thread's split product were under way
        assert torch.equal(edges.scores(normed), edges.lm_head(normed))
    assert calls == [] and edges._split is None


def test_the_edges_copy_and_save_after_a_split_product(two_threads):
    import copy
    import io

    edges = edges_of()
    with torch.inference_mode():
        edges.scores(rows(1))
    assert edges._split is not None
    copied = copy.deepcopy(edges)
    torch.save(edges, io.BytesIO())
    with torch.inference_mode():
        assert torch.equal(copied.scores(rows(1)), edges.lm_head(rows(1)))


def test_once_the_interpreter_shuts_down_the_head_answers_itself(two_threads, monkeypatch):
    """Threads take no new work at interpreter shutdown (a worker thread still generating then)."""
    edges = edges_of()
    with torch.inference_mode():
        edges.scores(rows(1))  # the pool exists, the weight checked

    def refuse(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(client_edges._SPLIT_POOL, "submit", refuse)
    with torch.inference_mode():
        assert torch.equal(edges.scores(rows(1)), edges.lm_head(rows(1)))
