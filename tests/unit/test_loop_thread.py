"""LoopThread.call(..., lend_thread=True): the work a coroutine hands over with `on_caller` runs on the waiting
thread (a synchronous client's torch work stays on the caller's thread), in order, with its errors; without a
lent thread it runs inline; a timeout still cancels the coroutine."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from nesa_node.client.model import LoopThread, on_caller
from nesa_node.errors import PeerUnavailableError


@pytest.fixture
def runner():
    runner = LoopThread("test-loop")
    yield runner
    runner.stop()


def where() -> int:
    return threading.get_ident()


def test_work_runs_on_the_lent_thread_in_order(runner):
    order = []

    async def coroutine() -> tuple[int, int, int]:
        first = await on_caller(where)
        await asyncio.sleep(0.01)
        await asyncio.gather(*(on_caller(order.append, index) for index in range(5)))
        return first, await on_caller(where), where()

    first, second, loop = runner.call(coroutine(), lend_thread=True)
    assert first == second == threading.get_ident()
    assert loop != threading.get_ident()
    assert order == [0, 1, 2, 3, 4]


def test_without_a_lent_thread_work_runs_on_the_loop(runner):
    async def coroutine() -> tuple[int, int]:
        return await on_caller(where), where()

    inside, loop = runner.call(coroutine())
    assert inside == loop != threading.get_ident()


def test_an_error_in_the_work_reaches_the_coroutine(runner):
    def fails() -> None:
        raise ValueError("bad batch")

    async def coroutine() -> str:
        try:
            await on_caller(fails)
        except ValueError as exc:
            return f"caught {exc}"
        return "not raised"

    assert runner.call(coroutine(), lend_thread=True) == "caught bad batch"


def test_a_timeout_cancels_the_coroutine(runner):
    cancelled = threading.Event()

    async def slow() -> None:
        try:
            await on_caller(where)
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    started = time.monotonic()
    with pytest.raises(PeerUnavailableError):
        runner.call(slow(), timeout=0.3, lend_thread=True)
    assert time.monotonic() - started < 5
    assert cancelled.wait(5)


def test_work_handed_over_after_the_call_returned_runs_on_the_loop(runner):
    """A task started during a call that outlives it (it inherited the call's context) does not wait for a thread
    that has gone back to its own work."""
    seen: asyncio.Future | None = None

    async def starts_task() -> None:
        nonlocal seen

        async def later() -> int:
            await asyncio.sleep(0.05)
            return await on_caller(where)

        seen = asyncio.ensure_future(later())

    runner.call(starts_task(), lend_thread=True)

    async def result() -> tuple[int, int]:
        return await asyncio.wait_for(seen, 5), where()

    inside, loop = runner.call(result())
    assert inside == loop != threading.get_ident()


def test_an_interrupt_while_waiting_cancels_the_coroutine(runner, monkeypatch):
    """Ctrl-C in a synchronous call (a step under way) stops the coroutine too, rather than leaving it running on
    the loop with its session still stepping."""
    import concurrent.futures

    cancelled = threading.Event()
    started = threading.Event()

    async def coroutine() -> None:
        try:
            started.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def interrupted(self, timeout=None):
        started.wait(5)
        raise KeyboardInterrupt

    monkeypatch.setattr(concurrent.futures.Future, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.call(coroutine())
    monkeypatch.undo()
    assert cancelled.wait(5)


def test_the_coroutines_own_timeout_error_is_its_own_not_the_calls(runner):
    async def coroutine() -> None:
        async with asyncio.timeout(0.01):
            await asyncio.sleep(1)

    with pytest.raises(PeerUnavailableError, match="timed out waiting") as raised:  # typed, and not "within 30 s"
        runner.call(coroutine(), timeout=30)
    assert "30 s" not in raised.value.message
