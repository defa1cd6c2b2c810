"""Signed per-hop records, a client's receipts of a session, and their JSON file.

A node signs one `HopRecord` per session, hop and window of up to 32 tokens: what it was given (the SHA-256 of the
window's input), what it answered (a `WindowCommitment` to its output before the wire codec), which blocks with
which weights and adapter, and the wire codec. The signature is the node's identity key (the RSA key that fixes its
libp2p peer id, nesa_node/protocol/identity.py), RSA-PSS with SHA-256 as hivemind signs DHT records, over

    b"nesa-hop-record-v1\\x00" || msgpack([version, session_id, hop, span_start, span_end, window, token_start,
                                           token_end, input_hash, commitment, weights_hash, adapter_hash, codec,
                                           peer_id])

and the record's canonical encoding (the Merkle leaf, what travels) is msgpack of the same list with the signature
(raw, 256 bytes for a 2048-bit key) appended. `HopRecord.from_bytes` accepts only that encoding: every field is
type- and bound-checked, the commitment must decode, and bytes that decode but are not the canonical spelling are
refused, so one record has one encoding and one leaf.

The client collects the records of each session with their nodes' public keys (`ReceiptsBuilder.add` checks each
as it comes), and closes them into `SessionReceipts`: per session the records in arrival order and the Merkle root
over their encodings (merkle.py), plus the nodes' keys and what the client did with them (`audit_rate`: the fraction
of windows it re-executed; free-text `metadata`). The JSON file is canonical (sorted keys, one-space indent, bytes
as lowercase hex) and carries a SHA-256 `digest` of the rest: a checksum anyone can recompute, so it detects edits
and damage, not an author. `nesa-node audit` (audit.py) checks a file offline.

    signer = RecordSigner(load_private_key(identity_path))          # a node, once
    record = signer.sign(HopRecord(session_id=..., ..., commitment=committer.finish().to_bytes(), ...))
    builder = ReceiptsBuilder(); builder.add(record, signer.public_key)   # a client, per record received
    builder.receipts(audit_rate=0.05).save("receipts.json")
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import msgpack
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from nesa_node.errors import ReceiptError
from nesa_node.protocol.identity import peer_id_of_public_key
from nesa_node.protocol.records import PeerIdText, SessionId
from nesa_node.verification.commitment import WindowCommitment
from nesa_node.verification.merkle import InclusionProof, merkle_root, proof

RECORD_VERSION = 1
FILE_FORMAT = "nesa-receipts/1"
SIGNED_DOMAIN = b"nesa-hop-record-v1\x00"
DIGEST_DOMAIN = b"nesa-receipts-v1\x00"
MAX_RECORD_BYTES = 8192  # a record at the defaults is ~600 bytes (210 commitment, 256 signature)
MAX_COMMITMENT_BYTES = 4096
MAX_SIGNATURE_BYTES = 1024  # RSA up to 8192 bits
MAX_TEXT = 128  # characters of an id or hash field
KEY_BITS = (2048, 8192)  # RSA modulus sizes a node key may have

_PRINTABLE = re.compile(r"[!-~]+")  # ids and hashes: printable ASCII without spaces
_BASE58 = re.compile(r"[1-9A-HJ-NP-Za-km-z]+")
_INT_LIMIT = 1 << 32


@dataclass(frozen=True)
class HopRecord:
    """One node's signed statement about one window of one session (see the module docstring).

    The wire form is the canonical byte encoding, checked field by field by `from_bytes`; a pydantic model would be
    a second, laxer parser of the same record, so this is a frozen dataclass validated by `check`."""

    session_id: SessionId
    hop: int  # position of the node in the session's chain, from 0
    span_start: int  # blocks [span_start, span_end) the node ran
    span_end: int
    window: int  # window index in the session, from 0
    token_start: int  # tokens [token_start, token_end) of the session in this window
    token_end: int
    input_hash: bytes  # 32 bytes: commitment.input_hash of the window's input as the node received it
    commitment: bytes  # WindowCommitment.to_bytes() of its output before the wire codec
    weights_hash: str  # the span's weights hash as the node announces it
    adapter_hash: str  # the LoRA adapter's id, "" without one
    codec: str  # wire codec of the node's output
    peer_id: PeerIdText  # base58 peer id of the signing key
    signature: bytes = b""  # raw RSA-PSS signature over `signed_bytes()`; empty until signed

    def check(self) -> None:
        """Raise ReceiptError naming the first field out of bounds (also decodes the commitment)."""
        _check_text("session_id", self.session_id, _PRINTABLE)
        for name in ("hop", "span_start", "span_end", "window", "token_start", "token_end"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < _INT_LIMIT:
                raise ReceiptError(f"record {name} must be an integer in [0, 2^32), got {value!r}")
        if self.span_start >= self.span_end:
            raise ReceiptError(f"record span {self.span_start}:{self.span_end} is empty")
        if self.token_start >= self.token_end:
            raise ReceiptError(f"record tokens {self.token_start}:{self.token_end} are empty")
        if type(self.input_hash) is not bytes or len(self.input_hash) != 32:
            raise ReceiptError("record input_hash must be 32 bytes")
        if type(self.commitment) is not bytes or not 0 < len(self.commitment) <= MAX_COMMITMENT_BYTES:
            raise ReceiptError(f"record commitment must be 1 to {MAX_COMMITMENT_BYTES} bytes")
        WindowCommitment.from_bytes(self.commitment)
        _check_text("weights_hash", self.weights_hash, _PRINTABLE)
        if self.adapter_hash != "":
            _check_text("adapter_hash", self.adapter_hash, _PRINTABLE)
        _check_text("codec", self.codec, _PRINTABLE)
        _check_text("peer_id", self.peer_id, _BASE58)
        if type(self.signature) is not bytes or len(self.signature) > MAX_SIGNATURE_BYTES:
            raise ReceiptError(f"record signature must be at most {MAX_SIGNATURE_BYTES} bytes")

    def _body(self) -> list:
        return [
            RECORD_VERSION,
            self.session_id,
            self.hop,
            self.span_start,
            self.span_end,
            self.window,
            self.token_start,
            self.token_end,
            self.input_hash,
            self.commitment,
            self.weights_hash,
            self.adapter_hash,
            self.codec,
            self.peer_id,
        ]

    def signed_bytes(self) -> bytes:
        """What the signature covers: the domain prefix and the record without its signature."""
        return SIGNED_DOMAIN + msgpack.packb(self._body(), use_bin_type=True)

    def to_bytes(self) -> bytes:
        """The canonical encoding, signature included: the record's Merkle leaf."""
        return msgpack.packb([*self._body(), self.signature], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> HopRecord:
        """Decode a record a peer sent; raises ReceiptError for anything but a canonical, in-bounds, signed
        version-1 record (the signature itself is checked by `verify_record`)."""
        if not isinstance(data, bytes) or len(data) > MAX_RECORD_BYTES:
            raise ReceiptError(f"a record must be bytes of at most {MAX_RECORD_BYTES}")
        try:
            items = msgpack.unpackb(
                data,
                raw=False,
                use_list=True,
                strict_map_key=True,
                max_str_len=MAX_TEXT,
                max_bin_len=MAX_COMMITMENT_BYTES,
                max_array_len=16,
                max_map_len=0,
                max_ext_len=0,
            )
        except (ValueError, TypeError, OverflowError, msgpack.exceptions.UnpackException) as error:
            raise ReceiptError(f"record is not msgpack: {error}") from None
        if not isinstance(items, list) or len(items) != 15:
            raise ReceiptError("a record is a list of 15 items")
        if type(items[0]) is not int or items[0] != RECORD_VERSION:
            raise ReceiptError(f"record version {items[0]!r}; this node reads version {RECORD_VERSION}")
        names = [item.name for item in fields(cls)]
        record = cls(**dict(zip(names, items[1:], strict=True)))
        record.check()
        if not record.signature:
            raise ReceiptError("record is not signed")
        if record.to_bytes() != data:
            raise ReceiptError("record is not in canonical form")
        return record


def _check_text(name: str, value, pattern: re.Pattern) -> None:
    if type(value) is not str or not 0 < len(value) <= MAX_TEXT or not pattern.fullmatch(value):
        raise ReceiptError(f"record {name} must be 1 to {MAX_TEXT} printable ASCII characters, got {value!r:.80}")


# -- signing and checking ----------------------------------------------------------------------------------------


class RecordSigner:
    """Signs a node's records with its identity key; `peer_id` and `public_key` (DER SubjectPublicKeyInfo, what
    a client needs to check the records) are computed once. Signing costs ~0.25 ms (2048-bit RSA, one core)."""

    def __init__(self, private_key: RSAPrivateKey):
        self._key = private_key
        public = private_key.get_public_key()
        self.peer_id = PeerIdText(peer_id_of_public_key(public).to_base58())
        self.public_key: bytes = public._public_key.public_bytes(
            encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def sign_bytes(self, data: bytes) -> bytes:
        """This node's raw signature (RSA-PSS, SHA-256) over `data`: check it with `signer_of`."""
        return base64.b64decode(self._key.sign(data))

    def sign(self, record: HopRecord) -> HopRecord:
        """`record` with this node's peer id and a signature; raises ReceiptError for a record out of bounds."""
        unsigned = replace(record, peer_id=self.peer_id, signature=b"")
        unsigned.check()
        # hivemind's RSAPrivateKey signs RSA-PSS/SHA-256 and returns base64; records keep the raw bytes, since base64
        # has second spellings of the same bytes (its unused trailing bits) that would give one record two leaves
        return replace(unsigned, signature=base64.b64decode(self._key.sign(unsigned.signed_bytes())))


def sign_record(record: HopRecord, private_key: RSAPrivateKey) -> HopRecord:
    """One-off form of `RecordSigner(private_key).sign(record)`."""
    return RecordSigner(private_key).sign(record)


@functools.lru_cache(maxsize=256)
def _load_public_key(der: bytes) -> tuple[RSAPublicKey | None, str, str]:
    """(key, its peer id, "") for a canonical DER RSA public key, else (None, "", why not)."""
    try:
        key = serialization.load_der_public_key(der)
    except (ValueError, TypeError, UnsupportedAlgorithm) as error:
        return None, "", f"not a DER public key ({error})"
    if not isinstance(key, rsa.RSAPublicKey):
        return None, "", f"not an RSA key ({type(key).__name__})"
    if not KEY_BITS[0] <= key.key_size <= KEY_BITS[1]:
        return None, "", f"RSA key of {key.key_size} bits, outside {KEY_BITS[0]}..{KEY_BITS[1]}"
    canonical = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if canonical != der:
        return None, "", "not the canonical DER encoding of its key"
    wrapped = RSAPublicKey(key)
    return wrapped, peer_id_of_public_key(wrapped).to_base58(), ""


def key_peer_id(der: bytes) -> str:
    """The peer id of a DER public key; raises ReceiptError for bytes that are not a canonical RSA key."""
    key, peer_id, problem = _load_public_key(der)
    if key is None:
        raise ReceiptError(f"public key: {problem}")
    return peer_id


def signer_of(data: bytes, signature: bytes, public_key: bytes) -> str:
    """The peer id whose key `public_key` (DER) made `signature` over `data` (RecordSigner.sign_bytes); raises
    ReceiptError for a key that is not a canonical RSA key or a signature that does not match."""
    key, peer_id, problem = _load_public_key(public_key)
    if key is None:
        raise ReceiptError(f"public key: {problem}")
    if not signature or not key.verify(data, base64.b64encode(signature)):
        raise ReceiptError(f"the signature does not match under {peer_id}'s key")
    return peer_id


def verify_record(record: HopRecord, public_key: bytes) -> tuple[str, str] | None:
    """None when `record` is signed by the key `public_key` (DER) and that key's peer id is the record's; else
    (check, detail) of what failed: check is "key", "peer_id" or "signature"."""
    key, peer_id, problem = _load_public_key(public_key)
    if key is None:
        return "key", problem
    if peer_id != record.peer_id:
        return "peer_id", f"the key's peer id is {peer_id}, the record names {record.peer_id}"
    if not record.signature or not key.verify(record.signed_bytes(), base64.b64encode(record.signature)):
        return "signature", f"the signature does not match the record under {peer_id}'s key"
    return None


# -- a client's receipts -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionLog:
    session_id: SessionId
    records: tuple[HopRecord, ...]  # in the order the client received them: the Merkle leaves' order
    root: bytes  # merkle_root of the records' encodings, as the client computed it when closing the session

    def proof(self, index: int) -> InclusionProof:
        """The inclusion proof of record `index` under the session root (check it with merkle.verify_proof and the
        record's `to_bytes()`), e.g. to show one window's record to a third party without the others."""
        return proof([record.to_bytes() for record in self.records], index)


def session_root(records: tuple[HopRecord, ...] | list[HopRecord]) -> bytes:
    """The Merkle session root over records' canonical encodings, in order."""
    return merkle_root([record.to_bytes() for record in records])


@dataclass(frozen=True)
class SessionReceipts:
    """A client's receipts: per session its records and root, the nodes' public keys by peer id, the fraction of
    windows the client re-executed (`audit_rate`, 0 when none) and free-text metadata. Nothing here says a node was
    right: signatures bind each node to what it claimed, re-execution at `audit_rate` is what tests the claims."""

    sessions: tuple[SessionLog, ...]
    keys: Mapping[str, bytes]  # peer id -> DER SubjectPublicKeyInfo
    audit_rate: float = 0.0
    metadata: Mapping[str, str] = field(default_factory=dict)

    def content(self) -> dict:
        """The file's JSON object without its digest (bytes as lowercase hex)."""
        return {
            "format": FILE_FORMAT,
            "audit_rate": self.audit_rate,
            "metadata": dict(self.metadata),
            "keys": {peer_id: der.hex() for peer_id, der in self.keys.items()},
            "sessions": [
                {
                    "session_id": log.session_id,
                    "root": log.root.hex(),
                    "records": [_record_json(record) for record in log.records],
                }
                for log in self.sessions
            ],
        }

    def digest(self) -> str:
        """SHA-256 (hex) of the domain and the compact canonical JSON of `content()`."""
        compact = json.dumps(self.content(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(DIGEST_DOMAIN + compact.encode()).hexdigest()

    def to_json(self, digest: str | None = None) -> str:
        """The canonical file text; `digest` replaces the computed one (to re-spell a loaded file as it claims)."""
        document = {**self.content(), "digest": self.digest() if digest is None else digest}
        return json.dumps(document, sort_keys=True, indent=1, ensure_ascii=True) + "\n"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json(), encoding="ascii")
        return path


def _record_json(record: HopRecord) -> dict:
    values = {item.name: getattr(record, item.name) for item in fields(record)}
    return {name: value.hex() if isinstance(value, bytes) else value for name, value in values.items()}


class ReceiptsBuilder:
    """A client's collector of records, session by session; `add` checks each record as it arrives."""

    def __init__(self):
        self._records: dict[str, list[HopRecord]] = {}
        self._keys: dict[str, bytes] = {}

    def add(self, record: HopRecord, public_key: bytes) -> None:
        """Keep `record`, signed by the node whose DER public key is `public_key`. Raises ReceiptError when the
        record is out of bounds, the key is not the record's peer id or the signature does not match (the node is
        faulty: a client bans it like one that sent a malformed tensor)."""
        record.check()
        failure = verify_record(record, public_key)
        if failure is not None:
            raise ReceiptError(f"record of {record.peer_id}: {failure[0]}: {failure[1]}")
        self._keys[record.peer_id] = public_key
        self._records.setdefault(record.session_id, []).append(record)

    def receipts(self, *, audit_rate: float = 0.0, metadata: Mapping[str, str] | None = None) -> SessionReceipts:
        """The receipts of every session so far, each with its root computed now."""
        if not 0.0 <= audit_rate <= 1.0:
            raise ValueError(f"audit_rate is a fraction in [0, 1], got {audit_rate}")
        sessions = tuple(
            SessionLog(SessionId(session_id), tuple(records), session_root(records))
            for session_id, records in self._records.items()
        )
        return SessionReceipts(sessions, dict(self._keys), float(audit_rate), dict(metadata or {}))


# -- reading a file ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedReceipts:
    receipts: SessionReceipts
    digest: str  # as written in the file
    canonical: bool  # the file's text is exactly `receipts.to_json(digest)`


def parse_receipts(text: str) -> LoadedReceipts:
    """Read a receipts file's text; raises ReceiptError for anything that is not one (not JSON, a key missing or
    unknown, a value of the wrong type or out of bounds, hex that is not lowercase)."""
    try:
        document = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (json.JSONDecodeError, RecursionError) as error:
        raise ReceiptError(f"not a receipts file: not JSON ({error})") from None
    _expect_keys(document, {"format", "audit_rate", "metadata", "keys", "sessions", "digest"}, "file")
    if document["format"] != FILE_FORMAT:
        raise ReceiptError(f"format {document['format']!r}, expected {FILE_FORMAT!r}")
    rate = document["audit_rate"]
    if type(rate) not in (int, float) or not (math.isfinite(rate) and 0 <= rate <= 1):
        raise ReceiptError(f"audit_rate must be a number in [0, 1], got {rate!r}")
    metadata = document["metadata"]
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise ReceiptError("metadata must be an object of strings")
    keys = document["keys"]
    if not isinstance(keys, dict):
        raise ReceiptError("keys must be an object of peer id: public key hex")
    keys = {peer_id: _hex(value, f"key of {peer_id}") for peer_id, value in keys.items()}
    if not isinstance(document["sessions"], list):
        raise ReceiptError("sessions must be a list")
    sessions = tuple(_parse_session(entry, number) for number, entry in enumerate(document["sessions"]))
    if not isinstance(document["digest"], str):
        raise ReceiptError("digest must be a hex string")
    receipts = SessionReceipts(sessions, keys, float(rate), metadata)
    digest = document["digest"]
    return LoadedReceipts(receipts, digest, canonical=receipts.to_json(digest) == text)


def load_receipts(path: str | Path) -> LoadedReceipts:
    """`parse_receipts` of a file; raises OSError when it cannot be read, ReceiptError when it is not ASCII."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as error:
        raise ReceiptError(f"{path}: not a receipts file (byte {error.start} is not ASCII)") from None
    return parse_receipts(text)


def _parse_session(entry, number: int) -> SessionLog:
    _expect_keys(entry, {"session_id", "root", "records"}, f"session {number}")
    if not isinstance(entry["records"], list) or not isinstance(entry["session_id"], str):
        raise ReceiptError(f"session {number}: session_id must be a string and records a list")
    root = _hex(entry["root"], f"session {number} root")
    if len(root) != 32:
        raise ReceiptError(f"session {number}: root must be 32 bytes")
    records = tuple(
        _parse_record(item, f"session {number} record {index}") for index, item in enumerate(entry["records"])
    )
    return SessionLog(SessionId(entry["session_id"]), records, root)


def _parse_record(item, where: str) -> HopRecord:
    names = {entry.name for entry in fields(HopRecord)}
    _expect_keys(item, names, where)
    values = dict(item)
    for name in ("input_hash", "commitment", "signature"):
        values[name] = _hex(values[name], f"{where} {name}")
    record = HopRecord(**values)
    try:
        record.check()
    except ReceiptError as error:
        raise ReceiptError(f"{where}: {error.message}") from None
    return record


def _expect_keys(value, names: set[str], where: str) -> None:
    if not isinstance(value, dict):
        raise ReceiptError(f"{where}: expected an object")
    if set(value) != names:
        missing, unknown = sorted(names - set(value)), sorted(set(value) - names)
        raise ReceiptError(f"{where}: missing keys {missing}, unknown keys {unknown}")


def _hex(value, where: str) -> bytes:
    if not isinstance(value, str) or len(value) % 2 or not re.fullmatch(r"[0-9a-f]*", value):
        raise ReceiptError(f"{where} must be lowercase hex")
    return bytes.fromhex(value)


def _unique_keys(pairs: list) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ReceiptError("a JSON object repeats a key")
    return result


def _no_constant(name: str):
    raise ReceiptError(f"{name} is not a number a receipts file may hold")
