"""The event loop nodes and clients run on: uvloop (libuv) where it is installed, else asyncio's own.

Every step of a session passes through the event loops of the client and of each node: socket reads and writes,
task switches, timers. uvloop does the same work in C. NESA_EVENT_LOOP=asyncio forces the standard loop (for
comparison, or if a platform's uvloop misbehaves).

A process whose loop shares the interpreter lock with compute threads (a node's passes, a client's LM head passes)
hands that lock over when a thread comes back from the device while the loop runs Python: the thread waits until
the loop lets go or the interpreter's switch interval (5 ms by default) runs out. NESA_SWITCH_INTERVAL_MS sets that
interval for the processes `run` starts (0.1 to 100 ms; for comparison: bench/gpu.sh measures both).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from nesa_node.sdnotify import Notifier


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


def switch_interval_s() -> float | None:
    """The thread switch interval NESA_SWITCH_INTERVAL_MS asks for, in seconds (None: unset, or not a number from
    0.1 to 100, which is said on stderr and ignored: the interpreter's own interval stays)."""
    given = os.environ.get("NESA_SWITCH_INTERVAL_MS", "").strip()
    if not given:
        return None
    try:
        milliseconds = float(given)
    except ValueError:
        milliseconds = float("nan")
    if not 0.1 <= milliseconds <= 100:
        print(f"NESA_SWITCH_INTERVAL_MS={given!r} ignored: give milliseconds from 0.1 to 100", file=sys.stderr)
        return None
    return milliseconds / 1000


def run(coroutine: Coroutine) -> Any:
    """asyncio.run on the loop new_event_loop makes (with NESA_SWITCH_INTERVAL_MS's thread switch interval)."""
    if (interval := switch_interval_s()) is not None:
        sys.setswitchinterval(interval)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coroutine)


async def serve_until_signal(
    start: Callable[[], Awaitable[None]], shutdown: Callable[[], Awaitable[None]], *, name: str = "nesa-node"
) -> None:
    """Run `start`, wait for SIGINT or SIGTERM, then `shutdown` (also when `start` fails or is interrupted).

    A second signal while shutting down exits at once (status 128 + signal): an operator who presses Ctrl-C twice
    does not want to wait. Child p2pd daemons run in process groups of their own (nesa_node.peer), so a signal to
    this process's group reaches this process alone and the shutdown can still use the network. Under a service
    manager (NOTIFY_SOCKET) the command says READY once `start` is done, beats the watchdog, and says STOPPING at the
    signal (nesa_node/sdnotify.py)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    notifier = Notifier()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            print(f"{name}: second {sig.name}, exiting now", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        print(f"{name}: {sig.name} received, stopping (send it again to exit at once)", file=sys.stderr, flush=True)
        notifier.stopping(f"{name}: {sig.name} received, stopping")
        stop.set()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        loop.add_signal_handler(sig, on_signal, sig)
    starting = asyncio.ensure_future(start())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a signal while starting: stop without waiting for the start
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        else:
            starting.result()  # a failed start raises here (after shutdown, below)
            notifier.ready(f"{name}: serving")
        await stopping
    finally:
        stopping.cancel()
        notifier.close()
        await shutdown()
        for sig, handler in previous.items():  # what the program had before (the CLI's own SIGTERM handling)
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)
