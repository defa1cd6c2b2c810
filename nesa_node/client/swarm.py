"""The client's view of the swarm, async: one P2P host and client-mode DHT node shared by every session of a client,
the nodes' records, bans (client/bans.py), round trips (client/round_trips.py), and the unary calls (info, forward).

Every method runs on the event loop that created the Swarm (`await Swarm.create(...)`); every await on a peer has a
timeout. Many sessions may use one Swarm at once.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import math
import time

import torch
from hivemind.p2p import PeerID
from hivemind.proto.runtime_pb2 import Tensor
from hivemind.utils import get_dht_time

from nesa_node.client.bans import Bans
from nesa_node.client.round_trips import RoundTripMeter
from nesa_node.client.stability import StabilityTracker
from nesa_node.client.timings import NodeTimings
from nesa_node.compression.codec import all_finite
from nesa_node.errors import BadRequestError, NesaError, PeerUnavailableError, QuotaExceededError
from nesa_node.peer import Peer, start_peer
from nesa_node.protocol import lane, rpc
from nesa_node.protocol.channel import Frame, LaneChannel, frame, read
from nesa_node.protocol.dht import NodeRecord, fetch_node_infos
from nesa_node.protocol.framing import call_on_stream
from nesa_node.protocol.messages import (
    FORWARD_ANSWERS,
    INFO_ANSWERS,
    MAX_INFO_BYTES,
    MAX_METADATA_BYTES,
    TICKET_ANSWERS,
    ErrorReply,
    ForwardRequest,
    ForwardResult,
    InfoReply,
    LaneTicket,
    expect,
)
from nesa_node.protocol.records import NodeInfo, bandwidth_from_pings
from nesa_node.protocol.tensors import NO_CODEC, WireCodec, tensor_from_proto, tensor_to_proto
from nesa_node.routing.chain import Hop, SwarmSnapshot
from nesa_node.swarm_view import build_snapshot

logger = logging.getLogger(__name__)

# A NodeInfo a node gave the client directly (probe_nodes) counts as its record for this long: about one announce
# period of a default node plus margin (guess); the DHT's own records take over when they arrive.
PROBED_RECORD_TTL_S = 15.0
# Nodes whose records expired less than this long ago are still asked directly when routing finds no chain (guess:
# a few announcement lifetimes; a node gone longer is unlikely to be back under the same id).
RECENT_RECORD_S = 120.0
# routing's direct asks (probe_nodes): identities cost nothing, so records of many made-up nodes must not make one
# route open a connection to each; the freshest records first (guesses: a span rarely has more live nodes)
MAX_PROBED_NODES = 64
PROBES_AT_ONCE = 16
FORGET_RECORD_S = 3600.0  # records expired this long ago are dropped (see `hold`)
FORWARD_ATTEMPTS = (
    5  # a forward refused by a node busy with its most (server/rpc.py), asked again after 0.2 s, 0.4 s...
)
FORWARD_RETRY_S = 0.2
ANSWER_DTYPES = ("float32", "float16", "bfloat16")  # the dtypes a node computes in (sharding/blocks.py DTYPES)
BANDWIDTH_PAYLOAD_BYTES = 256 * 1024  # as the nodes' link probe: dominates a LAN round trip, short on a slow uplink
BANDWIDTH_MAX_AGE_S = 600.0  # a link's bandwidth is measured again after this long (guess)
FORWARD_HEADROOM_BYTES = MAX_METADATA_BYTES + 4096  # a forward answer's message and protobuf framing


def check_answer(message, model):
    """A node's answer as `model`; its ErrorReply raised as the typed error it names."""
    if isinstance(message, ErrorReply):
        raise message.error()
    return expect(message, model)


def _log_failed_read(read: asyncio.Future) -> None:
    """A background DHT read that failed: the records at hand stay; the next call that must wait reads again."""
    if not read.cancelled() and read.exception() is not None:
        logger.debug("background DHT read failed: %r", read.exception())


# a session's every step asks for its link's bandwidth (its codec), which reads the node's lane address: parsed once
# per address, not once a step (a few addresses repeat; at most this many kept, whatever records peers send)
ADDRESSES_KEPT = 4096


@functools.lru_cache(maxsize=ADDRESSES_KEPT)
def _lane_host(address: str) -> str | None:
    """The host of a lane address, None when the address is malformed (protocol/lane.py `parse_address`)."""
    try:
        return lane.parse_address(address)[0]
    except BadRequestError:
        return None


def _multiaddr_host(address: str) -> str | None:
    """The IP address of a multiaddr such as /ip4/127.0.0.1/tcp/4001 (None for any other kind: dns, a relay)."""
    parts = address.split("/")
    return parts[2] if len(parts) > 2 and parts[0] == "" and parts[1] in ("ip4", "ip6") else None


@functools.lru_cache(maxsize=ADDRESSES_KEPT)
def _loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Swarm(Bans, RoundTripMeter):
    """Owns the client's P2P host and DHT node. `await close()` (or `async with`) stops them."""

    def __init__(
        self,
        peer: Peer,
        *,
        dht_prefix: str,
        request_timeout_s: float = 30.0,
        records_wait_s: float = 0.5,
        records_fresh_s: float = 1.0,
        records_stale_s: float = 10.0,
    ):
        self.peer = peer
        self.p2p, self.dht = peer.p2p, peer.dht
        self.dht_prefix = dht_prefix
        self.request_timeout_s = request_timeout_s
        self.records_wait_s = records_wait_s
        # a read completed this recently serves non-fresh calls as it is; one up to records_stale_s old serves them
        # too while a new read runs in the background (node_records)
        self.records_fresh_s = records_fresh_s
        self.records_stale_s = max(records_stale_s, records_fresh_s)
        self._refreshed_at = -math.inf  # monotonic s the last DHT read completed
        self.use_lanes = True  # FORWARD lanes for forward calls (ClientConfig.lanes)
        self._records: dict[str, NodeRecord] = {}  # peer id -> newest record seen (expired ones are skipped)
        self._refresh: asyncio.Future | None = None  # the DHT read in flight
        Bans.__init__(self)
        RoundTripMeter.__init__(self)
        # a FORWARD data lane per node, kept open between forward calls (protocol/lane.py), one call at a time
        self._forward_lanes: dict[str, LaneChannel] = {}
        self._forward_locks: dict[str, asyncio.Lock] = {}
        # what routing trusts over the nodes' claims (routing/claims.py): the client's own measurements
        self.timings = NodeTimings()  # each node's compute time, from the steps of this client's sessions
        self.believed_block_ms: dict[str, float] = {}  # per node, what the last snapshot costed (ms/block/token)
        self._first_seen: dict[str, float] = {}  # peer id -> monotonic s its first record reached this client
        self.open_sessions: set = set()  # this client's open inference sessions (their nodes count as loaded)
        self._bandwidth: dict[str, float] = {}  # peer id -> Mbit/s from this client ("auto" codec choice)
        self._bandwidth_measured: dict[str, float] = {}  # peer id -> monotonic s of the last measurement started
        self._local: set[str] = set()  # peer ids the libp2p daemon reaches on a loopback address only (no lane)
        self._background: set[asyncio.Task] = set()
        # peer id -> factor on eq. 18's reliability term: nodes an audit caught cheating (`blame`)
        self.distrust: dict[str, float] = {}
        # stability of the nodes over this client's recent snapshots, raising R_A of stable ones (sec. 3.1)
        self.stability = StabilityTracker()

    @classmethod
    async def create(
        cls,
        initial_peers: list[str] | tuple[str, ...],
        *,
        dht_prefix: str,
        request_timeout_s: float = 30.0,
        records_wait_s: float = 0.5,
        records_fresh_s: float = 1.0,
        records_stale_s: float = 10.0,
        start_timeout_s: float = 60.0,
    ) -> Swarm:
        """Start the client's P2P host and DHT node. ValueError without initial peers; PeerUnavailableError when the
        swarm cannot be joined within `start_timeout_s`."""
        if not initial_peers:
            raise ValueError("initial_peers is empty: give the multiaddr of at least one swarm peer")
        try:
            async with asyncio.timeout(start_timeout_s):
                peer = await start_peer(
                    initial_peers=tuple(initial_peers), host=None, dht_prefixes=(dht_prefix,), client_mode=True
                )
        except TimeoutError:
            raise PeerUnavailableError(f"could not join the swarm within {start_timeout_s} s") from None
        return cls(
            peer,
            dht_prefix=dht_prefix,
            request_timeout_s=request_timeout_s,
            records_wait_s=records_wait_s,
            records_fresh_s=records_fresh_s,
            records_stale_s=records_stale_s,
        )

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    async def close(self) -> None:
        for channel in self._forward_lanes.values():
            channel.close()
        self._forward_lanes.clear()
        if self._refresh is not None:
            self._refresh.cancel()
        for task in list(self._background):
            task.cancel()
        await self.peer.shutdown(10.0)

    async def __aenter__(self) -> Swarm:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # ---- bans ------------------------------------------------------------------------------------------------------

    def blame(self, peer_id: str, *, ban_s: float = 3600.0) -> None:
        """A node caught computing something else than it committed to (client/audit.py): banned for `ban_s`, and
        its reliability in routing quartered for as long as this client runs."""
        self.ban(peer_id, base_s=ban_s, max_s=ban_s, fault=True)
        self.distrust[peer_id] = self.distrust.get(peer_id, 1.0) * 0.25

    # ---- records -----------------------------------------------------------------------------------------------------

    async def node_records(self, fresh: bool = False, *, max_age_s: float | None = None) -> list[NodeRecord]:
        """The nodes' records: a fresh DHT read merged with earlier reads whose records have not expired yet.

        A DHT lookup can miss replicas now and then; a record stays valid until its own expiration, so a
        momentarily empty answer does not make live nodes vanish from routing. While unexpired records are at
        hand, a read slower than `records_wait_s` (a DHT peer that stopped answering costs hivemind 3 s) is not
        waited for: routing uses the records at hand and the read lands in them when it completes.
        `fresh=True` waits for the read in any case (routing found no chain in the records at hand). Otherwise the
        records of a read completed less than `records_stale_s` ago serve as they are, and a read starts in the
        background once they are `records_fresh_s` old (`refresh_soon`, also called as a session closes, a moment no
        first token waits for): opening a session reads the
        records twice, and each read costs a DHT lookup and a signature check per record (12-20 ms measured on
        loopback, a third of a small model's first token), which would otherwise fall on every first token. Nodes
        announce every 10 s by default; one gone since the read is caught by the ping before a session opens on
        it, or by failover. `max_age_s` replaces `records_stale_s` for this call (0: read, as a page showing the
        swarm live does)."""
        held = self._unexpired()
        stale_s = self.records_stale_s if max_age_s is None else max_age_s
        if not fresh and held and time.monotonic() - self._refreshed_at < stale_s:
            self.refresh_soon()  # for the next call, in the background
            return list(held.values())
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._refresh_records())
        held = self._unexpired()
        try:
            wait_s = self.records_wait_s if held and not fresh else self.request_timeout_s
            await asyncio.wait_for(asyncio.shield(self._refresh), timeout=wait_s)
        except TimeoutError:
            if not held:
                raise PeerUnavailableError(f"no answer from the DHT within {self.request_timeout_s} s") from None
        except Exception as exc:
            if not held:
                raise
            logger.debug("DHT read failed, routing with the records at hand: %r", exc)
        return list(self._unexpired().values())

    def refresh_soon(self) -> None:
        """Read the records again in the background if the last read is `records_fresh_s` old or more (and none is
        running): at a moment no first token waits for, such as the end of a session."""
        if time.monotonic() - self._refreshed_at < self.records_fresh_s:
            return
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._refresh_records())
            self._refresh.add_done_callback(_log_failed_read)

    async def _refresh_records(self) -> None:
        self.hold(await fetch_node_infos(self.dht, self.dht_prefix))
        self._refreshed_at = time.monotonic()

    def _unexpired(self) -> dict[str, NodeRecord]:
        now = get_dht_time()
        return {peer: record for peer, record in self._records.items() if record.expiration_time > now}

    def hold(self, records: list[NodeRecord]) -> None:
        """Merge `records` into the records at hand: per node, the one that expires last. Records expired more than
        FORGET_RECORD_S ago are dropped, with when their nodes were first seen: identities that come and go do not
        grow a long-running client (a session with a node that stopped announcing is older than that only rarely)."""
        horizon = get_dht_time() - FORGET_RECORD_S
        held = {peer: record for peer, record in self._records.items() if record.expiration_time > horizon}
        now = time.monotonic()
        for record in records:
            self._first_seen.setdefault(record.info.peer_id, now)
            known = held.get(record.info.peer_id)
            if known is None or record.expiration_time >= known.expiration_time:
                held[record.info.peer_id] = record
        self._records = held
        if len(self._first_seen) > len(held):
            self._first_seen = {peer: seen for peer, seen in self._first_seen.items() if peer in held}

    def records_at_hand(self) -> list[NodeRecord]:
        """The unexpired records this client holds now (no DHT read)."""
        return list(self._unexpired().values())

    def recent_nodes(self, start_block: int, end_block: int, *, within_s: float = RECENT_RECORD_S) -> list[str]:
        """Peer ids of the nodes whose records, seen by this client, overlap blocks [start_block, end_block) and
        expired less than `within_s` ago or not yet, the latest to expire first: the candidates to ask directly
        (see probe_nodes)."""
        horizon = get_dht_time() - within_s
        recent = [
            (record.expiration_time, peer)
            for peer, record in self._records.items()
            if record.expiration_time > horizon
            and record.info.start_block < end_block
            and record.info.end_block > start_block
        ]
        return [peer for _, peer in sorted(recent, key=lambda item: (-item[0], item[1]))]

    async def probe_nodes(self, peer_ids: list[str], *, timeout_s: float = 1.0) -> int:
        """Ask nodes for their NodeInfo directly (over libp2p, whose connection authenticates the peer id) and hold
        each answer as a record for PROBED_RECORD_TTL_S; returns how many answered.

        Routing's fallback when the DHT replicas it reads lack a live node's record: a node whose announcements did
        not reach them, or a read slowed by a replica that stopped answering. The first MAX_PROBED_NODES of
        `peer_ids` are asked, PROBES_AT_ONCE at a time; a dead one costs at most `timeout_s`."""
        turns = asyncio.Semaphore(PROBES_AT_ONCE)

        async def ask(peer_id: str) -> NodeRecord | None:
            try:
                async with turns:
                    info = await self.info(peer_id, timeout_s=timeout_s)
            except Exception as exc:  # gone, slow or malformed: not a candidate
                logger.debug("no NodeInfo from %s: %r", peer_id, exc)
                return None
            if info.peer_id != peer_id:
                logger.debug("node %s answered with the NodeInfo of %s", peer_id, info.peer_id)
                return None
            return NodeRecord(info=info, expiration_time=get_dht_time() + PROBED_RECORD_TTL_S)

        asked = peer_ids[:MAX_PROBED_NODES]
        answers = [record for record in await asyncio.gather(*(ask(peer) for peer in asked)) if record is not None]
        self.hold(answers)
        return len(answers)

    def span_of(self, peer_id: str) -> tuple[int, int] | None:
        """The blocks [start, end) the node's record at hand announces; None without a record."""
        record = self._records.get(peer_id)
        return None if record is None else (record.info.start_block, record.info.end_block)

    def holds_adapter(self, peer_id: str, adapter_id: str) -> bool:
        """Whether the node's record at hand announces the LoRA adapter `adapter_id`."""
        record = self._records.get(peer_id)
        return record is not None and any(info.adapter_id == adapter_id for info in record.info.adapters)

    def announced(self, peer_id: str) -> NodeInfo | None:
        """What node `peer_id`'s record at hand announces (None without one)."""
        record = self._records.get(peer_id)
        return record.info if record is not None else None

    def answer_dtypes(self, peer_id: str) -> tuple[str, ...]:
        """The dtypes hidden states from node `peer_id` may arrive in: exactly the one its record announces, since a
        node runs its blocks in that dtype and sends their outputs in it whatever the codec (a codec keeps the
        tensor's dtype); none when the record names a dtype no node computes in; any of ANSWER_DTYPES only without a
        record at hand."""
        record = self._records.get(peer_id)
        if record is None:
            return ANSWER_DTYPES
        return (record.info.dtype,) if record.info.dtype in ANSWER_DTYPES else ()

    def answer_bits(self, peer_id: str) -> int:
        """Bits of each value node `peer_id` sends its outputs in (its record's dtype; 32 when not known): what a
        lossless message from it costs on the wire."""
        dtypes = self.answer_dtypes(peer_id)
        return 16 if len(dtypes) == 1 and dtypes[0] in ("bfloat16", "float16") else 32

    def lane_address(self, peer_id: str) -> str | None:
        """The data lane address a node's record announces (protocol/lane.py), if any and well formed."""
        record = self._records.get(peer_id)
        address = record.info.lane if record is not None else None
        if address is None:
            return None
        if _lane_host(address) is None:
            logger.debug("ignoring the malformed lane address of %s", peer_id)
            return None
        return address

    async def snapshot(self, num_blocks: int, *, fresh: bool = False, hidden_size: int = 0) -> SwarmSnapshot:
        """Freeze the current records, with the client's measured rtts, for routing (swarm_view.py); `fresh`: see
        node_records."""
        infos = [record.info for record in await self.node_records(fresh)]
        return self.snapshot_of(infos, num_blocks, hidden_size=hidden_size)

    def snapshot_of(self, infos: list[NodeInfo], num_blocks: int, *, hidden_size: int = 0) -> SwarmSnapshot:
        """The routing snapshot of records already read, with what this client measured itself."""
        now = time.monotonic()
        snapshot = build_snapshot(
            infos,
            num_blocks,
            client_rtt_ms=dict(self.rtt_ms),
            hidden_size=hidden_size,
            measured=self.timings.measured(),
            seen_s={peer: now - seen for peer, seen in self._first_seen.items()},
            own_sessions=self.sessions_per_node(),
            distrust=self.distrust,
        )
        self.stability.observe(snapshot, now)
        snapshot = self.stability.apply(snapshot)
        for node in snapshot.nodes:
            blocks = node.end_block - node.start_block
            if node.inference_tps > 0 and blocks > 0:
                self.believed_block_ms[node.peer_id] = 1000.0 / (node.inference_tps * blocks)
        return snapshot

    def sessions_per_node(self) -> dict[str, int]:
        """How many of this client's open sessions use each node."""
        counts: dict[str, int] = {}
        for session in self.open_sessions:
            for peer_id in session.chain.peer_ids:
                counts[peer_id] = counts.get(peer_id, 0) + 1
        return counts

    # ---- bandwidth ---------------------------------------------------------------------------------------------------

    def bandwidth_mbps(self, sender: str, receiver: str | None) -> float | None:
        """The bandwidth known between node `sender` and `receiver` (None: this client), Mbit/s, or None: the
        client's own measurement for its links; for two nodes, the smaller of the figures their records publish.
        A node on this machine (its lane on a loopback address, or without a lane every libp2p connection to it on
        one) is reached without a network link at all: inf (a measurement there times the two processes' CPU,
        which a busy host makes look like a slow link)."""
        if receiver is None:
            if self._on_this_host(sender):
                return math.inf
            return self._bandwidth.get(sender)
        if self._on_this_host(sender) and self._on_this_host(receiver):
            return math.inf
        figures = [
            link.bandwidth_mbps
            for node, other in ((sender, receiver), (receiver, sender))
            if (record := self._records.get(node)) is not None
            for link in record.info.links
            if link.peer_id == other and link.bandwidth_mbps
        ]
        return min(figures) if figures else None

    def _on_this_host(self, peer_id: str) -> bool:
        if peer_id in self._local:
            return True
        address = self.lane_address(peer_id)
        return address is not None and _loopback(_lane_host(address))

    async def _reached_on_loopback(self, peer_id: str) -> bool:
        """Whether every connection the libp2p daemon holds to `peer_id` is to a loopback address (a node on this
        machine; a peer cannot make a connection to it look so)."""
        try:
            peers = await self.p2p.list_peers()
        except Exception:  # the daemon is going away: not known
            return False
        addresses = [str(address) for info in peers if info.peer_id.to_base58() == peer_id for address in info.addrs]
        return bool(addresses) and all(_loopback(_multiaddr_host(address)) for address in addresses)

    def measure_bandwidths_soon(self, peer_ids: list[str]) -> None:
        """Measure the client's bandwidth to each of `peer_ids` not measured in the last BANDWIDTH_MAX_AGE_S, in
        the background (a ping carrying BANDWIDTH_PAYLOAD_BYTES; the first session on a link goes lossless)."""
        now = time.monotonic()
        for peer_id in dict.fromkeys(peer_ids):
            if now - self._bandwidth_measured.get(peer_id, -math.inf) < BANDWIDTH_MAX_AGE_S:
                continue
            self._bandwidth_measured[peer_id] = now
            task = asyncio.ensure_future(self._measure_bandwidth(peer_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _measure_bandwidth(self, peer_id: str) -> None:
        payload = Frame(tensors=[Tensor(buffer=bytes(BANDWIDTH_PAYLOAD_BYTES))])
        try:
            rtt_s = min([await self._timed_unary(peer_id, Frame()) for _ in range(2)])
            if await self._reached_on_loopback(peer_id):  # connected now: no network link to measure
                self._local.add(peer_id)
                return
            loaded_s = await self._timed_unary(peer_id, payload)
        except Exception as exc:  # gone or slow: the link stays unknown (lossless)
            logger.debug("no bandwidth to %s: %r", peer_id, exc)
            return
        # each figure is a lower bound (a busy moment only makes a link look slower): keep the best seen
        measured = bandwidth_from_pings(BANDWIDTH_PAYLOAD_BYTES, rtt_s, loaded_s)
        self._bandwidth[peer_id] = max(measured, self._bandwidth.get(peer_id, 0.0))

    async def _timed_unary(self, peer_id: str, request: Frame) -> float:
        started = time.perf_counter()
        await self.unary(peer_id, rpc.PING, request, 5.0)
        return time.perf_counter() - started

    # ---- calls -------------------------------------------------------------------------------------------------------

    async def unary(self, peer_id: str, name: str, request: Frame, timeout_s: float | None = None) -> Frame:
        """One unary RPC; PeerUnavailableError when the peer does not answer within the timeout."""
        try:
            return await asyncio.wait_for(
                self.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), name, request, Frame),
                timeout=timeout_s or self.request_timeout_s,
            )
        except Exception as exc:
            logger.debug("%s to %s failed: %r", name, peer_id, exc)
            raise PeerUnavailableError(f"peer {peer_id} did not answer {name}: {exc!r}") from None

    async def info(self, peer_id: str, *, timeout_s: float | None = None) -> NodeInfo:
        """The live NodeInfo of a peer, asked directly (not from the DHT); PeerUnavailableError after timeout_s,
        BadRequestError for an answer that holds no valid record."""
        answer = await self.unary(peer_id, rpc.INFO, Frame(), timeout_s)
        reply = check_answer(read(answer, INFO_ANSWERS, max_bytes=MAX_INFO_BYTES), InfoReply)
        return reply.node_info()

    async def forward(
        self, hop: Hop, hidden: torch.Tensor, codec: WireCodec = NO_CODEC, output_codec: WireCodec = NO_CODEC
    ) -> tuple[torch.Tensor, float]:
        """Run a node's span on `hidden` (batch, seq, hidden) without a cache; returns (output, compute seconds). A
        node running its most forwards at once (QuotaExceededError) is asked again after a short wait, a few times."""
        attempt = 0
        while True:
            try:
                return await self._forward_once(hop, hidden, codec, output_codec)
            except QuotaExceededError:
                attempt += 1
                if attempt == FORWARD_ATTEMPTS:
                    raise
                await asyncio.sleep(FORWARD_RETRY_S * 2 ** (attempt - 1))

    async def _forward_once(
        self, hop: Hop, hidden: torch.Tensor, codec: WireCodec, output_codec: WireCodec
    ) -> tuple[torch.Tensor, float]:
        peer_id = hop.peer_id
        message = ForwardRequest(
            start_block=hop.start_block, end_block=hop.end_block, codec=codec, output_codec=output_codec
        )
        request = frame(message, [tensor_to_proto(hidden, codec)])
        answer_bytes = hidden.numel() * 4 + FORWARD_HEADROOM_BYTES  # the longest honest answer: float32 or less
        async with self._forward_locks.setdefault(peer_id, asyncio.Lock()):
            channel = await self._forward_lane(peer_id)
            if channel is not None:
                channel.max_frame_bytes = answer_bytes
                answer = await self._forward_on_lane(peer_id, channel, request)
            elif max(request.ByteSize() + FORWARD_HEADROOM_BYTES, answer_bytes) > rpc.MAX_UNARY_BYTES:
                answer = await call_on_stream(
                    self.p2p,
                    peer_id,
                    rpc.FORWARD_STREAM,
                    request,
                    max_answer_bytes=answer_bytes,
                    timeout_s=self.request_timeout_s,
                )
            else:
                answer = await self.unary(peer_id, rpc.FORWARD, request)
        result = check_answer(read(answer, FORWARD_ANSWERS), ForwardResult)
        try:
            if len(answer.tensors) != 1:
                raise BadRequestError("not one tensor")
            output = tensor_from_proto(
                answer.tensors[0],
                allowed_dtypes=self.answer_dtypes(peer_id),
                max_elements=hidden.numel(),
                rank=3,
                codec=result.codec,
            )
            if output.shape != hidden.shape:
                raise BadRequestError(f"hidden states of shape {tuple(output.shape)} for {tuple(hidden.shape)}")
            if not all_finite(output):
                raise BadRequestError("hidden states with NaN or infinite values")
        except BadRequestError as exc:  # the node's answer, not the caller's request, is wrong: it is banned for it
            self.ban(peer_id, fault=True)
            raise PeerUnavailableError(f"peer {peer_id} sent a malformed answer to a forward: {exc.message}") from None
        return output, result.compute_s

    async def _forward_lane(self, peer_id: str) -> LaneChannel | None:
        """The open FORWARD lane to a node, opened now if needed (a ticket over libp2p, then the lane); None when
        lanes are off, the node has no lane or it cannot be opened: the call then goes over libp2p."""
        held = self._forward_lanes.get(peer_id)
        if held is not None and not held.closed:
            return held
        address = self.lane_address(peer_id) if self.use_lanes else None
        if address is None:
            return None
        try:
            answer = await self.unary(peer_id, rpc.LANE_TICKET, Frame())
            ticket = check_answer(read(answer, TICKET_ANSWERS), LaneTicket)
            async with asyncio.timeout(self.request_timeout_s):
                stream = await lane.connect(address, lane.ROLE_FORWARD, ticket.ticket, bytes.fromhex(ticket.key))
        except (NesaError, TimeoutError, ValueError) as exc:
            logger.debug("no forward lane to %s, using libp2p: %r", peer_id, exc)
            return None
        channel = LaneChannel(stream, "answer on a data lane")
        self._forward_lanes[peer_id] = channel
        return channel

    async def _forward_on_lane(self, peer_id: str, channel: LaneChannel, request: Frame) -> Frame:
        try:
            channel.send(request)
            async with asyncio.timeout(self.request_timeout_s):
                answer = await channel.receive()
            if answer is None:
                raise PeerUnavailableError("the node closed the lane")
            return answer
        except BaseException as exc:  # the lane is unusable after any failure mid-call: an answer may still be owed
            channel.close()
            self._forward_lanes.pop(peer_id, None)
            if not isinstance(exc, Exception):  # cancelled: the caller's own timeout or shutdown
                raise
            raise PeerUnavailableError(f"peer {peer_id} did not answer a forward on its data lane: {exc!r}") from None


__all__ = ["ANSWER_DTYPES", "PROBED_RECORD_TTL_S", "RECENT_RECORD_S", "Swarm", "check_answer"]
