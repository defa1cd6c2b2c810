"""Hostile bytes (RELIABILITY G, decoding): a DHT store request of about 1 KiB with deeply nested msgpack extension
values crashed any peer that received it (SIGSEGV in hivemind's recursive decoder, before validation). Real peers
(`nesa-node dht`, `nesa-node run`) receive it on their DHT and RPCs, and a client in its records lookups: all stay
up, and the client's generation, begun before the attack, ends with its reference tokens. hivemind's decoder turns
random and adversarial bytes into exceptions, never a crash; nesa-node's decoders of peer input (every message kind,
lane hellos and frames, libp2p stream frames, tensors, training states, adapter manifests) into typed errors only."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct

import msgpack
import pytest
import torch
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2P, PeerID
from hivemind.proto import dht_pb2, runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from nesa_node import event_loop
from nesa_node.client.checkpoints import check_signature
from nesa_node.compression.names import CODECS
from nesa_node.errors import NesaError
from nesa_node.peer import start_peer
from nesa_node.protocol import lane, messages, msgpack_guard, rpc
from nesa_node.protocol.channel import Frame, LaneChannel, read
from nesa_node.protocol.framing import StreamChannel
from nesa_node.protocol.messages import FORWARD, TO_SESSION, decode
from nesa_node.protocol.records import NodeInfo
from nesa_node.protocol.tensors import WireCodec, bytes_from_proto, tensor_from_proto
from nesa_node.sharding.lora import SLICE_FORMAT, AdapterSlice
from nesa_node.sharding.lora_identity import MANIFEST_FORMAT, AdapterManifest
from nesa_node.sharding.lora_train import OPTIMIZER_FORMAT, OptimizerState
from tests.support.swarm import wait_for_chain, wait_until

TUPLE = MSGPackSerializer._TUPLE_EXT_TYPE_CODE
DICTIONARY = 0x50  # hivemind's DictionaryDHTValue


def nested_tuples(depth: int, code: int = TUPLE) -> bytes:
    """`depth` extension values, each a one-element list holding the next: about 5 bytes a level."""
    inner = msgpack.packb(None)
    for _ in range(depth):
        inner = msgpack.packb(msgpack.ExtType(code, b"\x91" + inner))
    return inner


def test_the_guard_is_installed_by_every_peer_process():
    assert msgpack_guard.installed()  # importing nesa_node.peer installs it


def test_deep_extension_values_are_refused_and_hivemind_values_still_decode():
    with pytest.raises(msgpack_guard.ExtensionNestingError):
        MSGPackSerializer.loads(nested_tuples(300))
    with pytest.raises(msgpack_guard.ExtensionNestingError):
        MSGPackSerializer.loads(nested_tuples(msgpack_guard.MAX_EXT_DEPTH + 1))
    assert MSGPackSerializer.loads(nested_tuples(msgpack_guard.MAX_EXT_DEPTH)) is not None
    value = DictionaryDHTValue()
    value.store(b"subkey", (b"value", (1, 2)), get_dht_time() + 10)
    decoded = MSGPackSerializer.loads(MSGPackSerializer.dumps(value))
    assert isinstance(decoded, DictionaryDHTValue) and decoded.get(b"subkey").value == (b"value", (1, 2))
    assert MSGPackSerializer.loads(MSGPackSerializer.dumps((1, (2, (3, "x"))))) == (1, (2, (3, "x")))


adversarial = st.one_of(
    st.binary(max_size=2048),
    st.builds(nested_tuples, st.integers(0, 400), st.sampled_from([TUPLE, DICTIONARY, 0x51, 7])),
    st.builds(lambda depth: msgpack.packb(msgpack.ExtType(DICTIONARY, nested_tuples(depth))), st.integers(0, 300)),
    st.builds(lambda head, tail: head + tail, st.binary(max_size=16), st.builds(nested_tuples, st.integers(0, 300))),
)


@settings(max_examples=300, deadline=None)
@given(adversarial)
def test_hivemind_decoding_of_peer_bytes_raises_or_decodes_never_crashes(payload):
    try:
        MSGPackSerializer.loads(payload)
    except Exception:  # refused: what matters is that the process is still here
        pass


@settings(max_examples=300, deadline=None)
@given(adversarial)
def test_nesa_decoders_of_peer_bytes_give_typed_errors(payload):
    for kinds in (TO_SESSION, FORWARD):
        try:
            decode(payload, kinds)
        except NesaError:
            pass
    try:
        NodeInfo.from_wire(payload)
    except ValueError:  # from_wire's documented refusal (pydantic's ValidationError is one)
        pass


# ---- every other decoder of peer input: typed errors only ------------------------------------------------------------
#
# A NesaError is the only exception these may raise: anything else escapes the callers' typed handling (a client
# failing the node over, a node answering with an ErrorReply) and is a defect.

ALL_KINDS = {
    "TO_SESSION": messages.TO_SESSION,
    "FROM_SESSION": messages.FROM_SESSION,
    "PUSHED": messages.PUSHED,
    "PUSH_ANSWERS": messages.PUSH_ANSWERS,
    "FORWARD": messages.FORWARD,
    "FORWARD_ANSWERS": messages.FORWARD_ANSWERS,
    "INFO_ANSWERS": messages.INFO_ANSWERS,
    "TICKET_ANSWERS": messages.TICKET_ANSWERS,
    "ADAPTER_REQUESTS": messages.ADAPTER_REQUESTS,
    "ADAPTER_ANSWERS": messages.ADAPTER_ANSWERS,
    "TO_TRAINING": messages.TO_TRAINING,
    "FROM_TRAINING": messages.FROM_TRAINING,
    "TRAIN_SYNC": messages.TRAIN_SYNC,
    "TRAIN_SYNC_ANSWERS": messages.TRAIN_SYNC_ANSWERS,
    "GRAPH": messages.GRAPH,
    "GRAPH_ANSWERS": messages.GRAPH_ANSWERS,
}
MODELS = [model for model in vars(messages).values() if isinstance(model, type) and issubclass(model, messages.Message)]
KIND_NAMES = sorted({model.model_fields["kind"].default for model in MODELS if "kind" in model.model_fields})
FIELD_NAMES = sorted({name for model in MODELS for name in model.model_fields} | {"in", "out", "x"})


def trees(leaves: st.SearchStrategy) -> st.SearchStrategy:
    """Lists and maps of `leaves`, a few levels deep."""
    return st.recursive(
        leaves,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=30,
    )


json_values = trees(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12))
msgpack_values = trees(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12) | st.binary()
)
maps = st.builds(
    lambda kind, fields: msgpack.packb({"kind": kind, **fields}, use_bin_type=True),
    st.sampled_from(KIND_NAMES) | st.text(max_size=8),
    st.dictionaries(st.sampled_from(FIELD_NAMES), msgpack_values, max_size=6),
)


def typed_only(call, *args, **kwargs):
    """`call`'s result, or None when it raised a NesaError; any other exception fails the test."""
    try:
        return call(*args, **kwargs)
    except NesaError:
        return None


async def typed_only_async(coroutine):
    try:
        return await coroutine
    except NesaError:
        return None


def test_every_receiver_of_messages_is_fuzzed():
    """A receiver added to protocol/messages.py without a place here fails this test."""
    receivers = {id(value) for value in vars(messages).values() if isinstance(value, TypeAdapter)}
    assert {id(kinds) for kinds in ALL_KINDS.values()} == receivers


@settings(max_examples=300, deadline=None)
@given(st.one_of(adversarial, maps))
def test_every_message_receiver_and_the_info_record_give_typed_errors(payload):
    for name, kinds in ALL_KINDS.items():
        max_bytes = messages.MAX_INFO_BYTES if name == "INFO_ANSWERS" else messages.MAX_METADATA_BYTES
        message = typed_only(decode, payload, kinds, max_bytes=max_bytes)
        if isinstance(message, messages.InfoReply):
            typed_only(message.node_info)


RECORD_FIELDS = ["start_block", "end_block", "inference_tps", "load", "links", "lane", "adapters", "state", "location"]
info_texts = st.one_of(
    st.text(max_size=200),
    st.builds(json.dumps, json_values),
    st.builds(
        lambda fields: json.dumps(
            {"peer_id": "p", "state": "online", "start_block": 0, "end_block": 1, "dtype": "float32", **fields}
        ),
        st.dictionaries(st.sampled_from(RECORD_FIELDS), json_values, max_size=3),
    ),
)


@settings(max_examples=300, deadline=None)
@given(info_texts)
def test_an_info_reply_holding_any_text_gives_a_node_info_or_a_typed_error(text):
    typed_only(messages.InfoReply(info=text).node_info)


# lanes: the hello, then frames before and after authentication


class Writer:
    """The writing half of a connection whose reading half is under test: it takes everything, answers nothing."""

    def __init__(self):
        self.closed = False

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


hellos = st.one_of(
    st.binary(max_size=300),
    st.builds(
        lambda magic, role, length, body: magic + bytes((role, length)) + body,
        st.sampled_from([lane.MAGIC, b"NLN2", b""]),
        st.integers(0, 255),
        st.integers(0, 255),
        st.binary(max_size=300),
    ),
)


@settings(max_examples=300, deadline=None)
@given(hellos)
def test_the_lane_hello_reader_gives_a_hello_or_a_typed_error(data):
    async def main():
        return await typed_only_async(lane.read_hello(reader_of(data)))

    hello = asyncio.run(main())
    if hello is not None:
        role, session_id, salt = hello
        assert role in lane.ROLES and len(salt) == lane.SALT_BYTES and len(session_id) <= lane.MAX_SESSION_ID_BYTES


def lane_ciphers():
    """The (connecting side's, accepting side's) ciphers of one lane connection under a fixed key."""
    return lane._ciphers(bytes(range(lane.KEY_BYTES)), b"c" * lane.SALT_BYTES, b"a" * lane.SALT_BYTES)


def length_prefixed(bodies: list[bytes]) -> bytes:
    return b"".join(len(body).to_bytes(lane.LENGTH_BYTES, "big") + body for body in bodies)


raw_lane_bytes = st.one_of(
    st.binary(max_size=600),
    st.builds(length_prefixed, st.lists(st.binary(max_size=200), max_size=4)),
    st.builds(
        lambda length, body: length.to_bytes(lane.LENGTH_BYTES, "big") + body,
        st.integers(0, 2**32 - 1),
        st.binary(max_size=64),
    ),
)


@settings(max_examples=300, deadline=None)
@given(raw_lane_bytes)
def test_the_lane_frame_reader_gives_typed_errors_for_unauthenticated_bytes(data):
    to_node, from_node = lane_ciphers()

    async def main():
        channel = LaneChannel(lane.SealedStream(reader_of(data), Writer(), from_node, to_node, max_frame_bytes=4096))
        for _ in range(8):
            if await typed_only_async(channel.receive()) is None:
                return

    asyncio.run(main())


# frames sealed by a peer that holds the lane's key: what the protobuf parser, the message decoder and the tensor
# decoder then read

DTYPE_NAMES = ["float32", "float16", "bfloat16", "uint8", "int8", "float64", "bool", ""]


@st.composite
def tensors(draw) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(
        buffer=draw(st.binary(max_size=256)),
        size=draw(st.lists(st.integers(0, 8) | st.integers(0, 2**32 - 1), max_size=6)),
        dtype=draw(st.sampled_from(DTYPE_NAMES) | st.text(max_size=8)),
        compression=draw(st.sampled_from([0, 0, 0, 1, 5])),
    )


codec_metadata = st.one_of(
    st.none(),
    st.fixed_dictionaries({"name": st.sampled_from(CODECS)}),
    st.fixed_dictionaries(
        {"name": st.sampled_from(CODECS), "block_size": st.integers(-(2**40), 2**40) | st.sampled_from([16, 64])}
    ),
    msgpack_values,
)


def decode_tensor(proto: runtime_pb2.Tensor, codec_value, max_elements: int, rank: int | None) -> None:
    """Every way a client or node reads a peer's tensor: as hidden states under the codec its message names, and
    as bytes (adapter slices and manifests, training states)."""
    codec = typed_only(WireCodec.from_metadata, codec_value)
    if codec is not None:
        hidden_dtypes = ("float32", "float16", "bfloat16")
        typed_only(
            tensor_from_proto, proto, allowed_dtypes=hidden_dtypes, max_elements=max_elements, rank=rank, codec=codec
        )
    typed_only(bytes_from_proto, proto, max_bytes=max_elements)


frames = st.builds(
    lambda parts, metadata: runtime_pb2.ExpertRequest(tensors=parts, metadata=metadata).SerializeToString(),
    st.lists(tensors(), max_size=3),
    st.one_of(adversarial, maps),
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400) | frames, st.sampled_from([1 << 6, 1 << 12]))
def test_sealed_lane_frames_give_frames_or_typed_errors_down_to_their_tensors(payload, max_elements):
    to_node, from_node = lane_ciphers()
    data = length_prefixed([to_node.encrypt(bytes(12), payload, None)])  # the connection's first frame: nonce 0

    async def main():
        stream = lane.SealedStream(reader_of(data), Writer(), from_node, to_node, max_frame_bytes=4096)
        return await typed_only_async(LaneChannel(stream).receive())

    received = asyncio.run(main())
    if received is None:
        return
    for kinds in ALL_KINDS.values():
        typed_only(read, received, kinds)
    for proto in received.tensors:
        decode_tensor(proto, None, max_elements, 3)


@settings(max_examples=300, deadline=None)
@given(tensors(), codec_metadata, st.sampled_from([0, 1, 64, 1 << 16]), st.sampled_from([None, 1, 3]))
def test_tensor_buffers_give_tensors_or_typed_errors(proto, codec_value, max_elements, rank):
    decode_tensor(proto, codec_value, max_elements, rank)


# libp2p streams: hivemind's framing (marker, 8-byte length, protobuf), error frames included

MARKERS = [P2P.MESSAGE_MARKER, P2P.ERROR_MARKER, b"\x02"]
stream_bytes = st.one_of(
    st.binary(max_size=600),
    st.builds(
        lambda marker, length, body: marker + length.to_bytes(8, "big") + body,
        st.sampled_from(MARKERS),
        st.integers(0, 2**64 - 1) | st.integers(0, 64),
        st.binary(max_size=64),
    ),
    st.builds(
        lambda marker, body: marker + len(body).to_bytes(8, "big") + body,
        st.sampled_from(MARKERS),
        st.binary(max_size=64) | frames | st.builds(lambda text: RPCError(message=text).SerializeToString(), st.text()),
    ),
)


@settings(max_examples=300, deadline=None)
@given(stream_bytes)
def test_the_libp2p_stream_reader_gives_frames_or_typed_errors(data):
    async def main():
        channel = StreamChannel(reader_of(data), Writer(), max_frame_bytes=4096)
        for _ in range(8):
            if await typed_only_async(channel.receive()) is None:
                return

    asyncio.run(main())


# what a TrainState answer and an adapter answer carry as bytes: safetensors and JSON a peer wrote

TENSOR_NAMES = [
    "0.self_attn.q_proj.lora_A",
    "0.self_attn.q_proj.lora_B",
    "1.mlp.up_proj.lora_A.exp_avg",
    "1.mlp.up_proj.lora_A.exp_avg_sq",
]
header_entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "F64", "X"]),
        "shape": st.lists(st.integers(0, 4) | st.integers(0, 2**40), max_size=3),
        "data_offsets": st.lists(st.integers(0, 64) | st.integers(0, 2**40), min_size=2, max_size=2),
    }
)
described = st.fixed_dictionaries(
    {
        "format": st.sampled_from([SLICE_FORMAT, OPTIMIZER_FORMAT, "x"]),
        "start": st.integers(-2, 3) | json_values,
        "end": st.integers(-2, 3) | json_values,
        "step": st.integers(-1, 3),
        "scales": st.dictionaries(
            st.sampled_from(["0.self_attn.q_proj", "1.mlp.up_proj"]) | st.text(max_size=8), json_values, max_size=2
        ),
    }
)


@st.composite
def safetensors_files(draw) -> bytes:
    """safetensors bytes with a header a peer wrote: names, dtypes, shapes, offsets and metadata of its choosing."""
    entries = draw(st.dictionaries(st.sampled_from(TENSOR_NAMES) | st.text(max_size=12), header_entries, max_size=3))
    metadata_text = st.builds(json.dumps, described) | st.text(max_size=20)
    metadata = draw(st.dictionaries(st.sampled_from(["nesa_lora", "nesa_optimizer"]), metadata_text, max_size=2))
    header = json.dumps({**entries, "__metadata__": metadata} if draw(st.booleans()) else entries).encode()
    declared = len(header) + draw(st.sampled_from([0, 0, 0, 1, -1, 1 << 40]))
    return struct.pack("<Q", max(declared, 0)) + header + draw(st.binary(max_size=128))


@settings(max_examples=300, deadline=None)
@given(safetensors_files() | st.binary(max_size=300))
def test_slice_and_optimizer_bytes_give_their_state_or_typed_errors(data):
    """The bytes of a TrainState answer (or an adapter answer's blocks) under a hash that matches them: only the
    parsing stands between the peer and the reader."""
    digest = hashlib.sha256(data).hexdigest()
    typed_only(AdapterSlice.from_bytes, data, digest)
    typed_only(OptimizerState.from_bytes, data, digest)


manifests = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda value: json.dumps(value).encode(), json_values),
    st.builds(
        lambda hashes, rank, name: json.dumps({"format": name, "block_hashes": hashes, "rank": rank}).encode(),
        st.lists(st.text(max_size=70) | json_values, max_size=3),
        json_values,
        st.sampled_from([MANIFEST_FORMAT, "x"]),
    ),
)


@settings(max_examples=300, deadline=None)
@given(manifests, st.binary(max_size=600), st.binary(max_size=600))
def test_adapter_manifests_and_training_state_signatures_give_typed_errors(manifest, public_key, signature):
    typed_only(AdapterManifest.from_bytes, manifest, hashlib.sha256(manifest).hexdigest())
    state = messages.TrainState(
        start_block=0,
        end_block=1,
        step=1,
        slice_sha256="0" * 64,
        optimizer_sha256="0" * 64,
        public_key=public_key,
        signature=signature,
    )
    typed_only(check_signature, state, "session", "12D3KooWGTZyXVxMDKpdoVKNXE3zKETVwG2EsxLbZTDxuSkm891n")


# ---- against live peers ----------------------------------------------------------------------------------------------


async def _attack(address: str, targets: list[str]) -> list[str]:
    """Send the deep payload to each target peer: as a whole DHT dictionary, as a DHT subkey, and to the node's
    RPCs. Returns what each attempt got back (refusals)."""
    attacker = await start_peer(initial_peers=[address], client_mode=True)
    answers = []
    try:
        payload = nested_tuples(300)
        assert len(payload) < 2048
        for target in targets:
            victim = PeerID.from_base58(Multiaddr(target)["p2p"])
            stub = attacker.dht.protocol.get_stub(victim)
            key = DHTID.generate(source="attack").to_bytes()
            expiration = get_dht_time() + 30
            for subkey, value in ((DHTProtocol.IS_DICTIONARY, payload), (payload, b"value")):
                request = dht_pb2.StoreRequest(
                    keys=[key], subkeys=[subkey], values=[value], expiration_time=[expiration], in_cache=[False]
                )
                try:
                    answers.append(repr(await stub.rpc_store(request, timeout=10)))
                except Exception as exc:
                    answers.append(repr(exc))
            for name in (rpc.INFO, rpc.FORWARD, rpc.PING):
                try:
                    request = Frame(metadata=payload)
                    answer = await attacker.p2p.call_protobuf_handler(victim, name, request, Frame)
                    answers.append(repr(answer)[:200])
                except Exception as exc:
                    answers.append(repr(exc))
            await asyncio.sleep(0)
    finally:
        await attacker.shutdown()
    return answers


async def _deep_value_server(address: str):
    """A DHT server peer that answers every lookup with the deep payload as a dictionary value: what a client reads
    from it goes through the same hivemind decoder. Returns the peer and the list of peer ids that asked it."""
    peer = await start_peer(initial_peers=[address])  # server mode: other peers' lookups reach it
    asked: list[str] = []

    async def find(request: dht_pb2.FindRequest, context) -> dht_pb2.FindResponse:
        asked.append(context.remote_id.to_base58())
        deep = dht_pb2.FindResult(
            type=dht_pb2.FOUND_DICTIONARY, value=nested_tuples(300), expiration_time=get_dht_time() + 30
        )
        return dht_pb2.FindResponse(results=[deep] * len(request.keys), peer=peer.dht.protocol.node_info)

    name = DHTProtocol._get_handle_name(None, "rpc_find")
    await peer.p2p.remove_protobuf_handler(name)
    await peer.p2p.add_protobuf_handler(name, find, dht_pb2.FindRequest)
    return peer, asked


def test_deep_payload_to_a_node_and_a_bootstrap_leaves_both_up(operator, tiny_llama):
    """An honest client opens its session and generates part of its tokens; the deep payload then goes to the
    node's and the bootstrap's DHT and the node's RPCs, and a DHT peer answers the client's own records lookups
    with it. Every process stays up and the client finishes its generation in the same session, on the same node,
    with the reference tokens."""
    from transformers import AutoModelForCausalLM

    from nesa_node.client.model import DistributedModelForCausalLM

    boot = operator.start("dht", "--address-file", "boot.addr")
    address = operator.wait_file("boot.addr", boot).split()[0]
    node = operator.start(
        "run", "--model", tiny_llama, "--blocks", "0:4", "--initial-peers", address, "--address-file", "node.addr"
    )
    node_address = operator.wait_file("node.addr", node).split()[0]

    ids = torch.tensor([[5, 9, 23, 7]])
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[address], compression="none") as model:
        wait_for_chain(model)
        node_id = Multiaddr(node_address)["p2p"]
        with model.inference_session(max_length=ids.shape[1] + 6) as session:
            first = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None)
            assert torch.equal(first, expected[:, : ids.shape[1] + 3])

            answers = event_loop.run(_attack(address, [address, node_address]))
            assert any("nested deeper" in answer for answer in answers), answers
            assert boot.process.poll() is None, boot.output()
            assert node.process.poll() is None, node.output()

            server, asked = model.call(_deep_value_server(address))
            try:
                client_id = model.swarm.peer_id

                def looked_up_there() -> bool:
                    records = model.call(model.swarm.node_records(fresh=True))
                    assert node_id in {record.info.peer_id for record in records}  # the honest record still read
                    return client_id in asked

                wait_until(looked_up_there, timeout_s=30)
            finally:
                model.call(server.shutdown())

            output = model.generate(first, max_new_tokens=3, do_sample=False, eos_token_id=None)
            assert torch.equal(output, expected)
            assert session.failovers == [] and session.chain.peer_ids == (node_id,)
    assert boot.process.poll() is None and node.process.poll() is None


# ---- forged records on a replica -------------------------------------------------------------------------------------


def test_a_forged_record_on_a_replica_does_not_hide_the_honest_ones(tiny_llama):
    """The bootstrap knows no model key, so it stores any correctly signed record under the model's key: here a
    junk one, beside a real node's record. A reader that validates NodeInfo keeps the real one (hivemind's own
    check dropped the replica's whole dictionary for one bad subkey)."""
    from hivemind.dht.crypto import RSASignatureValidator

    from nesa_node.bootstrap import BootstrapPeer
    from nesa_node.protocol.dht import fetch_node_infos, model_key, store_node_info
    from nesa_node.protocol.records import LoadInfo, NodeState

    prefix = "forged-replica"

    async def scenario() -> tuple[str, list]:
        bootstrap = await BootstrapPeer.create()  # no model keys: it checks expirations and signatures only
        address = await bootstrap.visible_maddrs()
        peers = []
        try:
            # writers and reader are DHT clients: the bootstrap is the only replica
            writer = await start_peer(initial_peers=address, client_mode=True, signs_records=True)
            attacker = await start_peer(initial_peers=address, client_mode=True, signs_records=True)
            reader = await start_peer(initial_peers=address, client_mode=True, dht_prefixes=(prefix,))
            peers += [writer, attacker, reader]
            info = NodeInfo(
                peer_id=writer.peer_id, start_block=0, end_block=4, state=NodeState.online,
                dtype="float32", inference_tps=10.0, cache_tokens_left=100, load=LoadInfo(),
            )  # fmt: skip
            assert await store_node_info(writer.dht, prefix, info, writer.signature_validator, ttl_s=60)
            validator: RSASignatureValidator = attacker.signature_validator
            junk_subkey = attacker.peer_id.encode() + validator.local_public_key
            stored = await attacker.dht.store(
                model_key(prefix), b"not a node record", get_dht_time() + 60, subkey=junk_subkey
            )
            assert stored  # the bootstrap took it
            return writer.peer_id, await fetch_node_infos(reader.dht, prefix)
        finally:
            for peer in reversed(peers):
                await peer.shutdown()
            await bootstrap.shutdown()

    honest, records = event_loop.run(scenario())
    assert [record.info.peer_id for record in records] == [honest]
