"""Data lanes: hidden states of an open session over direct TCP connections, encrypted and authenticated.

Through libp2p every message crosses two p2pd daemons (sender -> its p2pd -> the peer's p2pd -> receiver), which
costs about 0.3 ms per transfer on loopback, most of a decode step's network time. A lane is a plain TCP
connection that carries only the data frames of one session's link: steps from the client to the first node,
steps pushed from a node to the next, and outputs from the last node to the client. Everything else (opening the
session, keys, control, replay, errors) stays on the session's libp2p stream, which authenticates both ends.

Keys. At open the client draws a random 32-byte key per link of the session and gives each node, over that
node's libp2p stream, the key of the link into it and the key of the link out of it. Nobody else learns them.

Handshake of one connection (the connecting side "c", the accepting node "a"):

    c -> a   MAGIC(4) | role(1) | n(1) | session id (n bytes) | salt_c(16)
    a -> c   salt_a(16)
    both     k_c2a | k_a2c = HKDF-SHA256(link key, salt = salt_c | salt_a, info = INFO), 32 bytes each
    c -> a   sealed empty frame (proves c holds the link key; `a` registers nothing before it)
    a -> c   sealed empty frame (the connection is registered: frames may flow)

Frames: length(4, big-endian) | AES-256-GCM(key of the direction, nonce = frame counter (12 bytes, big-endian),
payload). Each direction has its own key and counter, and each connection fresh keys (both salts are new), so a
nonce never repeats under a key; a frame that was altered, replayed, reordered or dropped fails authentication
and ends the connection. A PING hello (no session) is answered with salt_a at once, for round-trip times. A PROVE
hello (no session) is answered with salt_a, the node's public key (DER) and its signature over PROOF_CONTEXT | salt_c
| salt_a: whoever measures round trips on a lane first checks that the lane is the peer's (a record may name any
address, such as a nearer host's lane, to look close), once per peer and address.

Cacheless forward calls (a batch through a node's span, client-relayed) use a FORWARD lane: the client asks the
node for a ticket over libp2p (`rpc_lane_ticket`: a ticket id and a fresh key), then sends requests on a lane
opened with the ticket id in place of a session id; the node answers each on the same lane. A LoRA training session
(server/training.py) runs on a TRAIN lane opened the same way: every frame its libp2p stream would carry.

Frame lengths are checked against the receiver's limit before a payload is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from nesa_node import step_trace
from nesa_node.errors import BadRequestError, MessageTooLargeError, PeerUnavailableError

MAGIC = b"NLN1"
INFO = b"nesa-node lane v1"
ROLE_SEND = 1  # c sends steps into the session; a answers only to refuse one
ROLE_RECEIVE = 2  # c (the client) receives the session's outputs from its last node
ROLE_PING = 3  # no session: a answers the hello at once
ROLE_FORWARD = 4  # cacheless forward calls (rpc_forward's requests and answers); the "session" is a ticket id
ROLE_TRAIN = 5  # one LoRA training session (the nesa.train stream's frames); the "session" is a ticket id
ROLE_PROVE = 6  # no session: a answers with its identity key's signature over both salts
ROLES = (ROLE_SEND, ROLE_RECEIVE, ROLE_PING, ROLE_FORWARD, ROLE_TRAIN, ROLE_PROVE)
PROOF_CONTEXT = b"nesa-node lane identity v1"
MAX_PROOF_PART_BYTES = 2048  # a DER public key or a signature in a PROVE answer (2048-bit RSA: ~300 and 256 bytes)
CONNECT_ROLES = (ROLE_SEND, ROLE_RECEIVE, ROLE_FORWARD, ROLE_TRAIN)
KEY_BYTES = 32
SALT_BYTES = 16
TAG_BYTES = 16
LENGTH_BYTES = 4
MAX_SESSION_ID_BYTES = 128
MAX_ADDRESS_LENGTH = 64  # "host:port", an IPv6 host included
CLIENT_MAX_FRAME_BYTES = 1 << 30  # outputs a client accepts per frame; tensor parsing bounds them again


class LaneClosedError(PeerUnavailableError):
    """The lane's connection ended or failed; whatever was in flight on it is lost."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def parse_key(value: object, name: str) -> bytes:
    """A link key as the client sends it in metadata (hex text); BadRequestError otherwise."""
    if not isinstance(value, str) or len(value) != 2 * KEY_BYTES:
        raise BadRequestError(f"lane key {name!r} must be {2 * KEY_BYTES} hex characters")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise BadRequestError(f"lane key {name!r} is not hex") from None


def parse_address(value: object) -> tuple[str, int]:
    """'host:port' (IPv6 hosts in brackets) -> (host, port); BadRequestError for anything else.

    The host must be an IP address: a lane address names the node's own interface, and resolving a name a peer
    sent would let it point our traffic anywhere DNS reaches."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ADDRESS_LENGTH:
        raise BadRequestError(f"a lane address is 'host:port' text of at most {MAX_ADDRESS_LENGTH} characters")
    host, sep, port_text = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(host)
        port = int(port_text)
    except ValueError:
        raise BadRequestError(f"lane address {value!r} is not 'ip:port'") from None
    if not sep or not 0 < port < 65536:
        raise BadRequestError(f"lane address {value!r} has no valid port")
    return host, port


def address_scope(host: str) -> int:
    """Where an IP address reaches: 0 this machine (loopback), 1 a private network (private, link-local, or a host
    listening on every interface), 2 the internet; -1 nowhere a lane can be (multicast, reserved, not an IP)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return -1
    if ip.is_unspecified:
        return 1
    if ip.is_multicast or ip.is_reserved:
        return -1
    if ip.is_loopback:
        return 0
    return 1 if ip.is_private or ip.is_link_local else 2


def may_dial(address: str, own_host: str) -> bool:
    """Whether a node whose own address is `own_host` dials the lane `address` a peer announced: only one that reaches
    no nearer than the node itself does. A node on the internet then dials no loopback or private address, nor one on
    a private network this machine's loopback: a hostile next node cannot make it connect to services inside its
    machine or network (and tell from the failures which ports are open)."""
    try:
        host, _ = parse_address(address)
    except BadRequestError:
        return False
    target = address_scope(host)
    return target >= 0 and target >= max(address_scope(own_host), 0)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ciphers(link_key: bytes, salt_c: bytes, salt_a: bytes) -> tuple[AESGCM, AESGCM]:
    okm = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=salt_c + salt_a, info=INFO).derive(link_key)
    return AESGCM(okm[:KEY_BYTES]), AESGCM(okm[KEY_BYTES:])


# a closed connection's unsent bytes wait this long for a peer that reads slowly, then the connection is aborted and
# they are dropped (guess: a peer that reads at all takes its last frames well within it)
CLOSE_FLUSH_S = 30.0


def close_writer(writer: asyncio.StreamWriter, flush_s: float = CLOSE_FLUSH_S) -> None:
    """Close `writer`: what it still buffers goes out while the peer reads, for up to `flush_s`, then the connection is
    aborted. asyncio keeps a closed transport that has unsent bytes (and its descriptor, and stops reading it) until
    they leave, so a peer that stops reading and never closes would hold it for ever."""
    writer.close()
    transport = writer.transport
    if transport.get_write_buffer_size():
        try:
            asyncio.get_running_loop().call_later(flush_s, transport.abort)
        except RuntimeError:  # no loop runs to flush them: drop them now
            transport.abort()


class SealedStream:
    """Frames sealed with AES-GCM over one TCP connection: `send` queues a frame, `receive` returns the next
    payload (None when the peer closed between frames). Any failure ends the connection."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        send_cipher: AESGCM,
        receive_cipher: AESGCM,
        max_frame_bytes: int,
    ):
        self.reader, self.writer = reader, writer
        self._send_cipher, self._receive_cipher = send_cipher, receive_cipher
        self._sent = self._received = 0
        self.max_frame_bytes = max_frame_bytes
        self.closed = False

    def send(self, payload: bytes) -> None:
        """Queue one frame (the transport writes it without waiting). Raises LaneClosedError once closed."""
        if self.closed or self.writer.is_closing():
            raise LaneClosedError("data lane is closed")
        sealed = self._send_cipher.encrypt(self._sent.to_bytes(12, "big"), payload, None)
        self._sent += 1
        self.writer.write(len(sealed).to_bytes(LENGTH_BYTES, "big") + sealed)
        step_trace.mark("send", len(sealed))

    async def receive(self) -> bytes | None:
        sealed = await self.read_sealed()
        if sealed is None:
            return None
        step_trace.mark("receive", len(sealed))
        payload = self.unseal(sealed)
        if payload is None:
            self.close()
            raise BadRequestError("lane frame failed authentication (altered, replayed or wrong key)")
        return payload

    async def read_sealed(self) -> bytes | None:
        """The next frame as sent, still sealed (None when the peer closed between frames)."""
        try:
            header = await self.reader.readexactly(LENGTH_BYTES)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                self.close()
                raise LaneClosedError("data lane closed mid-frame") from None
            self.close()
            return None
        except (ConnectionError, OSError) as exc:
            self.close()
            raise LaneClosedError(f"data lane failed: {exc!r}") from None
        length = int.from_bytes(header, "big")
        if not TAG_BYTES <= length <= self.max_frame_bytes + TAG_BYTES:
            self.close()
            raise MessageTooLargeError(
                f"lane frame of {length} bytes outside {TAG_BYTES}..{self.max_frame_bytes + TAG_BYTES}"
            )
        try:
            return await self.reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            self.close()
            raise LaneClosedError("data lane closed mid-frame") from None

    def unseal(self, sealed: bytes) -> bytes | None:
        """The payload of the next frame received; None when it fails authentication under this stream's key."""
        try:
            payload = self._receive_cipher.decrypt(self._received.to_bytes(12, "big"), sealed, None)
        except InvalidTag:
            return None
        self._received += 1
        return payload

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            self.close()
            raise LaneClosedError(f"data lane failed: {exc!r}") from None

    def close(self) -> None:
        """Close the connection; frames already sent still go out to a peer that reads (close_writer)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                close_writer(self.writer)

    def abort(self) -> None:
        """Close the connection at once, dropping what is still buffered for the peer (a peer that does not read)."""
        self.closed = True
        with contextlib.suppress(Exception):
            self.writer.transport.abort()


async def connect(
    address: str, role: int, session_id: str, link_key: bytes, *, max_frame_bytes: int = CLIENT_MAX_FRAME_BYTES
) -> SealedStream:
    """Open a lane to `address` for `session_id` (SEND or RECEIVE) and complete the handshake.

    Raises LaneClosedError when the node cannot be reached or refuses the connection (no such session, wrong key).
    Callers bound the time with their own timeout."""
    host, port = parse_address(address)
    sid = session_id.encode()
    if not 0 < len(sid) <= MAX_SESSION_ID_BYTES or role not in CONNECT_ROLES:
        raise ValueError("a lane needs a session id of 1..128 bytes and the SEND, RECEIVE, FORWARD or TRAIN role")
    reader, writer = await _dial(address, host, port)
    try:
        salt_c = os.urandom(SALT_BYTES)
        writer.write(MAGIC + bytes((role, len(sid))) + sid + salt_c)
        salt_a = await reader.readexactly(SALT_BYTES)
        to_node, from_node = _ciphers(link_key, salt_c, salt_a)
        stream = SealedStream(reader, writer, to_node, from_node, max_frame_bytes)
        stream.send(b"")
        if await stream.receive() != b"":
            raise LaneClosedError(f"lane {address} refused session {session_id[:32]!r}")
        return stream
    except (asyncio.IncompleteReadError, ConnectionError, OSError, BadRequestError) as exc:
        writer.close()
        raise LaneClosedError(f"lane {address} refused the connection: {exc!r}") from None
    except BaseException:
        writer.close()
        raise


@dataclass(frozen=True)
class PingTimes:
    """The two round trips of a lane ping, seconds. `connect_s`: the TCP connection's set-up, which the node's
    kernel answers before its program sees the connection, so the program cannot lengthen it (only control of the
    node's host can); `answer_s`: from the PING hello to its answer, through the node's program (its event loop
    included)."""

    connect_s: float
    answer_s: float


async def _dial(address: str, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to the lane at `address` (`host`, `port`); LaneClosedError when it cannot be made."""
    try:
        return await asyncio.open_connection(host, port)
    except OSError as exc:
        raise LaneClosedError(f"cannot reach lane {address}: {exc!r}") from None


async def probe(address: str) -> PingTimes:
    """Connect to the lane at `address` and ping it: both round trips (PingTimes). Raises LaneClosedError, also
    when the connection is made but the node's program does not answer."""
    host, port = parse_address(address)
    started = time.perf_counter()
    reader, writer = await _dial(address, host, port)
    connected = time.perf_counter()
    try:
        writer.write(MAGIC + bytes((ROLE_PING, 0)) + os.urandom(SALT_BYTES))
        await reader.readexactly(SALT_BYTES)
        return PingTimes(connect_s=connected - started, answer_s=time.perf_counter() - connected)
    except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
        raise LaneClosedError(f"lane {address} did not answer a ping: {exc!r}") from None
    finally:
        writer.close()


@dataclass(frozen=True)
class LaneProof:
    """What a lane answered a PROVE hello with: both salts, its public key (DER) and its signature over
    `signed_bytes`."""

    salt_c: bytes
    salt_a: bytes
    public_key: bytes
    signature: bytes

    @property
    def signed_bytes(self) -> bytes:
        return PROOF_CONTEXT + self.salt_c + self.salt_a


def proof_answer(salt_c: bytes, public_key: bytes, sign: Callable[[bytes], bytes]) -> bytes:
    """A node's answer to a PROVE hello with `salt_c`: salt_a | len | public key | len | signature (lengths 2 bytes,
    big-endian), `sign` signing PROOF_CONTEXT | salt_c | salt_a."""
    salt_a = os.urandom(SALT_BYTES)
    signature = sign(PROOF_CONTEXT + salt_c + salt_a)
    parts = [public_key, signature]
    return salt_a + b"".join(len(part).to_bytes(2, "big") + part for part in parts)


async def prove(address: str) -> LaneProof:
    """Ask the lane at `address` to sign fresh salts with its node's identity key (LaneProof; the caller checks the
    key's peer id and the signature). Raises LaneClosedError when it does not answer, BadRequestError for an answer
    that is malformed or over MAX_PROOF_PART_BYTES a part."""
    host, port = parse_address(address)
    reader, writer = await _dial(address, host, port)
    try:
        salt_c = os.urandom(SALT_BYTES)
        writer.write(MAGIC + bytes((ROLE_PROVE, 0)) + salt_c)
        salt_a = await reader.readexactly(SALT_BYTES)
        parts = []
        for _ in range(2):
            length = int.from_bytes(await reader.readexactly(2), "big")
            if not 0 < length <= MAX_PROOF_PART_BYTES:
                raise BadRequestError(f"lane {address} answered a proof part of {length} bytes")
            parts.append(await reader.readexactly(length))
        return LaneProof(salt_c, salt_a, parts[0], parts[1])
    except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
        raise LaneClosedError(f"lane {address} did not answer a proof: {exc!r}") from None
    finally:
        writer.close()


async def ping(address: str) -> float:
    """Seconds from a PING hello to its answer (TCP connection set-up excluded). Raises LaneClosedError."""
    return (await probe(address)).answer_s


async def read_hello(reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
    """The connecting side's hello: (role, session id, salt). BadRequestError for anything malformed."""
    try:
        head = await reader.readexactly(len(MAGIC) + 2)
        if head[: len(MAGIC)] != MAGIC:
            raise BadRequestError("not a nesa-node lane hello")
        role, length = head[len(MAGIC)], head[len(MAGIC) + 1]
        if role not in ROLES or length > MAX_SESSION_ID_BYTES or (role in (ROLE_PING, ROLE_PROVE)) != (length == 0):
            raise BadRequestError(f"lane hello with role {role} and a session id of {length} bytes")
        sid = await reader.readexactly(length)
        salt = await reader.readexactly(SALT_BYTES)
    except asyncio.IncompleteReadError:
        raise BadRequestError("lane hello cut short") from None
    try:
        session_id = sid.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequestError("lane session id is not ASCII") from None
    return role, session_id, salt


async def accept(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    role: int,
    salt_c: bytes,
    link_key: bytes,
    max_frame_bytes: int,
) -> SealedStream:
    """The accepting side of the handshake, after `read_hello` and the key lookup: send our salt, check the
    proof. The caller registers the stream, then calls `confirm`. BadRequestError when the proof fails."""
    stream, _ = await accept_any(reader, writer, role, salt_c, [link_key], max_frame_bytes)
    return stream


async def accept_any(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    role: int,
    salt_c: bytes,
    link_keys: Sequence[bytes],
    max_frame_bytes: int,
) -> tuple[SealedStream, int]:
    """`accept` when several keys may be the one the hello means (sessions of one id opened by different peers):
    the proof frame is checked under each, and the stream takes the key it opens under. Returns the stream and that
    key's index in `link_keys`. BadRequestError when it opens under none."""
    if not link_keys:
        raise ValueError("accept_any needs at least one key")
    salt_a = os.urandom(SALT_BYTES)
    writer.write(salt_a)
    streams = []
    for link_key in link_keys:
        from_peer, to_peer = _ciphers(link_key, salt_c, salt_a)
        streams.append(SealedStream(reader, writer, to_peer, from_peer, max_frame_bytes))
    streams[0].max_frame_bytes = 0  # the proof is an empty frame: nothing larger is read before a key opens it
    try:
        sealed = await streams[0].read_sealed()
    finally:
        streams[0].max_frame_bytes = max_frame_bytes
    for index, stream in enumerate(streams):
        if sealed is not None and stream.unseal(sealed) == b"":
            return stream, index
    streams[0].close()
    raise BadRequestError("lane handshake proof missing, or under no key of that session here")


def confirm(stream: SealedStream) -> None:
    stream.send(b"")


__all__ = [
    "CLIENT_MAX_FRAME_BYTES",
    "KEY_BYTES",
    "ROLE_FORWARD",
    "ROLE_PING",
    "ROLE_PROVE",
    "ROLE_RECEIVE",
    "ROLE_SEND",
    "ROLE_TRAIN",
    "LaneClosedError",
    "LaneProof",
    "PingTimes",
    "SealedStream",
    "accept",
    "accept_any",
    "confirm",
    "connect",
    "format_address",
    "new_key",
    "parse_address",
    "parse_key",
    "ping",
    "probe",
    "proof_answer",
    "prove",
    "read_hello",
]
