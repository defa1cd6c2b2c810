"""Driving `nesa-node` as an operator does: commands in process groups of their own, signals to the whole group,
output captured to files. Every process started here is stopped at the end (SIGKILL of its group if need be)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

NESA = [
    sys.executable,
    *(["-O"] if sys.flags.optimize else []),
    "-m",
    "nesa_node.cli",
]  # -O when the suite runs with it


@dataclass
class Command:
    process: subprocess.Popen
    log: Path
    children: list[int]  # the p2pd daemons and other children, as last seen by `watch_children`

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def watch_children(self) -> list[int]:
        """Remember the command's live descendants (its p2pd), to check later that none outlives it."""
        try:
            self.children = [child.pid for child in psutil.Process(self.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
        return self.children


class Operator:
    """Starts commands in `workdir`; `stop_all` (the fixture's teardown) ends whatever still runs."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.commands: list[Command] = []
        self._count = 0

    def start(self, *args: str, name: str | None = None) -> Command:
        self._count += 1
        log = self.workdir / f"{name or args[0]}-{self._count}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [*NESA, *args],
                cwd=self.workdir,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a process group of its own, as a terminal's job or a service has
            )
        command = Command(process, log, [])
        self.commands.append(command)
        return command

    def run(self, *args: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess:
        """Run a command to its end; stdout and stderr apart."""
        return subprocess.run(
            [*NESA, *args],
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )

    def wait_file(self, path: Path | str, command: Command | None = None, timeout_s: float = 120.0) -> str:
        """Wait until `path` (relative to workdir) is non-empty; its text. Fails early if `command` exits."""
        path = self.workdir / path
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.is_file() and path.stat().st_size > 0:
                return path.read_text()
            if command is not None and command.process.poll() is not None:
                raise AssertionError(f"{command.process.args} exited {command.process.returncode}:\n{command.output()}")
            time.sleep(0.1)
        raise AssertionError(f"{path} not written in {timeout_s} s")

    def signal(self, command: Command, sig: int, timeout_s: float = 10.0) -> tuple[int, float]:
        """Send `sig` to the command's process group (what a terminal's Ctrl-C, `timeout` and systemd do); wait for
        it to exit within `timeout_s`. Returns (exit status, seconds taken)."""
        command.watch_children()
        started = time.monotonic()
        os.killpg(command.pid, sig)
        try:
            status = command.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{command.process.args} still runs {timeout_s} s after {sig!r}") from None
        return status, time.monotonic() - started

    def stop_all(self) -> None:
        for command in self.commands:
            if command.process.poll() is None:
                command.watch_children()
                with _gone():
                    os.killpg(command.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        for command in self.commands:
            try:
                command.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with _gone():
                    os.killpg(command.pid, signal.SIGKILL)
                command.process.wait()
        # p2pd daemons run in groups of their own and die with their parent (nesa_node.peer): nothing else to stop


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    """The pids still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


class _gone:
    """Suppress the errors of signalling a process that has already exited."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is not None and issubclass(kind, ProcessLookupError | psutil.NoSuchProcess | PermissionError)


# ---- an operator's commands (tests/swarm/test_operator*.py) ----------------------------------------

STOP_S = 10.0  # the bound of the acceptance; a clean stop takes about 0.5 s (dht) to 3 s (a node)
# a peer address of the right form that nothing listens on
SILENT_PEER = "/ip4/127.0.0.1/tcp/{port}/p2p/QmVjXs6BHfUPfdE6yhUMEKBo6YFxUWnDhSSfWHDDWDHeQW"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def silent_peer() -> str:
    return SILENT_PEER.format(port=free_port())


def start_bootstrap(operator: Operator, *extra: str, name: str = "boot") -> tuple:
    command = operator.start("dht", "--address-file", f"{name}.addr", *extra, name=name)
    return command, operator.wait_file(f"{name}.addr", command).split()[0]


def start_node(operator: Operator, model: str, blocks: str, bootstrap: str, name: str, *extra: str):
    command = operator.start(
        "run", "--model", model, "--blocks", blocks, "--initial-peers", bootstrap, "--address-file", f"{name}.addr",
        "--torch-threads", "1", *extra, name=name,
    )  # fmt: skip
    operator.wait_file(f"{name}.addr", command)
    return command


def assert_stopped_cleanly(
    operator: Operator, command, sig: int, expected_status: int = 0, *, has_p2pd: bool = True
) -> float:
    sockets = p2pd_sockets(command)
    status, seconds = operator.signal(command, sig, timeout_s=STOP_S)
    output = command.output()
    assert status == expected_status, output
    assert "Traceback" not in output and "Task exception" not in output, output
    assert wait_gone(command.children) == [], "a p2pd outlived its process"
    # the process stopped its p2pd itself (hivemind removes the control socket then), not the kernel at its death
    assert bool(sockets) == has_p2pd and not any(os.path.exists(path) for path in sockets), sockets
    return seconds


def p2pd_sockets(command) -> list[str]:
    """The control sockets of the command's p2pd daemons (their -listen=/unix/PATH argument)."""
    paths = []
    for pid in command.watch_children():
        try:
            arguments = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        paths += [argument.split("/unix", 1)[1] for argument in arguments if argument.startswith("-listen=/unix/")]
    return paths


def one_error_line(result, code: str) -> str:
    """The failure's stderr is exactly one line `error: [code] ...`; returns it."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: [{code}] "), result.stderr
    assert result.returncode == 2, result.stderr
    return lines[0]
