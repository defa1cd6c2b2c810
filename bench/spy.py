"""Sampling profiles of running processes (py-spy), for a benchmark to say where a phase's time goes in each process of
a swarm: the nodes and the client.

`Spies(folder, {name: pid})` starts `py-spy record` on each pid (non-blocking: the process is not paused to be read,
so it runs at its own speed) when entered, and stops them when left (SIGINT: py-spy then writes what it sampled). Each
writes `folder/NAME.raw` (collapsed stacks: one line a stack, its sample count last); `summary()` reads them back as
the functions most often on the stack (inclusive) and at its top (self), shares of the samples of that process. Only
threads running at a sample are counted, so a process's sample count over the rate and the seconds recorded
(`running`) is how many of its threads ran on average. A loop waiting inside uvloop's own code counts as running
(py-spy sees no Python frame waiting), as `Runner.run` at the top of the stack. Without py-spy (or without the right to trace), `summary()` says so instead.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

# frames every stack of a process shares (interpreter start, the event loop's own): they say nothing of where time goes
BOILERPLATE = re.compile(r"\((<frozen |asyncio/|threading\.py|concurrent/futures/thread\.py|selectors\.py)")


def py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


class Spies:
    def __init__(self, folder: str | Path, pids: dict[str, int], *, rate: int = 200, top: int = 25):
        self.folder = Path(folder)
        self.pids = pids
        self.rate = rate
        self.top = top
        self.processes: dict[str, subprocess.Popen] = {}
        self.seconds = 0.0
        self.errors: dict[str, str] = {}  # name -> why its process could not be traced

    def __enter__(self) -> Spies:
        binary = py_spy()
        if binary is None:
            self.errors = {name: "py-spy is not installed" for name in self.pids}
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        try:
            for name, pid in self.pids.items():
                command = [binary, "record", "--pid", str(pid), "--rate", str(self.rate), "--format", "raw"]
                command += ["--nonblocking", "-o", str(self.folder / f"{name}.raw")]
                with open(self.folder / f"{name}.spy.log", "wb") as log:  # the child holds its own copy
                    self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            time.sleep(0.5)  # py-spy attaches within this; a spy that exited already could not trace its process
        except BaseException:
            self.__exit__()
            raise
        for name, process in self.processes.items():
            if process.poll() is not None:
                self.errors[name] = "py-spy could not trace it: " + (self.folder / f"{name}.spy.log").read_text()[-300:]
        return self

    def __exit__(self, *exc_info) -> None:
        self.seconds = time.monotonic() - getattr(self, "started", time.monotonic())
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in self.processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def summary(self) -> dict:
        figures: dict = {"seconds": round(self.seconds, 2), "rate": self.rate}
        for name in self.pids:
            if name in self.errors:
                figures[name] = {"error": self.errors[name]}
                continue
            path = self.folder / f"{name}.raw"
            with contextlib.suppress(OSError):
                figures[name] = summary = summarize(path.read_text(errors="replace"), self.top)
                # threads running on average (the event loop and the compute thread may both run)
                summary["running"] = round(summary["samples"] / (self.rate * self.seconds), 3) if self.seconds else None
        return figures


def summarize(raw: str, top: int) -> dict:
    """The functions of `raw` (py-spy's collapsed stacks) most often on a stack and at its top, with their shares of
    the samples; line numbers dropped, so a function counts once a stack."""
    inclusive, own, total = Counter(), Counter(), 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")]  # outermost first
        for frame in set(frames):
            if not BOILERPLATE.search(frame):
                inclusive[frame] += samples
        if frames:
            own[frames[-1]] += samples

    def shares(counts: Counter) -> list:
        return [[name, round(count / total, 3)] for name, count in counts.most_common(top)]

    return {"samples": total, "inclusive": shares(inclusive), "self": shares(own)}
