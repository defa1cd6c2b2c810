"""Start nesa-node processes (bootstrap peer, node daemons) on this machine and always stop them.

Used by `nesa-node demo` and the swarm tests. Every child runs in its own process group; the p2pd daemon a child
spawns has a group of its own and is killed by the kernel when the child dies (nesa_node.peer), also after a SIGKILL
of the child itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nesa_node.errors import NesaError


class LaunchError(NesaError):
    code = "launch"


class ProcessGroup:
    """Children started with `start`; `stop_all` (or leaving the `with` block) terminates every one."""

    def __init__(self, workdir: str | None = None, *, log_to_files: bool = True):
        self._tmp = tempfile.TemporaryDirectory(prefix="nesa-swarm-") if workdir is None else None
        self.workdir = Path(workdir or self._tmp.name)
        self.log_to_files = log_to_files
        self.processes: list[subprocess.Popen] = []
        self.names: dict[int, str] = {}

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def log_path(self, process: subprocess.Popen) -> Path:
        return self.workdir / f"{self.names[process.pid]}.log"

    def start(
        self, name: str, args: list[str], *, wrapper: list[str] | tuple[str, ...] = ()
    ) -> tuple[subprocess.Popen, Path]:
        """Run `nesa-node ARGS --address-file FILE` (after `wrapper`, a command that execs it, such as
        `ip netns exec NAME`); returns the process and the address file to wait for."""
        address_file = self.workdir / f"{name}.addr"
        address_file.unlink(missing_ok=True)
        log = open(self.workdir / f"{name}.log", "wb") if self.log_to_files else subprocess.DEVNULL  # noqa: SIM115
        command = [*wrapper, sys.executable, "-m", "nesa_node.cli", *args, "--address-file", str(address_file)]
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        if log is not subprocess.DEVNULL:
            log.close()
        self.processes.append(process)
        self.names[process.pid] = name
        return process, address_file

    def wait_address(self, process: subprocess.Popen, address_file: Path, timeout_s: float = 120.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if address_file.is_file():
                lines = [line.strip() for line in address_file.read_text().splitlines() if line.strip()]
                if lines:
                    return lines
            if process.poll() is not None:
                raise LaunchError(f"process {process.pid} exited with {process.returncode}; {self.log_tail(process)}")
            time.sleep(0.1)
        raise LaunchError(f"process {process.pid} wrote no address within {timeout_s} s; {self.log_tail(process)}")

    def log_tail(self, process: subprocess.Popen, lines: int = 20) -> str:
        path = self.log_path(process)
        text = path.read_text(errors="replace") if path.is_file() else ""
        return "log: " + " | ".join(text.splitlines()[-lines:]) if text else "no log"

    def stop(self, process: subprocess.Popen, *, grace_s: float = 15.0, sig: int = signal.SIGTERM) -> None:
        """Signal the child (its p2pd, in a group of its own, outlives the signal while the child drains and says
        goodbye on the network), wait up to `grace_s`, then SIGKILL its process group (p2pd dies with the child)."""
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the group; p2pd follows its parent
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)

    def stop_all(self, grace_s: float = 15.0) -> None:
        """SIGTERM every child at once; those still running when the shared `grace_s` is up are SIGKILLed."""
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in reversed(self.processes):
            self.stop(process, grace_s=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        try:
            self.stop_all()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def split_blocks(num_blocks: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous spans [start, end) splitting `num_blocks` as evenly as possible into `parts`."""
    if not 0 < parts <= num_blocks:
        raise ValueError(f"cannot split {num_blocks} blocks into {parts} non-empty spans")
    bounds = [round(index * num_blocks / parts) for index in range(parts + 1)]
    return [(bounds[index], bounds[index + 1]) for index in range(parts)]
