"""Data lanes (nesa_node.protocol.lane): handshake, sealed frames, and what a lane refuses, over real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nesa_node.errors import BadRequestError, MessageTooLargeError
from nesa_node.protocol import lane


class Acceptor:
    """A lane acceptor that knows one session's key (or the keys of several sessions of one id, `keys`) and records
    what arrives (frames, or the error that ended), and which key each connection proved."""

    def __init__(self, session_id: str, key: bytes, max_frame_bytes: int = 1 << 20):
        self.session_id, self.key, self.max_frame_bytes = session_id, key, max_frame_bytes
        self.keys = [key]
        self.chosen: list[int] = []  # per connection, the index in `keys` of the key it proved
        self.frames: list[bytes] = []
        self.errors: list[Exception] = []
        self.streams: list[lane.SealedStream] = []
        self.done = asyncio.Event()
        self.ping_delay_s = 0.0  # how late a PING hello is answered
        self.prove = lambda salt: b""  # the answer to a PROVE hello with `salt`

    async def handle(self, reader, writer) -> None:
        try:
            role, session_id, salt = await lane.read_hello(reader)
            if role == lane.ROLE_PING:
                await asyncio.sleep(self.ping_delay_s)
                writer.write(b"\0" * lane.SALT_BYTES)
                await writer.drain()
                return
            if role == lane.ROLE_PROVE:
                writer.write(self.prove(salt))
                await writer.drain()
                return
            if session_id != self.session_id:
                raise BadRequestError("unknown session")
            stream, chosen = await lane.accept_any(reader, writer, role, salt, self.keys, self.max_frame_bytes)
            self.chosen.append(chosen)
            self.streams.append(stream)
            lane.confirm(stream)
            while (payload := await stream.receive()) is not None:
                self.frames.append(payload)
                stream.send(b"echo:" + payload)
        except Exception as exc:
            self.errors.append(exc)
        finally:
            writer.close()
            self.done.set()


@contextlib.asynccontextmanager
async def serving(acceptor: Acceptor):
    server = await asyncio.start_server(acceptor.handle, "127.0.0.1", 0)
    try:
        yield lane.format_address("127.0.0.1", server.sockets[0].getsockname()[1])
    finally:
        server.close()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=20))


def test_frames_arrive_intact_both_ways_and_in_order():
    async def main():
        key = lane.new_key()
        acceptor = Acceptor("s1", key)
        async with serving(acceptor) as address:
            stream = await lane.connect(address, lane.ROLE_SEND, "s1", key)
            payloads = [b"", b"x", bytes(range(256)) * 40, b"last"]
            for payload in payloads:
                stream.send(payload)
            echoes = [await stream.receive() for _ in payloads]
            stream.close()
            await acceptor.done.wait()
        assert acceptor.frames == payloads
        assert echoes == [b"echo:" + payload for payload in payloads]
        assert acceptor.errors == []

    run(main())


def test_a_wrong_key_is_refused_at_the_handshake():
    async def main():
        acceptor = Acceptor("s1", lane.new_key())
        async with serving(acceptor) as address:
            with pytest.raises(lane.LaneClosedError):
                await lane.connect(address, lane.ROLE_SEND, "s1", lane.new_key())
            await acceptor.done.wait()
        assert acceptor.frames == []
        assert isinstance(acceptor.errors[0], BadRequestError)

    run(main())


def test_the_key_a_connection_proves_picks_among_sessions_of_one_id():
    """Several peers may hold sessions of one id on a node: the connection is the one whose key it holds, and a key of
    none of them is refused."""

    async def main():
        keys = [lane.new_key() for _ in range(3)]
        acceptor = Acceptor("s1", keys[0])
        acceptor.keys = keys
        async with serving(acceptor) as address:
            stream = await lane.connect(address, lane.ROLE_SEND, "s1", keys[1])
            stream.send(b"step")
            assert await stream.receive() == b"echo:step"
            stream.close()
            await acceptor.done.wait()
            acceptor.done.clear()
            with pytest.raises(lane.LaneClosedError):
                await lane.connect(address, lane.ROLE_SEND, "s1", lane.new_key())
            await acceptor.done.wait()
        assert acceptor.chosen == [1]
        assert acceptor.frames == [b"step"]
        assert isinstance(acceptor.errors[0], BadRequestError)

    run(main())


def test_an_unknown_session_is_refused():
    async def main():
        acceptor = Acceptor("s1", lane.new_key())
        async with serving(acceptor) as address:
            with pytest.raises(lane.LaneClosedError):
                await lane.connect(address, lane.ROLE_SEND, "other", acceptor.key)

    run(main())


def test_altered_and_replayed_frames_fail_authentication():
    async def main():
        key = lane.new_key()
        for attack in ("flip", "replay"):
            acceptor = Acceptor("s1", key)
            async with serving(acceptor) as address:
                stream = await lane.connect(address, lane.ROLE_SEND, "s1", key)
                stream.send(b"first step")
                assert await stream.receive() == b"echo:first step"
                # what an attacker on the path could do: alter a byte of the next frame, or send an earlier frame
                # again (sealing is deterministic, so these are the very bytes "first step" went out as: frame 1)
                if attack == "flip":
                    sealed = stream._send_cipher.encrypt(stream._sent.to_bytes(12, "big"), b"next step", None)
                    sealed = sealed[:-1] + bytes([sealed[-1] ^ 1])
                else:
                    sealed = stream._send_cipher.encrypt((1).to_bytes(12, "big"), b"first step", None)
                stream.writer.write(len(sealed).to_bytes(4, "big") + sealed)
                await acceptor.done.wait()
                stream.close()
            assert acceptor.frames == [b"first step"]
            assert isinstance(acceptor.errors[0], BadRequestError)
            assert "authentication" in acceptor.errors[0].message

    run(main())


def test_an_oversized_frame_is_refused_before_its_payload_is_read():
    async def main():
        key = lane.new_key()
        acceptor = Acceptor("s1", key, max_frame_bytes=1000)
        async with serving(acceptor) as address:
            stream = await lane.connect(address, lane.ROLE_SEND, "s1", key)
            stream.writer.write((1 << 31).to_bytes(4, "big"))  # a header claiming 2 GiB, and no payload
            await acceptor.done.wait()
            stream.close()
        assert isinstance(acceptor.errors[0], MessageTooLargeError)

    run(main())


def test_a_handshake_proof_longer_than_an_empty_frame_is_refused_unread():
    """Before a key opens it, a connection's proof may be no more than the empty frame it is: a header claiming a
    frame within the lane's limit (kilobytes, megabytes) is refused there, its bytes never waited for or held."""

    async def main():
        acceptor = Acceptor("s1", lane.new_key(), max_frame_bytes=1 << 20)
        async with serving(acceptor) as address:
            reader, writer = await asyncio.open_connection(*lane.parse_address(address))
            writer.write(lane.MAGIC + bytes((lane.ROLE_SEND, 2)) + b"s1" + b"\0" * lane.SALT_BYTES)
            await reader.readexactly(lane.SALT_BYTES)
            writer.write((1 << 19).to_bytes(4, "big"))  # half a MiB of proof announced, none sent
            await acceptor.done.wait()
            writer.close()
        assert isinstance(acceptor.errors[0], MessageTooLargeError)

    run(main())


def test_garbage_hello_is_refused():
    async def main():
        acceptor = Acceptor("s1", lane.new_key())
        async with serving(acceptor) as address:
            host, port = lane.parse_address(address)
            for garbage in (b"GET / HTTP/1.1\r\n\r\n", b"NLN1\x01\xff" + b"a" * 300, b"NLN1\x03\x05abcde" + b"s" * 16):
                acceptor.done.clear()
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(garbage)
                await acceptor.done.wait()
                assert await reader.read() == b""  # closed without an answer
                writer.close()
        assert len(acceptor.errors) == 3
        assert all(isinstance(error, BadRequestError) for error in acceptor.errors)

    run(main())


def test_ping_measures_a_round_trip():
    async def main():
        async with serving(Acceptor("s1", lane.new_key())) as address:
            seconds = await lane.ping(address)
        assert 0 < seconds < 5

    run(main())


def test_a_probe_times_the_connection_apart_from_the_answer():
    """A node that answers pings late lengthens their answers, not the TCP set-up its kernel answers (what a client
    subtracts from its steps' wall time: Swarm.step_rtt_ms)."""

    async def main():
        acceptor = Acceptor("s1", lane.new_key())
        acceptor.ping_delay_s = 0.2
        async with serving(acceptor) as address:
            times = await lane.probe(address)
            late = await lane.ping(address)
        return times, late

    times, late = run(main())
    assert times.answer_s >= 0.2 and late >= 0.2
    assert 0 < times.connect_s < 0.1


@given(st.text(max_size=80))
def test_parse_address_accepts_only_ip_and_port(text):
    try:
        host, port = lane.parse_address(text)
    except BadRequestError:
        return
    assert 0 < port < 65536
    assert lane.parse_address(lane.format_address(host, port)) == (host, port)


@pytest.mark.parametrize(
    "address, expected",
    [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9", ("::1", 9)), ("10.0.0.2:65535", ("10.0.0.2", 65535))],
)
def test_parse_address_examples(address, expected):
    assert lane.parse_address(address) == expected


@pytest.mark.parametrize("address", ["localhost:80", "example.com:1", "1.2.3.4", "1.2.3.4:0", "1.2.3.4:70000", 7, None])
def test_parse_address_refuses_names_and_bad_ports(address):
    with pytest.raises(BadRequestError):
        lane.parse_address(address)


@pytest.mark.parametrize("key", ["ab" * 31, "zz" * 32, 5, None, "ab" * 33])
def test_parse_key_refuses_malformed_keys(key):
    with pytest.raises(BadRequestError):
        lane.parse_key(key, "in")


def test_parse_key_round_trips():
    key = lane.new_key()
    assert lane.parse_key(key.hex(), "in") == key


@pytest.mark.parametrize("reads", [True, False], ids=["peer-reads", "peer-never-reads"])
def test_a_closed_connection_flushes_to_a_reading_peer_and_is_aborted_for_one_that_never_reads(reads):
    """close_writer: bytes still buffered when a connection is closed reach a peer that reads them; for a peer that
    neither reads nor closes, the connection is aborted after the flush time (asyncio would keep it, unread and
    with its descriptor, for ever)."""
    size = 16 << 20  # far over what the kernel's socket buffers take at once
    flush_s = 1.0

    async def run() -> tuple[int, bool]:
        closed = asyncio.Event()
        transports = []

        async def handle(reader, writer) -> None:
            transports.append(writer.transport)
            writer.write(b"x" * size)
            lane.close_writer(writer, flush_s=flush_s)
            closed.set()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await closed.wait()
            transport = transports[0]
            assert transport.is_closing() and transport.get_write_buffer_size() > 0  # the bytes wait for the peer
            received = 0
            if reads:
                with contextlib.suppress(ConnectionError):
                    while chunk := await reader.read(1 << 20):
                        received += len(chunk)
            else:
                await asyncio.sleep(flush_s * 3)  # reads nothing, closes nothing
            # the transport let go of its socket: flushed and closed, or aborted
            return received, transport.get_extra_info("socket").fileno() == -1
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    received, released = asyncio.run(run())
    assert released
    assert received == (size if reads else 0)


def test_a_lane_proves_whose_it_is_with_its_nodes_identity_key_over_fresh_salts():
    from hivemind.utils.crypto import RSAPrivateKey

    from nesa_node.errors import ReceiptError
    from nesa_node.verification.receipts import RecordSigner, signer_of

    node, other = RecordSigner(RSAPrivateKey()), RecordSigner(RSAPrivateKey())
    acceptor = Acceptor("s1", lane.new_key())
    answers: list[bytes] = []

    def honest(salt: bytes) -> bytes:
        answers.append(lane.proof_answer(salt, node.public_key, node.sign_bytes))
        return answers[-1]

    async def run():
        async with serving(acceptor) as address:
            acceptor.prove = honest
            proof = await lane.prove(address)
            assert signer_of(proof.signed_bytes, proof.signature, proof.public_key) == node.peer_id != other.peer_id
            acceptor.prove = lambda salt: answers[0]  # an answer recorded earlier: signed over another salt
            replayed = await lane.prove(address)
            with pytest.raises(ReceiptError, match="signature does not match"):
                signer_of(replayed.signed_bytes, replayed.signature, replayed.public_key)
            acceptor.prove = lambda salt: lane.proof_answer(salt, node.public_key, other.sign_bytes)  # another key
            with pytest.raises(ReceiptError):
                mixed = await lane.prove(address)
                signer_of(mixed.signed_bytes, mixed.signature, mixed.public_key)
            acceptor.prove = lambda salt: b"\0" * lane.SALT_BYTES + (5000).to_bytes(2, "big")
            with pytest.raises(BadRequestError, match="proof part of 5000 bytes"):
                await lane.prove(address)
            acceptor.prove = lambda salt: b"\0" * lane.SALT_BYTES  # cut short
            with pytest.raises(lane.LaneClosedError):
                await lane.prove(address)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("address", "own", "dialed"),
    [
        ("127.0.0.1:7000", "127.0.0.1", True),  # a swarm on one machine
        ("10.0.0.5:7000", "127.0.0.1", True),
        ("93.184.216.34:7000", "127.0.0.1", True),
        ("127.0.0.1:6379", "10.0.0.4", False),  # a node on a private network: not into its own machine
        ("[::1]:6379", "0.0.0.0", False),  # listening on every interface: a network's, not the machine's
        ("192.168.1.20:7000", "10.0.0.4", True),
        ("[fe80::1]:7000", "10.0.0.4", True),
        ("93.184.216.34:7000", "10.0.0.4", True),
        ("10.0.0.5:7000", "1.1.1.1", False),  # a node on the internet: nothing inside a network
        ("127.0.0.1:22", "1.1.1.1", False),
        ("[fd00::7]:7000", "1.1.1.1", False),
        ("[2606:4700::1]:7000", "1.1.1.1", True),
        ("224.0.0.1:7000", "127.0.0.1", False),  # multicast: never a lane
        ("not-an-address", "127.0.0.1", False),
        ("93.184.216.34:7000", "node.example", True),  # its own host not an IP: no scope known, none narrowed
    ],
)
def test_a_node_dials_no_lane_nearer_than_its_own_address(address, own, dialed):
    assert lane.may_dial(address, own) is dialed


@given(st.ip_addresses(), st.integers(1, 65535), st.ip_addresses(), st.ip_addresses())
def test_a_node_nearer_in_dials_whatever_a_node_further_out_dials(target, port, own, other):
    """Monotone in the node's own scope: what a node on the internet dials, one on a private network dials too, and
    one on loopback dials every lane address there can be."""
    address = lane.format_address(str(target), port)
    inner, outer = sorted((str(own), str(other)), key=lane.address_scope)
    if lane.may_dial(address, outer):
        assert lane.may_dial(address, inner)
    assert lane.may_dial(address, "127.0.0.1") is (lane.address_scope(str(target)) >= 0)
