"""Timestamps of steps as they pass through a process, for benchmarks (`bench/inference.py --trace`).

Off unless the environment names a directory in NESA_STEP_TRACE when this module is imported (a node inherits it
from whoever starts it), or `start` is called: the process then appends one line per mark to DIR/PID.trace,
`<ns> <event> <value>`, the time on CLOCK_MONOTONIC (`time.monotonic_ns`), which every process of one machine shares,
so the marks of a client and of its nodes line up. Lines go out as they are written (one small write each, a few
microseconds), so a process stopped by a signal loses none. Off, a mark costs one check of a module global.

The marks (bench/trace_summary.py reads them):

    send, receive      a data lane's frame sealed and written, or read and opened; value: its sealed bytes
    compute, computed  a node's step: its computation starts, and ends; value of `computed`: the node's own
                       compute time in microseconds (what it reports to the client)
    forward, embedded  the client's forward (DistributedModelForCausalLM.forward in a session) starts, and its new
                       tokens are embedded
    stepped, logits    the chain's output is back in the forward, and its logits are computed
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

ENV = "NESA_STEP_TRACE"

_out: TextIO | None = None


def start(directory: str | os.PathLike) -> None:
    """Mark from now on into `directory` (created if missing)."""
    global _out
    os.makedirs(directory, exist_ok=True)
    stop()
    _out = open(os.path.join(directory, f"{os.getpid()}.trace"), "a", buffering=1)  # noqa: SIM115


def stop() -> None:
    """No more marks (the file is closed)."""
    global _out
    out, _out = _out, None
    if out is not None:
        out.close()


def mark(event: str, value: int = 0) -> None:
    out = _out
    if out is not None:
        try:
            out.write(f"{time.monotonic_ns()} {event} {value}\n")
        except (OSError, ValueError):  # a full disk, or the file closed by `stop` meanwhile: the mark is lost,
            pass  # never the step it marks


def _forget_in_child() -> None:
    """A forked child marks nothing into its parent's file (it may `start` its own)."""
    global _out
    _out = None


os.register_at_fork(after_in_child=_forget_in_child)

if os.environ.get(ENV):
    try:
        start(os.environ[ENV])
    except OSError as exc:  # a directory this process cannot write: it runs, without marks
        sys.stderr.write(f"nesa-node: no step marks, {ENV}={os.environ[ENV]!r}: {exc}\n")


__all__ = ["ENV", "mark", "start", "stop"]
