"""NodeInfo validation under keys a peer does not know (a bootstrap peer knows no model prefix): any record a
reader could take for a NodeInfo must be a valid one of the peer whose key signed it; other records pass."""

from __future__ import annotations

import json

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from nesa_node.protocol.dht import make_validator, model_key
from nesa_node.protocol.identity import peer_id_of_public_key
from nesa_node.protocol.records import NodeInfo, NodeState

PREFIX = "unknown-to-the-bootstrap"


def make_info(peer_id: str) -> NodeInfo:
    return NodeInfo(peer_id=peer_id, state=NodeState.online, start_block=0, end_block=4, dtype="float32")


class Signer:
    def __init__(self) -> None:
        self.key = RSAPrivateKey()
        self.validator = RSASignatureValidator(self.key)
        self.peer_id = peer_id_of_public_key(self.key.get_public_key()).to_base58()

    def owner_subkey(self, peer_id: str | None = None) -> bytes:
        return (peer_id or self.peer_id).encode() + self.validator.local_public_key

    def record(self, value: object, subkey: object, key: str = model_key(PREFIX)) -> DHTRecord:
        """A record as it arrives in a store: subkey and value serialized, the value signed when the subkey names
        this signer's key (as hivemind's DHTNode.store signs it)."""
        record = DHTRecord(
            key=DHTID.generate(source=key).to_bytes(),
            subkey=DHTProtocol.serializer.dumps(subkey),
            value=DHTProtocol.serializer.dumps(value),
            expiration_time=get_dht_time() + 30,
        )
        return DHTRecord(record.key, record.subkey, self.validator.sign_value(record), record.expiration_time)


@pytest.fixture(scope="module")
def signer() -> Signer:
    return Signer()


@pytest.fixture(scope="module")
def bootstrap():
    return make_validator(None, [])  # knows no model prefix


def test_an_honest_record_passes_under_an_unknown_key(signer, bootstrap):
    assert bootstrap.validate(signer.record(make_info(signer.peer_id).to_wire(), signer.owner_subkey()))
    # and under the model key, for a peer that knows the prefix
    assert make_validator(None, [PREFIX]).validate(
        signer.record(make_info(signer.peer_id).to_wire(), signer.owner_subkey())
    )


def test_a_node_info_naming_another_peer_is_refused_under_an_unknown_key(signer, bootstrap):
    victim = Signer().peer_id
    assert not bootstrap.validate(signer.record(make_info(victim).to_wire(), signer.owner_subkey(victim)))
    assert not bootstrap.validate(signer.record(make_info(victim).to_wire(), signer.owner_subkey()))


@pytest.mark.parametrize(
    "fields",
    [
        {"start_block": -1},
        {"end_block": "4"},
        {"state": "omnipotent"},
        {"inference_tps": 1e308 * 10},
        {"peer_id": ""},
    ],
)
def test_a_node_info_with_bad_fields_is_refused_under_an_unknown_key(signer, bootstrap, fields):
    wire = json.loads(make_info(signer.peer_id).to_wire()) | fields
    assert not bootstrap.validate(signer.record(json.dumps(wire), signer.owner_subkey()))


def test_escaped_field_names_and_bytes_values_are_checked_too(signer, bootstrap):
    forged = make_info(Signer().peer_id).to_wire().replace('"peer_id"', '"peer\\u005fid"')
    assert NodeInfo.from_wire(forged).peer_id != signer.peer_id  # a reader would take it for the other peer's
    assert not bootstrap.validate(signer.record(forged, signer.owner_subkey()))
    assert not bootstrap.validate(signer.record(forged.encode(), signer.owner_subkey()))


def test_node_info_under_a_plain_or_unowned_subkey_is_refused(signer, bootstrap):
    info = make_info(signer.peer_id).to_wire()
    assert not bootstrap.validate(signer.record(info, signer.peer_id.encode()))
    assert not bootstrap.validate(signer.record(info, None))  # a regular value
    assert not bootstrap.validate(signer.record(info, b"prefix-" + signer.owner_subkey()))


@pytest.mark.parametrize("value", [b"not a node record", "plain text", {"a": 1}, [1, 2], '{"other": 1}', 7])
def test_records_that_are_no_node_info_pass_under_an_unknown_key(signer, bootstrap, value):
    assert bootstrap.validate(signer.record(value, signer.owner_subkey(), key="some.other.key"))
