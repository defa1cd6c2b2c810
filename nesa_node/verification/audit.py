"""Offline audit of a client's receipts: every signature, every key's peer id, every session root.

`audit(receipts)` checks a `SessionReceipts`; `audit_text(text)` / `audit_file(path)` first read a receipts file
(ReceiptError when it is not one) and add the file's own checks: its digest, and that its text is the canonical
spelling of what it holds (an edit that keeps the JSON equal, such as re-indenting or upper-case hex, still fails,
so that no byte of the file can change unnoticed). Each failure says where (file, session, record with its hop,
window and peer) and what failed:

    key        a public key that is not a canonical RSA key, or whose peer id is not the one it is listed under
    peer_id    a record whose peer has no key in the file
    signature  a record's signature does not match it under its peer's key
    session_id a record filed under another session than its own
    root       the Merkle root recomputed from a session's records is not the one stored
    digest     the file's digest is not the SHA-256 of its content
    canonical  the file's text is not the canonical spelling of its content

An audit says the records are intact and signed by the nodes they name; whether the nodes computed correctly is
what re-execution (commitment.compare) tests, at the rate the receipts record.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nesa_node.errors import ReceiptError
from nesa_node.verification.receipts import (
    LoadedReceipts,
    SessionReceipts,
    key_peer_id,
    load_receipts,
    parse_receipts,
    session_root,
    verify_record,
)


@dataclass(frozen=True)
class AuditFailure:
    where: str  # "file", "key <peer id>", "session <id>" or "session <id> record <n> (hop, window, peer)"
    check: str  # one of the checks in the module docstring
    detail: str


@dataclass(frozen=True)
class AuditReport:
    records: int
    sessions: int
    nodes: int  # distinct peer ids among the records
    roots_ok: int  # sessions whose recomputed root is the stored one
    audit_rate: float  # the fraction of windows the client says it re-executed
    failures: tuple[AuditFailure, ...]

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "records": self.records,
            "sessions": self.sessions,
            "nodes": self.nodes,
            "roots_ok": self.roots_ok,
            "audit_rate": self.audit_rate,
            "failures": [{"where": item.where, "check": item.check, "detail": item.detail} for item in self.failures],
        }


def audit(receipts: SessionReceipts) -> AuditReport:
    """Check every key, record signature and session root of `receipts`; never raises for bad content."""
    failures: list[AuditFailure] = []
    for peer_id, der in receipts.keys.items():
        try:
            actual = key_peer_id(der)
        except ReceiptError as error:
            failures.append(AuditFailure(f"key {peer_id}", "key", error.message))
            continue
        if actual != peer_id:
            failures.append(AuditFailure(f"key {peer_id}", "key", f"the key's peer id is {actual}"))
    records = roots_ok = 0
    peers = set()
    for log in receipts.sessions:
        for number, record in enumerate(log.records):
            records += 1
            peers.add(record.peer_id)
            where = (
                f"session {log.session_id} record {number} (hop {record.hop}, window {record.window}, "
                f"peer {record.peer_id})"
            )
            if record.session_id != log.session_id:
                failures.append(AuditFailure(where, "session_id", f"the record is of session {record.session_id}"))
            der = receipts.keys.get(record.peer_id)
            if der is None:
                failures.append(AuditFailure(where, "peer_id", "no public key for this peer in the file"))
                continue
            failure = verify_record(record, der)
            if failure is not None:
                failures.append(AuditFailure(where, *failure))
        root = session_root(log.records)
        if root == log.root:
            roots_ok += 1
        else:
            failures.append(
                AuditFailure(
                    f"session {log.session_id}",
                    "root",
                    f"recomputed root {root.hex()} over {len(log.records)} records, stored {log.root.hex()}",
                )
            )
    return AuditReport(
        records=records,
        sessions=len(receipts.sessions),
        nodes=len(peers),
        roots_ok=roots_ok,
        audit_rate=receipts.audit_rate,
        failures=tuple(failures),
    )


def audit_text(text: str) -> AuditReport:
    """Audit a receipts file's text: its digest and canonical form, then `audit`. Raises ReceiptError when the text
    is not a receipts file at all."""
    return _with_file_checks(parse_receipts(text))


def audit_file(path: str | Path) -> AuditReport:
    """`audit_text` of a file; raises OSError when it cannot be read, ReceiptError when it is not a receipts file."""
    return _with_file_checks(load_receipts(path))


def _with_file_checks(loaded: LoadedReceipts) -> AuditReport:
    report = audit(loaded.receipts)
    failures = []
    expected = loaded.receipts.digest()
    if loaded.digest != expected:
        failures.append(AuditFailure("file", "digest", f"stored {loaded.digest!r:.80}, content hashes to {expected}"))
    if not loaded.canonical:
        failures.append(
            AuditFailure("file", "canonical", "the text is not the canonical spelling of its content (edited?)")
        )
    return AuditReport(
        records=report.records,
        sessions=report.sessions,
        nodes=report.nodes,
        roots_ok=report.roots_ok,
        audit_rate=report.audit_rate,
        failures=tuple(failures) + report.failures,
    )
