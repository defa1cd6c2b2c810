"""Starting a peer of the swarm: identity, a hivemind P2P host (one p2pd process) and a DHT node with the record
validators. One function, `start_peer`, used by the node daemon, the graph-stage node, the bootstrap peer and the
client alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID, p2p_daemon
from hivemind.p2p.p2p_daemon_bindings import control as p2pd_control
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from nesa_node.errors import InitialPeersError, PortInUseError
from nesa_node.protocol import dht_storage, msgpack_guard
from nesa_node.protocol.dht import install_subkey_filter, make_validator
from nesa_node.protocol.identity import ensure_identity, load_private_key

logger = logging.getLogger(__name__)

SHUTDOWN_STEP_S = 2.0  # per network step of a shutdown (guess: a healthy DHT leave takes well under 1 s)
# rounds of DHT pings to the initial peers when joining: each waits hivemind's 3 s RPC timeout, and a busy peer (a
# flood of stores, a loaded host) can miss one and answer the next (guess)
DHT_JOIN_ROUNDS = 3


@dataclass
class Peer:
    """A running P2P host and DHT node. `signature_validator` signs this peer's own records (None for a peer that
    writes none: clients and bootstrap peers)."""

    p2p: P2P
    dht: DHTNode
    signature_validator: RSASignatureValidator | None
    initial_peers: tuple[str, ...] = ()

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def visible_maddrs(self) -> list[str]:
        return [str(addr) for addr in await self.p2p.get_visible_maddrs()]

    async def contact_initial_peers(self, timeout_s: float = 5.0) -> int:
        """Dial every initial peer at its address again and ping it over the DHT; returns how many answered.

        hivemind drops a peer that stops answering from its routing table and never asks for it again, and a peer
        that restarts knows nobody: without this, a bootstrap peer restarted after some time down (same identity and
        port) would never learn the swarm again, and clients that join through it would see no node. Called every
        announce period by nodes and stage nodes, and by bootstrap peers."""
        return await self.contact(self.initial_peers, timeout_s)

    async def contact(self, addresses, timeout_s: float = 5.0) -> int:
        """Dial each peer at its address (/ip4/HOST/tcp/PORT/p2p/ID) and ping it over the DHT, all at once: each
        side then has the other in its routing table. Returns how many answered."""
        results = await asyncio.gather(*(self._contact(address, timeout_s) for address in addresses))
        return sum(results)

    async def _contact(self, address: str, timeout_s: float) -> bool:
        maddr = Multiaddr(address)
        peer_id = PeerID.from_base58(maddr["p2p"])
        if peer_id == self.p2p.peer_id:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await self.p2p._client.connect(peer_id, [maddr.decapsulate(Multiaddr(f"/p2p/{peer_id}"))])
                return await self.dht.protocol.call_ping(peer_id) is not None
        except Exception as exc:  # gone, or not up yet: tried again next period
            logger.debug("initial peer %s did not answer: %r", address, exc)
            return False

    async def shutdown(self, step_s: float = SHUTDOWN_STEP_S) -> None:
        """Leave the DHT, then stop p2pd; each step bounded by `step_s` (peers that are gone must not hold a
        stopping process)."""
        for closer in (self.dht.shutdown, self.p2p.shutdown):
            try:
                await asyncio.wait_for(closer(), timeout=step_s)
            except Exception as exc:  # a peer that is gone, or p2pd already stopped: normal during shutdown
                logger.debug("peer shutdown step failed: %r", exc)


async def start_peer(
    *,
    initial_peers: tuple[str, ...] | list[str] = (),
    host: str | None = "127.0.0.1",
    port: int = 0,
    identity_path: str | None = None,
    dht_prefixes: tuple[str, ...] | list[str] = (),
    signs_records: bool = False,
    client_mode: bool = False,
    announce_host: str | None = None,
) -> Peer:
    """Start P2P and DHT. `dht_prefixes`: model keys whose NodeInfo records this peer validates (protocol.dht).

    `signs_records`: the peer announces records signed with its identity key (nodes); without `identity_path` a
    fresh key is made for this run. `client_mode`: a DHT client that stores nothing for others (SDK clients).
    `host` None lets hivemind pick its default listening address. `announce_host`: the IP address announced instead
    of the listening one (on `port`; a free one is picked for 0, since an announced address needs its port). Raises PortInUseError for a taken `port`,
    InitialPeersError when `initial_peers` are malformed or none answers, OSError or hivemind's errors when p2pd
    cannot start otherwise; nothing is left running then."""
    check_initial_peers(initial_peers)
    if host is not None:
        check_port_free(host, port, "--port")
    identity_tmp = None
    if identity_path is None and signs_records:  # records need a key this process can read: a fresh one
        identity_tmp = tempfile.TemporaryDirectory(prefix="nesa-node-")
        identity_path = os.path.join(identity_tmp.name, "identity.key")
    signature_validator = None
    try:
        if identity_path is not None:
            ensure_identity(identity_path)
            if signs_records:
                signature_validator = RSASignatureValidator(load_private_key(identity_path))
        options: dict = {"initial_peers": list(initial_peers)}
        if announce_host is not None:
            port = port or free_port(host or "0.0.0.0")
            options["announce_maddrs"] = [f"{ip_protocol(announce_host)}/{announce_host}/tcp/{port}"]
        if host is not None:
            options["host_maddrs"] = [f"{ip_protocol(host)}/{host}/tcp/{port}"]
        if identity_path is not None:
            options.update(identity_path=str(identity_path), check_if_identity_free=False)
        if client_mode:
            options["dht_mode"] = "client"
        p2p = await _create_p2p(options)
    except P2PDaemonError as exc:
        if "bootstrap peers" in str(exc):
            raise InitialPeersError(_no_initial_peer_answered(initial_peers)) from exc
        raise
    finally:  # p2pd has read a fresh key by now, and this process holds it: no file of it outlives even a killed run
        if identity_tmp is not None:
            identity_tmp.cleanup()
    dht = None
    try:
        dht = await DHTNode.create(
            p2p=p2p,
            initial_peers=list(initial_peers),
            client_mode=client_mode,
            record_validator=make_validator(signature_validator, list(dht_prefixes)),
            ensure_bootstrap_success=False,  # its one round of pings: join_dht asks again
        )
        if initial_peers and not await join_dht(dht, initial_peers):  # p2pd reached them, their DHT did not answer
            raise InitialPeersError(_no_initial_peer_answered(initial_peers))
    except BaseException:
        with contextlib.suppress(Exception):
            if dht is not None:
                await asyncio.wait_for(dht.shutdown(), timeout=SHUTDOWN_STEP_S)
            await asyncio.wait_for(p2p.shutdown(), timeout=SHUTDOWN_STEP_S)
        raise
    return Peer(p2p, dht, signature_validator, tuple(initial_peers))


async def join_dht(dht: DHTNode, initial_peers, rounds: int = DHT_JOIN_ROUNDS) -> bool:
    """Whether `dht` joined through `initial_peers`: one of them answered a validated DHT ping (it is a DHT peer, its
    clock agrees, and a server-mode node is reachable back: hivemind's own checks), within `rounds` rounds of pings
    to all of them; then the node looks up its own neighbours. hivemind's DHTNode.create pings once, and a busy
    initial peer missing that one ping would fail a node's or client's start."""
    peer_ids = [PeerID.from_base58(str(Multiaddr(str(address))["p2p"])) for address in initial_peers]
    for attempt in range(rounds):
        answers = await asyncio.gather(*(dht.protocol.call_ping(peer, validate=True) for peer in peer_ids))
        if any(answer is not None for answer in answers):
            await dht.find_nearest_nodes([dht.node_id])  # fills the routing table beyond the initial peers
            return True
        logger.info("no initial peer answered a DHT ping (round %d of %d)", attempt + 1, rounds)
    return False


def check_initial_peers(initial_peers) -> None:
    """Raise InitialPeersError unless every entry is a multiaddr that names its peer: /ip4/HOST/tcp/PORT/p2p/ID."""
    for address in initial_peers:
        try:
            peer_id = Multiaddr(str(address))["p2p"]
        except Exception:
            peer_id = None
        if not peer_id:
            raise InitialPeersError.not_an_address(address)


def _no_initial_peer_answered(initial_peers) -> str:
    names = ", ".join(str(address) for address in initial_peers)
    return (
        f"none of the initial peers answered ({names}); check that they run, or use another: {InitialPeersError.HINT}"
    )


def ip_protocol(address: str) -> str:
    """The multiaddr protocol of an IP address: /ip4 or /ip6."""
    return "/ip6" if ":" in address else "/ip4"


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the kernel's pick)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def check_port_free(host: str, port: int, option: str) -> None:
    """Raise PortInUseError when a process listens on host:port (port 0 picks a free one and passes). p2pd listens
    with SO_REUSEPORT and so would share a taken port silently; a plain bind sees the listener."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT do not count
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"{option} {port}: port {port} on {host} is already in use (another nesa-node?); "
                    f"stop that process, pick another port, or {option} 0 for any free one"
                ) from None
            raise


# Run as `python -I -S -c EXEC_DYING_WITH_PARENT PROGRAM ARGS...`: asks the kernel for SIGKILL when the parent dies,
# then becomes PROGRAM (same pid). The setting survives exec. A separate interpreter rather than a preexec_fn: Python
# code in the forked child of a threaded process (clients run loops in threads) can deadlock or fail.
# argv: PARENT_PID PROGRAM ARGS...; a parent gone before the prctl took effect ends it at once. Python starts with
# SIGPIPE and SIGXFSZ ignored, which exec would hand on: PROGRAM gets the defaults back. A PROGRAM that cannot be run
# is one line on stderr, exit 127 (as a shell says it).
EXEC_DYING_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
for sig in (signal.SIGPIPE, signal.SIGXFSZ):
    signal.signal(sig, signal.SIG_DFL)
try:
    os.execv(sys.argv[2], sys.argv[2:])
except OSError as exc:
    print(f"cannot run {sys.argv[2]}: {exc}", file=sys.stderr, flush=True)
    os._exit(127)
"""


# Go's GC target for p2pd unless GOGC is set: at Go's default (100) a client's p2pd grew from 63 to 84 MB while 30
# nodes were killed and replaced over 3 minutes (and stayed there), at 25 it stayed at 64-65 MB: the daemon's heap
# goal, not what it holds, had grown (tests/swarm/test_churn.py, the long soak)
P2PD_GOGC = "25"


class _Subprocess:
    """asyncio.subprocess as hivemind's P2P sees it. p2pd gets a session and process group of its own, so the signal a
    terminal or a service manager sends to this process's group (Ctrl-C, `timeout`, systemd's KillMode) reaches this
    process alone and p2pd lives until this process stops it, after announcing `offline` (which needs p2pd). On Linux
    it is also killed by the kernel when the thread that spawned it dies, so a killed process leaves no p2pd behind.
    Its GC runs at P2PD_GOGC unless this process's environment sets GOGC."""

    def __getattr__(self, name: str):
        return getattr(asyncio.subprocess, name)

    @staticmethod
    async def create_subprocess_exec(program, *args, **kwargs):
        kwargs.setdefault("start_new_session", True)
        env = kwargs.get("env")
        if env is not None and "GOGC" not in env:
            kwargs["env"] = {**env, "GOGC": P2PD_GOGC}
        if sys.platform.startswith("linux") and sys.executable:
            if not os.access(program, os.X_OK):  # what hivemind reports, with its advice, when exec itself fails
                raise FileNotFoundError(errno.ENOENT, "no executable p2pd", program)
            wrapper = ("-I", "-S", "-c", EXEC_DYING_WITH_PARENT, str(os.getpid()))
            program, args = sys.executable, (*wrapper, program, *args)
        return await asyncio.subprocess.create_subprocess_exec(program, *args, **kwargs)


class _Asyncio:
    subprocess = _Subprocess()

    def __getattr__(self, name: str):
        return getattr(asyncio, name)


STREAM_BACKLOG = 4096  # streams p2pd may hand this process at once (asyncio's default of 100 drops a burst)


class _ControlAsyncio:
    """asyncio as hivemind's p2pd bindings see it: p2pd connects to this process's unix socket once per incoming
    stream, and a listen backlog of 100 made a burst of a few hundred opens (one peer or many) lose streams
    silently, their openers waiting forever; the kernel caps the backlog at net.core.somaxconn."""

    def __getattr__(self, name: str):
        return getattr(asyncio, name)

    @staticmethod
    async def start_unix_server(*args, **kwargs):
        kwargs.setdefault("backlog", STREAM_BACKLOG)
        return await asyncio.start_unix_server(*args, **kwargs)


# P2P.create has no hook for how p2pd is spawned; its module alone gets this view of asyncio
p2p_daemon.asyncio = _Asyncio()
p2pd_control.asyncio = _ControlAsyncio()
# every peer of this process decodes DHT traffic with bounded nesting (a deep payload would crash it)
msgpack_guard.install()
# and keeps the valid records of a DHT dictionary that also holds forged ones
install_subkey_filter()
# and bounds what other peers can make it store, per sender and in total
dht_storage.install()


async def _create_p2p(options: dict, attempts: int = 20) -> P2P:
    """P2P.create, which spawns p2pd. uvloop refuses to spawn a process while a loop in another thread of this process
    is spawning one ("Racing with another loop to spawn a process"), before anything is started: two clients made
    at once from two threads meet this. The spawn is tried again after a short, growing pause."""
    for attempt in range(attempts):
        try:
            return await P2P.create(**options)
        except RuntimeError as exc:
            if "Racing with another loop" not in str(exc) or attempt + 1 == attempts:
                raise
            await asyncio.sleep(0.01 * (attempt + 1))
    raise RuntimeError("unreachable")  # the loop returns or raises


def write_address_file(path: str | Path, addresses: list[str]) -> None:
    """Write one multiaddr per line, atomically: a reader never sees a half-written file."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text("".join(f"{address}\n" for address in addresses))
    tmp.replace(path)


__all__ = ["Peer", "check_initial_peers", "check_port_free", "start_peer", "write_address_file"]
