"""Hostile bytes (RELIABILITY G, decoding): a DHT store request of about 1 KiB with deeply nested msgpack extension
values crashed any peer that received it (SIGSEGV in hivemind's recursive decoder, before validation). Real peers
(`nesa-node dht`, `nesa-node run`) receive it on their DHT and RPCs, stay up, and an honest client still gets its
reference tokens; every decoder of peer input turns random and adversarial bytes into exceptions, never a crash."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node import event_loop
from nesa_node.errors import NesaError
from nesa_node.peer import start_peer
from nesa_node.protocol import msgpack_guard, rpc
from nesa_node.protocol.channel import Frame
from nesa_node.protocol.messages import FORWARD, TO_SESSION, decode
from nesa_node.protocol.records import NodeInfo
from tests.support.cli import Operator

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


# ---- against live peers ----------------------------------------------------------------------------------------------


@pytest.fixture
def operator(tmp_path):
    operator = Operator(tmp_path)
    yield operator
    operator.stop_all()


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


def test_deep_payload_to_a_node_and_a_bootstrap_leaves_both_up(operator, tiny_llama):
    from transformers import AutoModelForCausalLM

    from nesa_node.client.model import DistributedModelForCausalLM

    boot = operator.start("dht", "--address-file", "boot.addr")
    address = operator.wait_file("boot.addr", boot).split()[0]
    node = operator.start(
        "run", "--model", tiny_llama, "--blocks", "0:4", "--initial-peers", address, "--address-file", "node.addr"
    )
    node_address = operator.wait_file("node.addr", node).split()[0]

    answers = event_loop.run(_attack(address, [address, node_address]))
    assert any("nested deeper" in answer for answer in answers), answers
    assert boot.process.poll() is None, boot.output()
    assert node.process.poll() is None, node.output()

    ids = torch.tensor([[5, 9, 23, 7]])
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[address], compression="none") as model:
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None), expected)
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
