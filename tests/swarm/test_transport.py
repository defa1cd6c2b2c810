"""Transport (RELIABILITY.md section C): traffic between peers is encrypted by libp2p, so hidden states sent
through the swarm never appear in a capture of the loopback interface.

The capture needs tcpdump and root (CAP_NET_RAW); `make test` installs tcpdump where apt-get is available.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid

import psutil
import pytest
import torch

from nesa_node import DistributedModelForCausalLM
from nesa_node.devtools.launcher import ProcessGroup
from nesa_node.peer import start_peer
from nesa_node.protocol import lane
from nesa_node.protocol.channel import LaneChannel
from tests.support.swarm import wait_for_chain

HIDDEN = 64  # the tiny Llama's hidden size


def known_pattern(tokens: int) -> torch.Tensor:
    """Hidden states (1, tokens, hidden) whose float32 bytes repeat a recognizable 256-byte motif."""
    motif = torch.arange(HIDDEN, dtype=torch.float32) * 0.001 + 7.125  # (hidden,)
    return motif.repeat(1, tokens, 1)  # (1, tokens, hidden)


def windows(data: bytes, width: int = 16) -> list[bytes]:
    """Every distinct `width`-byte window of one motif: a packet boundary cannot hide all of them."""
    return list(dict.fromkeys(data[start : start + width] for start in range(0, len(data) - width, 4)))


class Capture:
    """tcpdump on the loopback interface, writing every TCP packet whole to `path`.

    tcpdump reports "listening" a moment before packets really arrive, and writes them a moment after: a marker sent
    over plain TCP, and seen in the file, tells that recording has started (or that all earlier packets are in).
    """

    def __init__(self, path: str, *, timeout_s: float = 20.0):
        self.path = path
        self.timeout_s = timeout_s
        self.process = subprocess.Popen(
            ["tcpdump", "-i", "lo", "-U", "-s", "0", "-Z", "root", "-w", path, "tcp"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_for_marker()

    def _recorded(self) -> bytes:
        try:
            with open(self.path, "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            return b""

    def _wait_for_marker(self) -> None:
        marker = f"nesa-capture-marker-{uuid.uuid4().hex}".encode()
        deadline = time.monotonic() + self.timeout_s
        while marker not in self._recorded():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("tcpdump did not record a marker packet on the loopback interface")
            send_in_plaintext(marker)
            time.sleep(0.05)

    def stop(self) -> bytes:
        if self.process.poll() is None:
            self._wait_for_marker()  # everything sent before is in the file now
            self.process.send_signal(signal.SIGINT)
            self.process.wait(timeout=10)
        return self._recorded()


@pytest.fixture
def capture(tmp_path):
    """Start captures into tmp_path; each is stopped at the end of the test."""
    if shutil.which("tcpdump") is None:
        pytest.fail("tcpdump is not installed: run `make test` (it installs tcpdump) or apt-get install tcpdump")
    if os.geteuid() != 0:
        pytest.skip("capturing packets needs root (CAP_NET_RAW)")
    started: list[Capture] = []

    def start() -> Capture:
        started.append(Capture(str(tmp_path / f"loopback-{len(started)}.pcap")))
        return started[-1]

    try:
        yield start
    finally:
        for each in started:
            each.stop()


def send_in_plaintext(data: bytes) -> None:
    """The same bytes over a plain loopback TCP connection: shows the capture would catch a leak."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as sender:
            receiver, _ = server.accept()
            with receiver:
                sender.sendall(data)
                received = b""
                while len(received) < len(data):
                    received += receiver.recv(len(data) - len(received))


async def pushed_on_lanes(node, session_id: str) -> bool:
    """Whether `node` pushes the session's outputs to its next node over a data lane (not libp2p)."""
    session = next(iter(node.sessions.named(session_id)), None)
    return session is not None and isinstance(session.downstream, LaneChannel)


def test_c_a_known_hidden_state_pattern_never_appears_in_a_loopback_capture(local_swarm, tiny_llama, capture):
    nodes = [local_swarm.start_node(tiny_llama, start, end, dht_prefix="capture") for start, end in ((0, 2), (2, 4))]
    hidden = known_pattern(32)
    motif = hidden[0, 0].numpy().tobytes()  # 256 bytes, as float32 on the wire with codec "none"
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="capture", compression="none"
    ) as model:
        chain = wait_for_chain(model, hops=2)
        session_capture = capture()
        with model.session_on(chain, batch=1, max_length=64, failover=False) as session:
            # hidden states travel on data lanes: client -> first node, first -> second, second -> client
            links = session.links.links
            assert links[0].has_step_lane() and links[-1].outputs is not None
            session.step(hidden)  # prefill: 32 tokens, 8 KiB of the motif from the client to the first node
            for _ in range(8):
                session.step(known_pattern(1))
            assert local_swarm.run(pushed_on_lanes(nodes[0], session.session_id))
        recorded = session_capture.stop()
        ports = {
            int(maddr.split("/tcp/")[1].split("/")[0])
            for node in nodes
            for maddr in local_swarm.run(node.visible_maddrs())
        }
        lane_ports = {lane.parse_address(node.lane_address)[1] for node in nodes}

    # the control: the same bytes over plain TCP are caught, so the check below can fail
    control_capture = capture()
    send_in_plaintext(hidden.numpy().tobytes())
    control = control_capture.stop()
    assert motif in control
    assert all(window in control for window in windows(motif))

    # the session's traffic was recorded (packets to and from the nodes' libp2p ports), and none of it is the motif
    assert any(port.to_bytes(2, "big") in recorded for port in ports)
    assert all(port.to_bytes(2, "big") in recorded for port in lane_ports)
    assert len(recorded) > 32 * len(motif)
    assert [window for window in windows(motif) if window in recorded] == []


@pytest.mark.parametrize("operator_gogc", [None, "80"], ids=["default", "operator-set"])
def test_p2pd_runs_its_gc_at_the_peer_modules_target_unless_the_operator_sets_gogc(monkeypatch, operator_gogc):
    """p2pd's heap goal at Go's default grew a client's daemon by a third under churn (nesa_node/peer.py): the daemons
    this process spawns get P2PD_GOGC, or the GOGC of this process's environment."""
    import asyncio

    from nesa_node import peer

    if operator_gogc is None:
        monkeypatch.delenv("GOGC", raising=False)
    else:
        monkeypatch.setenv("GOGC", operator_gogc)

    async def spawned_gogc() -> str | None:
        p2p = await peer._create_p2p({"host_maddrs": ["/ip4/127.0.0.1/tcp/0"]})
        try:
            return psutil.Process(p2p._child.pid).environ().get("GOGC")  # the wrapper execs p2pd: the same pid
        finally:
            await p2p.shutdown()

    expected = operator_gogc or peer.P2PD_GOGC
    assert asyncio.run(spawned_gogc()) == expected


def test_a_peer_joins_through_an_initial_peer_whose_dht_misses_the_first_pings(tmp_path):
    """An initial peer whose DHT is busy (here its process is stopped while its p2pd, a process of its own, still
    takes connections) misses the joiner's first DHT pings; the joiner pings again (peer.join_dht) and joins once it
    answers, where one missed ping used to fail a node's or client's start."""

    async def join(peers: list[str]) -> bool:
        peer = await start_peer(initial_peers=peers, client_mode=True)
        try:
            return bool(peer.dht.protocol.routing_table.uid_to_peer_id)  # it knows the bootstrap's DHT now
        finally:
            await peer.shutdown()

    with ProcessGroup(str(tmp_path)) as group:
        bootstrap = group.start("dht", ["dht"])
        peers = group.wait_address(*bootstrap)
        process = bootstrap[0]
        os.kill(process.pid, signal.SIGSTOP)
        resume = threading.Timer(4.5, os.kill, (process.pid, signal.SIGCONT))  # after the first round of pings
        resume.start()
        try:
            started = time.monotonic()
            joined = asyncio.run(join(peers))
            took_s = time.monotonic() - started
        finally:
            resume.cancel()
            os.kill(process.pid, signal.SIGCONT)
    assert joined
    assert took_s > 4.0, took_s  # it did wait for the stopped DHT
