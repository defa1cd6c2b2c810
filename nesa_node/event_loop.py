"""The event loop nodes and clients run on: uvloop (libuv) where it is installed, else asyncio's own.

Every step of a session passes through the event loops of the client and of each node: socket reads and writes,
task switches, timers. uvloop does the same work in C. NESA_EVENT_LOOP=asyncio forces the standard loop (for
comparison, or if a platform's uvloop misbehaves).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


def _uvloop():
    if os.environ.get("NESA_EVENT_LOOP", "uvloop") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def new_event_loop() -> asyncio.AbstractEventLoop:
    uvloop = _uvloop()
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(coroutine: Coroutine) -> Any:
    """asyncio.run on the loop new_event_loop makes."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coroutine)


async def serve_until_signal(start: Callable[[], Awaitable[None]], shutdown: Callable[[], Awaitable[None]]) -> None:
    """Run `start`, wait for SIGINT or SIGTERM, then `shutdown` (also when `start` fails)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await start()
        await stop.wait()
    finally:
        await shutdown()
