"""Fault injection for soak tests and benchmarks: a swarm of node processes on this machine whose nodes are killed
(SIGKILL of the whole process group; its p2pd, in a group of its own, dies with it: nesa_node.peer) and restarted on
a schedule.

`ChaosSwarm` starts a bootstrap peer and `copies` node processes per span; `Churn` kills a random node on a
fixed period, keeping at least one live node per span, and starts a fresh one (new identity) for its span.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from nesa_node.devtools.launcher import LaunchError, ProcessGroup

logger = logging.getLogger(__name__)


@dataclass
class ChaosNode:
    process: subprocess.Popen
    address_file: Path
    span: tuple[int, int]
    peer_id: str | None = None  # known once the node printed it
    alive: bool = True


@dataclass
class ChurnEvent:
    at_s: float  # since the churn started
    killed: str  # peer id
    span: tuple[int, int]
    replacement_pid: int
    ready_s: float | None = None  # since the churn started, when the replacement printed its peer id
    replacement: str | None = None  # its peer id, once ready


class ChaosSwarm:
    """Node processes serving `spans`, `copies` of each, on 127.0.0.1. Use as a context manager."""

    def __init__(
        self,
        model_path: str,
        spans: list[tuple[int, int]],
        *,
        copies: int = 2,
        dht_prefix: str = "chaos",
        node_args: tuple[str, ...] = ("--no-measure", "--announce-period", "1"),
    ):
        self.model_path = model_path
        self.spans = spans
        self.copies = copies
        self.dht_prefix = dht_prefix
        self.node_args = node_args
        self.group = ProcessGroup()
        self.nodes: list[ChaosNode] = []
        self.initial_peers: list[str] = []
        self._count = 0
        self._lock = threading.Lock()

    def __enter__(self) -> ChaosSwarm:
        try:
            bootstrap, address_file = self.group.start("dht", ["dht"])
            self.initial_peers = self.group.wait_address(bootstrap, address_file)
            for span in self.spans:
                for _ in range(self.copies):
                    self.launch(span)
            for node in list(self.nodes):
                self.wait_ready(node)
        except BaseException:
            self.group.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.group.close()

    def launch(self, span: tuple[int, int]) -> ChaosNode:
        """Start a node process for `span` (a fresh identity); returns at once (see wait_ready)."""
        with self._lock:
            self._count += 1
            name = f"node{span[0]}-{span[1]}-{self._count}"
        args = ["run", "--model", self.model_path, "--blocks", f"{span[0]}:{span[1]}"]
        args += ["--initial-peers", *self.initial_peers, "--dht-prefix", self.dht_prefix, *self.node_args]
        process, address_file = self.group.start(name, args)
        node = ChaosNode(process, address_file, span)
        with self._lock:
            self.nodes.append(node)
        return node

    def wait_ready(self, node: ChaosNode, timeout_s: float = 120.0) -> ChaosNode:
        """Wait until the node listens and has printed its peer id."""
        self.group.wait_address(node.process, node.address_file, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while node.peer_id is None:
            for line in self.group.log_path(node.process).read_text(errors="replace").splitlines():
                if line.startswith("peer id "):
                    node.peer_id = line.split()[-1]
            if node.peer_id is None:
                if time.monotonic() > deadline:
                    raise LaunchError(f"node {node.process.pid} printed no peer id")
                time.sleep(0.05)
        return node

    def live(self, span: tuple[int, int] | None = None) -> list[ChaosNode]:
        """Nodes not killed, that have printed their peer id (ready or nearly), of `span` if given."""
        with self._lock:
            nodes = list(self.nodes)
        return [node for node in nodes if node.alive and node.peer_id and (span is None or node.span == span)]

    def node(self, peer_id: str) -> ChaosNode:
        return next(node for node in self.nodes if node.peer_id == peer_id)

    def kill(self, peer_id: str, sig: int = signal.SIGKILL) -> ChaosNode:
        """Signal the node's process group (its p2pd too); SIGKILL marks it dead and reaps it."""
        node = self.node(peer_id)
        os.killpg(node.process.pid, sig)
        if sig == signal.SIGKILL:
            node.alive = False
            node.process.wait(timeout=10)
        return node

    def open_files(self, peer_id: str) -> int:
        """File descriptors of the node process and its p2pd."""
        process = psutil.Process(self.node(peer_id).process.pid)
        return sum(each.num_fds() for each in (process, *process.children(recursive=True)))


class AfterTokens:
    """A `generate` streamer that runs `action` once, when `count` new tokens have been produced: a fault injected
    at a chosen step of a generation."""

    def __init__(self, count: int, action) -> None:
        self.count, self.action, self.seen = count, action, -1  # the first call carries the prompt

    def put(self, value) -> None:
        self.seen += 1
        if self.seen == self.count:
            self.action()

    def end(self) -> None:
        pass


@dataclass
class Churn:
    """Every `period_s`, SIGKILL one random live node whose span keeps another live node, and start a fresh node
    for that span."""

    swarm: ChaosSwarm
    period_s: float
    seed: int = 0
    events: list[ChurnEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self._rng = random.Random(self.seed)

    def __enter__(self) -> Churn:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            candidates = [node for node in self.swarm.live() if len(self.swarm.live(node.span)) >= 2]
            if not candidates:
                continue
            victim = self._rng.choice(sorted(candidates, key=lambda node: node.peer_id))
            try:
                self.swarm.kill(victim.peer_id)
                replacement = self.swarm.launch(victim.span)
                event = ChurnEvent(
                    time.monotonic() - self._started, victim.peer_id, victim.span, replacement.process.pid
                )
                self.events.append(event)
                threading.Thread(target=self._ready, args=(replacement, event), daemon=True).start()
            except Exception as exc:  # a soak goes on; the event log tells what happened
                logger.warning("churn step failed: %r", exc)

    def _ready(self, node: ChaosNode, event: ChurnEvent) -> None:
        try:
            self.swarm.wait_ready(node)
            event.ready_s, event.replacement = time.monotonic() - self._started, node.peer_id
        except Exception as exc:
            logger.warning("replacement node %d did not start: %r", node.process.pid, exc)
