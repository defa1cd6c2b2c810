import json

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from nesa_node.protocol.dht import make_validator, model_key
from nesa_node.protocol.identity import peer_id_of_public_key
from nesa_node.protocol.records import AdapterInfo, NodeInfo, NodeState


def make_info(**overrides) -> NodeInfo:
    fields = dict(peer_id="QmPeer", state=NodeState.online, start_block=0, end_block=4, dtype="float32")
    return NodeInfo(**{**fields, **overrides})


def test_wire_roundtrip_and_unknown_fields_are_ignored():
    info = make_info(cache_tokens_left=12, location=(1.5, -2.0))
    assert NodeInfo.from_wire(info.to_wire()) == info
    newer = json.loads(info.to_wire()) | {"field_from_a_newer_version": [1, 2]}
    assert NodeInfo.from_wire(json.dumps(newer)) == info


ADAPTER = {"adapter_id": "0" * 64, "name": "reviewer", "slice_sha256": "f" * 64, "rank": 16}


def test_adapters_round_trip():
    info = make_info(adapters=(AdapterInfo(**ADAPTER),))
    assert NodeInfo.from_wire(info.to_wire()) == info


@pytest.mark.parametrize(
    "change",
    [
        {"start_block": "0"},
        {"start_block": 4},
        {"start_block": -1},
        {"state": "sleeping"},
        {"cache_tokens_left": -5},
        {"forward_tps": "fast"},
        {"adapters": ["a"]},
        {"adapters": [ADAPTER] * 65},
        {"adapters": [ADAPTER | {"adapter_id": "A" * 64}]},  # hex is lowercase
        {"adapters": [ADAPTER | {"slice_sha256": "0" * 63}]},
        {"adapters": [ADAPTER | {"rank": 0}]},
        {"adapters": [ADAPTER | {"name": "x" * 65}]},
        {"reputation": 2.0},
        # integers past what routing packs in int64 or sums: refused here, not an OverflowError in every client
        {"load": {"queue": 10**400}},
        {"load": {"sessions": 2**31 + 1}},
        {"cache_tokens_left": 2**63},
        {"max_length": 2**63},
        {"max_step_tokens": 2**63},
        {"max_step_tokens": -1},
        {"max_step_tokens": "8192"},
        {"start_block": 2**62, "end_block": 2**62 + 1},
        # names a page or a log shows: one word, no markup, no second line
        {"codecs": ["none", '<img src=x onerror="alert(1)">']},
        {"codecs": ["x" * 33]},
        {"dtype": "float32\nforged log line"},
        {"quantization": "<b>"},
        {"version": "0.1 <script>"},
        {"lane": "127.0.0.1:80/<svg>"},
    ],
)
def test_schema_violations_are_rejected(change):
    record = json.loads(make_info().to_wire()) | change
    with pytest.raises(ValidationError):
        NodeInfo.from_wire(json.dumps(record))


def test_non_json_and_oversized_records_are_rejected():
    with pytest.raises(ValueError):
        NodeInfo.from_wire({"peer_id": "x"})
    with pytest.raises(ValueError):
        NodeInfo.from_wire("x" * 40000)


def _signed_record(signer: RSASignatureValidator, info: NodeInfo, prefix: str, expiration: float) -> DHTRecord:
    record = DHTRecord(
        key=DHTID.generate(source=model_key(prefix)).to_bytes(),
        subkey=DHTProtocol.serializer.dumps(info.peer_id.encode() + signer.local_public_key),
        value=DHTProtocol.serializer.dumps(info.to_wire()),
        expiration_time=expiration,
    )
    validator = make_validator(signer, [prefix])
    return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)


def test_validator_accepts_own_record_and_rejects_forged_or_bad_expiration():
    owner_key, other_key = RSAPrivateKey(), RSAPrivateKey()
    owner, other = RSASignatureValidator(owner_key), RSASignatureValidator(other_key)
    owner_id = peer_id_of_public_key(owner_key.get_public_key()).to_base58()
    reader = make_validator(None, ["model"])
    now = get_dht_time()
    assert reader.validate(_signed_record(owner, make_info(peer_id=owner_id), "model", now + 30))
    # another key signing a record that names the owner's peer id
    assert not reader.validate(_signed_record(other, make_info(peer_id=owner_id), "model", now + 30))
    for expiration in (float("nan"), float("inf"), now + 10**6):
        assert not reader.validate(_signed_record(owner, make_info(peer_id=owner_id), "model", expiration))


def test_the_step_limit_announced_is_the_nodes_or_what_its_frame_limit_carries():
    """`max_step_tokens`: rows x tokens of the largest step a node takes, its `--max-tokens-per-step`, or fewer where a
    frame limit set by hand cannot carry them in float32; a record from a node that does not say reads as 0."""
    from nesa_node.protocol.messages import MAX_METADATA_BYTES
    from nesa_node.server.config import NodeConfig
    from nesa_node.server.node import max_frame_bytes, max_step_tokens

    config = NodeConfig(model_path="m", start_block=0, end_block=1).with_settings(max_tokens_per_step=100)
    assert max_step_tokens(config, 64) == 100
    small = config.with_settings(max_message_bytes=MAX_METADATA_BYTES + 1024 + 64 * 4 * 30 + 5)
    assert max_step_tokens(small, 64) == 30
    assert max_frame_bytes(small, 64) >= 30 * 64 * 4 + MAX_METADATA_BYTES + 1024  # 30 tokens fit its frame
    with pytest.raises(ValueError, match="cannot carry one token"):
        max_step_tokens(config.with_settings(max_message_bytes=10), 64)
    older = json.loads(make_info().to_wire())
    del older["max_step_tokens"]
    assert NodeInfo.from_wire(json.dumps(older)).max_step_tokens == 0
