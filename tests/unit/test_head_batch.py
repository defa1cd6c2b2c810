"""The client's LM head over concurrent sessions (client/head_batch.py): a lone session is scored inline; concurrent
ones share passes on the head's thread, each getting the scores of its own rows; a failing pass fails its callers
with its error and the next pass runs; closing cancels the waiting ones and refuses new ones."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from nesa_node.client.config import ClientConfig
from nesa_node.client.head_batch import HeadBatcher, choose_tokens
from nesa_node.errors import SessionStateError

WEIGHT = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))  # (vocab, hidden)


def linear_head(record: list | None = None, seconds: float = 0.0):
    def head(rows: torch.Tensor) -> torch.Tensor:
        if record is not None:
            record.append((rows.shape[0], threading.get_ident()))
        time.sleep(seconds)  # what a pass of a real head takes
        return rows @ WEIGHT.T  # (rows, vocab)

    return head


def another_session_stepping(batcher: HeadBatcher) -> None:
    """Make the batcher see another session that is stepping now."""
    batcher.gatherings[0].arrived("other", time.monotonic())


async def test_a_lone_session_is_scored_inline():
    calls = []
    batcher = HeadBatcher(linear_head(calls))
    batcher.gatherings[0].arrived("stopped", time.monotonic() - 10)  # a session silent for long does not count
    for _ in range(3):
        hidden = torch.randn(2, 16)
        torch.testing.assert_close(await batcher.scores(hidden, "a"), hidden @ WEIGHT.T)
    assert calls == [(2, threading.get_ident())] * 3  # on the caller's (the loop's) thread
    assert batcher.passes == 3 and batcher.batched_passes == 0
    await batcher.close()


async def test_concurrent_sessions_share_passes_and_each_gets_its_own_rows():
    calls = []
    batcher = HeadBatcher(linear_head(calls))
    rows = [torch.randn(1 + index % 3, 16) for index in range(8)]
    await asyncio.gather(*(batcher.scores(hidden, index) for index, hidden in enumerate(rows)))  # all now stepping
    calls.clear()
    scores = await asyncio.gather(*(batcher.scores(hidden, index) for index, hidden in enumerate(rows)))
    for hidden, score in zip(rows, scores, strict=True):
        torch.testing.assert_close(score, hidden @ WEIGHT.T)
    assert sum(size for size, _ in calls) == sum(hidden.shape[0] for hidden in rows)
    assert len(calls) < len(rows) and batcher.batched_passes >= 1
    assert all(thread != threading.get_ident() for _, thread in calls)  # on the head's own thread
    await batcher.close()


async def test_waves_keep_their_sessions_passes_apart():
    """With 2 waves the sessions are dealt alternately (a new one to the wave with the fewest open): answers of every
    session queued together go in one pass a wave, each row still getting its own scores, and no pass mixes the
    waves; a session that closes frees its place."""
    calls = []
    batcher = HeadBatcher(linear_head(calls, seconds=0.01), waves=2)
    rows = {name: torch.randn(1, 16) for name in "abcde"}

    async def round_of(names: str) -> None:
        scores = await asyncio.gather(*(batcher.scores(rows[name], name) for name in names))
        for name, score in zip(names, scores, strict=True):
            torch.testing.assert_close(score, rows[name] @ WEIGHT.T)

    await round_of("abcd")  # all now stepping
    assert batcher._waves == {"a": 0, "b": 1, "c": 0, "d": 1}
    for _ in range(3):
        calls.clear()
        await round_of("abcd")
        assert [size for size, _ in calls] == [2, 2], calls  # {a, c}, then {b, d}
    batcher.forget("a")
    batcher.forget("c")
    await round_of("e")
    assert batcher._waves["e"] == 0
    with pytest.raises(ValueError, match="waves"):
        HeadBatcher(linear_head(), waves=0)
    for waves in (0, 65):
        with pytest.raises(ValueError, match="head_waves"):
            ClientConfig(head_waves=waves)
    await batcher.close()


async def test_sessions_of_a_round_wait_for_each_other():
    """After rounds of answers from two sessions, the next round's first answer waits (within the window) for the
    second, expected a period after its last and late by less than a pass (50 ms here): both are scored in one
    pass."""
    calls = []
    batcher = HeadBatcher(linear_head(calls, seconds=0.05), window_s=1.0)
    for _ in range(3):
        await asyncio.gather(batcher.scores(torch.randn(1, 16), "a"), batcher.scores(torch.randn(1, 16), "b"))
        await asyncio.sleep(0.05)
    calls.clear()

    async def late_b():
        await asyncio.sleep(0.01)
        return await batcher.scores(torch.randn(1, 16), "b")

    await asyncio.gather(batcher.scores(torch.randn(1, 16), "a"), late_b())
    assert [size for size, _ in calls] == [2]
    await batcher.close()


async def test_a_failing_pass_fails_its_callers_and_the_next_pass_runs():
    failing = {"on": True}

    def head(rows: torch.Tensor) -> torch.Tensor:
        if failing["on"]:
            raise RuntimeError("device lost")
        return rows @ WEIGHT.T

    batcher = HeadBatcher(head)
    another_session_stepping(batcher)
    results = await asyncio.gather(
        *(batcher.scores(torch.randn(1, 16), index) for index in range(3)), return_exceptions=True
    )
    assert all(isinstance(result, RuntimeError) and "device lost" in str(result) for result in results)
    failing["on"] = False
    # rows that cannot be stacked (a fault of the pass, not of the head) reach their callers as that error too
    results = await asyncio.gather(
        batcher.scores(torch.randn(1, 16), 0), batcher.scores(torch.randn(1, 8), 1), return_exceptions=True
    )
    assert all(isinstance(result, RuntimeError) for result in results), results
    hidden = torch.randn(1, 16)
    torch.testing.assert_close(await batcher.scores(hidden, 0), hidden @ WEIGHT.T)
    await batcher.close()


async def test_closing_cancels_the_waiting_callers():
    started, release = threading.Event(), threading.Event()

    def slow_head(rows: torch.Tensor) -> torch.Tensor:
        started.set()
        release.wait(5)
        return rows @ WEIGHT.T

    batcher = HeadBatcher(slow_head)
    another_session_stepping(batcher)
    waiting = [asyncio.ensure_future(batcher.scores(torch.randn(1, 16), index)) for index in range(3)]
    await asyncio.to_thread(started.wait, 5)
    await batcher.close()
    release.set()
    await asyncio.wait(waiting)
    assert all(task.cancelled() for task in waiting)
    with pytest.raises(SessionStateError):
        await batcher.scores(torch.randn(1, 16), 0)


def test_greedy_choice_is_the_argmax_and_sampling_checks_its_temperature():
    scores = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert choose_tokens(scores, False, 1.0, 0, 1.0, None).tolist() == [1, 0]
    with pytest.raises(ValueError, match="temperature"):
        choose_tokens(scores, True, 0.0, 0, 1.0, None)
    generator = torch.Generator().manual_seed(0)
    sampled = choose_tokens(scores, True, 1.0, 1, 1.0, generator)  # top-1 sampling is the argmax
    assert sampled.tolist() == [1, 0]


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-8])
def test_a_temperature_near_zero_samples_the_argmax_not_nan(temperature):
    """Scores divided by a tiny temperature overflow (and 0/0 where it rounds to zero in float32): sampling goes from
    the best score down, so such a temperature is greedy, not an error."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 1000, generator=generator) * 20
    for top_k, top_p in ((0, 1.0), (5, 0.9)):
        assert torch.equal(choose_tokens(scores, True, temperature, top_k, top_p, generator), scores.argmax(dim=-1))
