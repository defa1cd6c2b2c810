"""Storing and reading `NodeInfo` records on the hivemind DHT.

Layout: one DHT dictionary per model, key `"{dht_prefix}.nodes"`; each node writes only its own subkey,
`"{peer_id}" + "[owner:<its RSA public key>]"`. hivemind's RSASignatureValidator makes the subkey writable only
by the holder of that key; `NodeInfoValidator` then checks the value against the NodeInfo schema and that the
record's peer_id is the peer id of the signing key, so no peer can write another node's record.

DHT keys travel hashed, so a peer that is not told a model's prefix (a bootstrap peer) cannot tell a model key from
any other. Every peer therefore also checks, under any key, each record a reader could take for a NodeInfo: its
value parses as one, or is a JSON object naming one of NodeInfo's required fields. Such a record must be a valid
NodeInfo signed by the key of its own peer_id; an honest record (written by `store_node_info`) always is.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPublicKey

from nesa_node.protocol.identity import peer_id_of_public_key
from nesa_node.protocol.records import MAX_RECORD_BYTES, NodeInfo

logger = logging.getLogger(__name__)

MAX_RECORD_TTL_S = 600.0  # a record may not claim to live longer than this (seconds)


def default_dht_prefix(model_path: str) -> str:
    """The model key prefix nodes and clients use unless told otherwise: the model folder's name, sanitised."""
    from pathlib import Path

    name = Path(model_path).resolve().name or "model"
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in name)


def model_key(dht_prefix: str) -> str:
    return f"{dht_prefix}.nodes"


class NodeInfoValidator(RecordValidatorBase):
    """Schema and identity check of NodeInfo records: strict under the given model keys (every subkey must hold a
    valid record of its signer), and under any other key for each record that claims to be a NodeInfo.

    Runs after the signature validator (lower priority), so it sees the value with the signature stripped.
    """

    def __init__(self, dht_prefixes: list[str] | tuple[str, ...] = ()):
        self._key_ids = {DHTID.generate(source=model_key(prefix)).to_bytes() for prefix in dht_prefixes}

    def add_prefix(self, dht_prefix: str) -> None:
        self._key_ids.add(DHTID.generate(source=model_key(dht_prefix)).to_bytes())

    def validate(self, record: DHTRecord) -> bool:
        if record.key in self._key_ids:
            return _valid_model_record(record)
        return _valid_if_node_info(record)

    @property
    def priority(self) -> int:
        return 0  # below RSASignatureValidator (10): validate after the signature is checked and stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if isinstance(other, NodeInfoValidator):
            self._key_ids |= other._key_ids
            return True
        return False


def _valid_model_record(record: DHTRecord) -> bool:
    """A record under a known model key: a NodeInfo of the peer whose key signed its subkey, nothing else."""
    if not (math.isfinite(record.expiration_time) and record.expiration_time <= get_dht_time() + MAX_RECORD_TTL_S):
        logger.debug("rejected NodeInfo record with expiration %r", record.expiration_time)
        return False
    if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
        return False  # the model key holds only per-node subkeys
    try:
        info = NodeInfo.from_wire(DHTProtocol.serializer.loads(record.value))
    except Exception as exc:  # any malformed record is simply invalid
        logger.debug("rejected NodeInfo record: %r", exc)
        return False
    return _signed_by_its_peer(record.subkey, info)


def _valid_if_node_info(record: DHTRecord) -> bool:
    """A record under a key this peer does not know: refused only if it claims to be a NodeInfo and is not a
    valid one of its signer. Anything a reader would parse as a NodeInfo is checked, so a forger can only store
    records no reader takes for one (which the storage bound then limits)."""
    text = _decoded_text(record.value)
    if text is None:
        return True
    try:
        info = NodeInfo.from_wire(text)
    except Exception:
        if _names_node_info_fields(text):
            logger.debug("rejected a malformed NodeInfo record")
            return False
        return True
    return _signed_by_its_peer(record.subkey, info)


NODE_INFO_REQUIRED = frozenset(name for name, field in NodeInfo.model_fields.items() if field.is_required())


MSGPACK_TEXT_HEADS = frozenset([*range(0xA0, 0xC0), 0xC4, 0xC5, 0xC6, 0xD9, 0xDA, 0xDB])  # str and bin types


def _decoded_text(value_bytes: bytes) -> str | bytes | None:
    """The DHT value as NodeInfo.from_wire reads it (text), or None for a value that is no text at all. Only a
    value that starts as msgpack text is decoded: a store of junk does not reach hivemind's extension decoder,
    which logs a warning for each unknown extension type."""
    if not value_bytes or value_bytes[0] not in MSGPACK_TEXT_HEADS:
        return None
    try:
        value = DHTProtocol.serializer.loads(value_bytes)
    except Exception:
        return None
    return value if isinstance(value, str | bytes) else None


def _names_node_info_fields(text: str | bytes) -> bool:
    """Whether `text` is a JSON object with one of NodeInfo's required fields: a NodeInfo with bad fields. Text
    longer than any record NodeInfo.from_wire accepts is never read as one, so it is not parsed."""
    if len(text) > MAX_RECORD_BYTES:
        return False
    try:
        parsed = json.loads(text)
    except Exception:  # not JSON, or nested too deep to parse: no reader takes it for a NodeInfo
        return False
    return isinstance(parsed, dict) and not NODE_INFO_REQUIRED.isdisjoint(parsed)


def _signed_by_its_peer(subkey_bytes: bytes, info: NodeInfo) -> bool:
    """Whether the subkey is `{peer_id}[owner:<key>]` for the record's own peer_id and that peer's key."""
    try:
        subkey = DHTProtocol.serializer.loads(subkey_bytes)
        owner = owner_peer_id(subkey)
    except Exception as exc:
        logger.debug("rejected NodeInfo record with a malformed subkey: %r", exc)
        return False
    if owner is None or owner != info.peer_id or not subkey.startswith(info.peer_id.encode()):
        logger.debug("rejected NodeInfo record of %s signed by %s", info.peer_id, owner)
        return False
    return True


def owner_peer_id(subkey: object) -> str | None:
    """Peer id (base58) of the RSA key named in a subkey's owner tag, or None if there is none."""
    if not isinstance(subkey, bytes):
        return None
    found = RSASignatureValidator._PUBLIC_KEY_RE.findall(subkey)
    if len(found) != 1:
        return None
    return peer_id_of_public_key(RSAPublicKey.from_bytes(found[0])).to_base58()


class ExpirationValidator(RecordValidatorBase):
    """Every record, under any key: a finite expiration at most MAX_RECORD_TTL_S ahead. hivemind's storage takes
    NaN and inf expirations (and refuses only past ones), so without this a peer that does not know a model key,
    such as a bootstrap peer, would keep such a record forever."""

    def validate(self, record: DHTRecord) -> bool:
        ok = math.isfinite(record.expiration_time) and record.expiration_time <= get_dht_time() + MAX_RECORD_TTL_S
        if not ok:
            logger.debug("rejected a record with expiration %r", record.expiration_time)
        return ok

    @property
    def priority(self) -> int:
        return 20  # before the signature check: the cheapest test first

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, ExpirationValidator)


def make_validator(signature_validator: RSASignatureValidator | None, dht_prefixes: list[str]) -> CompositeValidator:
    """Expiration bounds, then the signature check (and stripping), then the NodeInfo schema. Peers that write no
    records of their own (clients, bootstrap peers) still verify and strip signatures, with a throwaway key."""
    return CompositeValidator(
        [ExpirationValidator(), NodeInfoValidator(dht_prefixes), signature_validator or RSASignatureValidator()]
    )


def _keep_valid_subkeys(protocol: DHTProtocol, key_bytes: bytes, dictionary) -> bool:
    """DHTProtocol._validate_dictionary as nesa-node runs it: drop the subkeys that fail validation and keep the
    rest. hivemind's own refuses the whole dictionary for one bad subkey, so a single forged record on a replica
    (a peer that does not know the model key stores any correctly signed record) hid every honest node's record
    on that replica from readers, and a store mixing good and bad subkeys stored nothing."""
    if protocol.record_validator is None:
        return True
    invalid = []
    with dictionary.freeze():
        for subkey, (value_bytes, expiration_time) in dictionary.items():
            try:
                record = DHTRecord(key_bytes, protocol.serializer.dumps(subkey), value_bytes, expiration_time)
                valid = protocol.record_validator.validate(record)
            except Exception:  # a subkey or value hivemind cannot even re-encode
                valid = False
            if not valid:
                invalid.append(subkey)
    for subkey in invalid:
        del dictionary[subkey]
    if invalid:
        logger.debug("dropped %d invalid subkeys of a DHT dictionary", len(invalid))
    return True


def install_subkey_filter() -> None:
    """Make every DHT peer of this process keep the valid subkeys of a dictionary it stores or reads (idempotent;
    called when nesa_node.peer is imported)."""
    DHTProtocol._validate_dictionary = _keep_valid_subkeys


@dataclass(frozen=True)
class NodeRecord:
    info: NodeInfo
    expiration_time: float  # DHT time


async def store_node_info(
    dht: DHTNode, dht_prefix: str, info: NodeInfo, signature_validator: RSASignatureValidator, ttl_s: float
) -> bool:
    """Store `info` under the model key as this node's owner-protected subkey; True if a replica took it."""
    subkey = info.peer_id.encode() + signature_validator.local_public_key
    return await dht.store(model_key(dht_prefix), info.to_wire(), get_dht_time() + ttl_s, subkey=subkey)


async def fetch_node_infos(dht: DHTNode, dht_prefix: str) -> list[NodeRecord]:
    """Every valid, unexpired NodeInfo under the model key (invalid entries are dropped and logged)."""
    found = await dht.get(model_key(dht_prefix), latest=True)
    if found is None or not hasattr(found.value, "items"):
        return []
    now = get_dht_time()
    records: list[NodeRecord] = []
    for subkey, entry in found.value.items():
        try:
            info = NodeInfo.from_wire(entry.value)
            if owner_peer_id(subkey) != info.peer_id:
                raise ValueError("record not signed by its peer")
        except Exception as exc:
            logger.debug("ignoring a bad NodeInfo record: %r", exc)
            continue
        if entry.expiration_time > now:
            records.append(NodeRecord(info=info, expiration_time=entry.expiration_time))
    return records
