"""Signed hop records, Merkle session roots and receipts files (nesa_node/verification): issue 24 item 2's acceptance,
"flipping one byte of any receipt or leaf changes the root and fails `nesa-node audit`", checked at every byte."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.errors import ReceiptError
from nesa_node.protocol.identity import ensure_identity, load_private_key, peer_id_of_identity
from nesa_node.verification.audit import audit, audit_file, audit_text
from nesa_node.verification.commitment import commit_window, input_hash
from nesa_node.verification.merkle import InclusionProof, merkle_root, proof, verify_proof
from nesa_node.verification.receipts import (
    HopRecord,
    ReceiptsBuilder,
    RecordSigner,
    SessionReceipts,
    parse_receipts,
    session_root,
    sign_record,
    verify_record,
)

FEW = settings(max_examples=40, deadline=None)
leaf_lists = st.lists(st.binary(max_size=12), max_size=19)


# -- Merkle roots and proofs ------------------------------------------------------------------------------------


@FEW
@given(leaf_lists)
def test_every_proof_verifies_and_fails_once_tampered(leaves):
    root = merkle_root(leaves)
    for index, leaf in enumerate(leaves):
        inclusion = proof(leaves, index)
        assert verify_proof(leaf, inclusion, root)
        assert not verify_proof(leaf + b"\x00", inclusion, root)
        for other in {index - 1, index + 1} & set(range(len(leaves))):
            if leaves[other] != leaf:
                assert not verify_proof(leaf, dataclasses.replace(inclusion, index=other), root)
        assert not verify_proof(leaf, dataclasses.replace(inclusion, count=len(leaves) + 1), root)
        for position, sibling in enumerate(inclusion.siblings):
            for byte in range(32):
                bad = bytearray(sibling)
                bad[byte] ^= 0x01
                siblings = (*inclusion.siblings[:position], bytes(bad), *inclusion.siblings[position + 1 :])
                assert not verify_proof(leaf, dataclasses.replace(inclusion, siblings=siblings), root)
        assert not verify_proof(leaf, dataclasses.replace(inclusion, siblings=(*inclusion.siblings, root[:32])), root)
        if inclusion.siblings:
            assert not verify_proof(leaf, dataclasses.replace(inclusion, siblings=inclusion.siblings[:-1]), root)
    with pytest.raises(IndexError):
        proof(leaves, len(leaves))


@FEW
@given(st.lists(st.binary(min_size=1, max_size=6), min_size=1, max_size=9), st.data())
def test_flipping_any_byte_of_any_leaf_changes_the_root(leaves, data):
    root = merkle_root(leaves)
    index = data.draw(st.integers(0, len(leaves) - 1))
    for position in range(len(leaves[index])):
        for bit in (0x01, 0x80):
            changed = bytearray(leaves[index])
            changed[position] ^= bit
            assert merkle_root([*leaves[:index], bytes(changed), *leaves[index + 1 :]]) != root


def test_odd_counts_are_not_padded_duplicates():
    a, b, c = b"a", b"b", b"c"
    assert merkle_root([a, b, c]) != merkle_root([a, b, c, c])  # CVE-2012-2459: Bitcoin's trees make these equal
    assert merkle_root([a, b, c, c]) != merkle_root([a, b, c, c, c, c])
    roots = {merkle_root([b"x"] * count) for count in range(0, 17)}
    assert len(roots) == 17  # the leaf count is bound into the root
    assert merkle_root([a, b]) != merkle_root([b, a])  # order is part of the session
    assert verify_proof(c, proof([a, b, c], 2), merkle_root([a, b, c]))
    assert len(proof([a, b, c], 2).siblings) == 1  # promoted at the first level: one sibling, not a copy of itself
    assert not verify_proof(
        c, InclusionProof(index=3, count=4, siblings=proof([a, b, c], 2).siblings), merkle_root([a, b, c])
    )


# -- records -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def identities(tmp_path_factory) -> list:
    folder = tmp_path_factory.mktemp("identities")
    return [ensure_identity(folder / f"node{index}.key") for index in range(2)]


@pytest.fixture(scope="module")
def signers(identities) -> list[RecordSigner]:
    signers = [RecordSigner(load_private_key(path)) for path in identities]
    assert [signer.peer_id for signer in signers] == [peer_id_of_identity(path).to_base58() for path in identities]
    return signers


def _record(session: str, hop: int, window: int, seed: int) -> HopRecord:
    generator = torch.Generator().manual_seed(seed)
    received = torch.randn(1, 32, 64, generator=generator)  # (batch, tokens, hidden)
    answered = torch.randn(1, 32, 64, generator=generator)
    return HopRecord(
        session_id=session,
        hop=hop,
        span_start=2 * hop,
        span_end=2 * hop + 2,
        window=window,
        token_start=32 * window,
        token_end=32 * window + 32,
        input_hash=input_hash(received),
        commitment=commit_window(answered).to_bytes(),
        weights_hash="0123456789abcdef",
        adapter_hash="" if hop else "a" * 64,
        codec="blockwise8",
        peer_id="unsigned",
    )


@pytest.fixture(scope="module")
def receipts(signers) -> SessionReceipts:
    """Two sessions: three records (an odd count) over two nodes, and one record."""
    builder = ReceiptsBuilder()
    for session, hop, window in (("s-1", 0, 0), ("s-1", 1, 0), ("s-1", 0, 1), ("s-2", 1, 0)):
        signer = signers[hop]
        builder.add(signer.sign(_record(session, hop, window, seed=hop + 10 * window)), signer.public_key)
    return builder.receipts(audit_rate=0.25, metadata={"client": "test"})


def test_records_round_trip_and_are_signed_by_their_peer(identities, signers, receipts):
    record = receipts.sessions[0].records[0]
    assert record.peer_id == signers[0].peer_id
    assert HopRecord.from_bytes(record.to_bytes()) == record
    assert verify_record(record, signers[0].public_key) is None
    assert verify_record(record, signers[1].public_key)[0] == "peer_id"
    assert verify_record(dataclasses.replace(record, hop=3), signers[0].public_key)[0] == "signature"
    assert verify_record(record, signers[0].public_key[:-1])[0] == "key"
    resigned = sign_record(record, load_private_key(identities[1]))
    assert resigned.peer_id == signers[1].peer_id and verify_record(resigned, signers[1].public_key) is None
    assert len(record.to_bytes()) < 700  # measured 578: 198 commitment, 256 signature


def test_every_single_byte_change_of_a_record_is_refused_or_fails_its_signature(signers, receipts):
    record = receipts.sessions[0].records[1]
    data = record.to_bytes()
    for position in range(len(data)):
        for replacement in {data[position] ^ 0x01, data[position] ^ 0x80} - {data[position]}:
            try:
                changed = HopRecord.from_bytes(data[:position] + bytes([replacement]) + data[position + 1 :])
            except ReceiptError:
                continue
            assert changed != record
            assert verify_record(changed, signers[1].public_key) is not None, position


def test_every_single_byte_change_of_a_signature_fails(signers, receipts):
    record = receipts.sessions[0].records[0]
    for position in range(len(record.signature)):
        signature = bytearray(record.signature)
        signature[position] ^= 0x01
        changed = dataclasses.replace(record, signature=bytes(signature))
        assert verify_record(changed, signers[0].public_key)[0] == "signature", position


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=900))
def test_fuzzed_record_bytes_raise_only_the_typed_error(data):
    try:
        HopRecord.from_bytes(data)
    except ReceiptError:
        pass


msgpack_ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
field_values = st.one_of(
    st.none(),
    st.booleans(),
    msgpack_ints,
    st.floats(),
    st.text(max_size=140),
    st.binary(max_size=300),
    st.lists(msgpack_ints, max_size=3),
    st.dictionaries(st.text(max_size=3), msgpack_ints, max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_records_with_fuzzed_fields_raise_only_the_typed_error(signers, data):
    items = msgpack.unpackb(signers[0].sign(_record("s", 0, 0, seed=2)).to_bytes())
    for index in data.draw(st.sets(st.integers(0, len(items) - 1), min_size=1, max_size=3)):
        items[index] = data.draw(field_values)
    try:
        HopRecord.from_bytes(msgpack.packb(items, use_bin_type=True))
    except ReceiptError:
        pass


def test_records_out_of_bounds_are_refused(signers):
    good = signers[0].sign(_record("s", 0, 0, seed=1))
    for change in (
        {"hop": -1},
        {"hop": True},
        {"span_end": 0},
        {"token_end": 0},
        {"input_hash": b"\x00" * 31},
        {"commitment": b"\x01" * 20},
        {"session_id": "has space"},
        {"peer_id": "0OIl"},
        {"codec": ""},
    ):
        with pytest.raises(ReceiptError):
            dataclasses.replace(good, **change).check()
    with pytest.raises(ReceiptError, match="not signed"):
        HopRecord.from_bytes(dataclasses.replace(good, signature=b"").to_bytes())
    builder = ReceiptsBuilder()
    with pytest.raises(ReceiptError, match="peer_id"):
        builder.add(good, signers[1].public_key)
    with pytest.raises(ReceiptError, match="signature"):
        builder.add(dataclasses.replace(good, window=1), signers[0].public_key)


# -- receipts files and the audit --------------------------------------------------------------------------------


def test_a_saved_file_loads_and_audits_clean(receipts, tmp_path):
    path = receipts.save(tmp_path / "receipts.json")
    report = audit_file(path)
    assert report.ok and (report.records, report.sessions, report.nodes, report.roots_ok) == (4, 2, 2, 2)
    loaded = parse_receipts(path.read_text())
    assert loaded.canonical and loaded.receipts == receipts
    first = receipts.sessions[0]
    assert first.root == session_root(first.records)
    for index, record in enumerate(first.records):  # one window's record shown without the others
        assert verify_proof(record.to_bytes(), first.proof(index), first.root)
        assert not verify_proof(first.records[index - 1].to_bytes(), first.proof(index), first.root)
    assert "verified" not in path.read_text().lower()


def test_flipping_any_byte_of_the_file_fails_the_audit(receipts):
    """Every byte of a receipts file, changed to another ASCII byte: the file no longer reads, or a check fails."""
    text = receipts.to_json()
    for position in range(len(text)):
        replacement = chr(ord(text[position]) ^ 0x01)
        try:
            report = audit_text(text[:position] + replacement + text[position + 1 :])
        except ReceiptError:
            continue
        assert not report.ok, (position, text[max(0, position - 30) : position + 30])


def test_a_reformatted_file_fails_only_as_not_canonical(receipts):
    document = json.loads(receipts.to_json())
    for text in (json.dumps(document, indent=2, sort_keys=True), json.dumps(document)):
        report = audit_text(text)
        assert [failure.check for failure in report.failures] == ["canonical"]
    upper = receipts.to_json().replace(receipts.sessions[0].root.hex(), receipts.sessions[0].root.hex().upper())
    with pytest.raises(ReceiptError, match="lowercase"):
        audit_text(upper)


def test_failures_name_the_record_and_the_check(signers, receipts):
    first, second = receipts.sessions
    edited = dataclasses.replace(first.records[2], token_end=first.records[2].token_end + 1)
    tampered = dataclasses.replace(first, records=(*first.records[:2], edited))
    report = audit(dataclasses.replace(receipts, sessions=(tampered, second)))
    assert [(failure.check, failure.where.split(" (")[0]) for failure in report.failures] == [
        ("signature", "session s-1 record 2"),
        ("root", "session s-1"),
    ]
    assert report.roots_ok == 1

    moved = dataclasses.replace(second, records=(first.records[0],), root=session_root([first.records[0]]))
    report = audit(dataclasses.replace(receipts, sessions=(first, moved)))
    assert [failure.check for failure in report.failures] == ["session_id"]

    reordered = dataclasses.replace(first, records=first.records[::-1])
    report = audit(dataclasses.replace(receipts, sessions=(reordered, second)))
    assert [failure.check for failure in report.failures] == ["root"]

    keys = dict(receipts.keys)
    keys[signers[0].peer_id], keys[signers[1].peer_id] = keys[signers[1].peer_id], keys[signers[0].peer_id]
    report = audit(dataclasses.replace(receipts, keys=keys))
    assert {failure.check for failure in report.failures} == {"key", "peer_id"}
    assert sum(failure.check == "key" for failure in report.failures) == 2

    without = {signers[1].peer_id: receipts.keys[signers[1].peer_id]}
    report = audit(dataclasses.replace(receipts, keys=without))
    assert [failure.check for failure in report.failures] == ["peer_id", "peer_id"]  # node 0's two records


def test_malformed_files_raise_the_typed_error(receipts):
    document = json.loads(receipts.to_json())
    for bad in (
        "",
        "[]",
        '{"format": 1}',
        json.dumps({**document, "format": "nesa-receipts/2"}),
        json.dumps({**document, "extra": 1}),
        json.dumps({**document, "audit_rate": 2}),
        json.dumps({**document, "audit_rate": float("nan")}),
        json.dumps({**document, "keys": {"x": "ABCD"}}),
        receipts.to_json().replace('"format"', '"format": "x", "format"', 1),
        json.dumps({**document, "sessions": [{"session_id": "s", "root": "00", "records": []}]}),
        "[" * 100_000,
    ):
        with pytest.raises(ReceiptError):
            audit_text(bad)


@pytest.mark.cli
def test_the_audit_command(receipts, tmp_path):
    good = receipts.save(tmp_path / "good.json")
    text = good.read_text()
    position = text.index('"signature": "') + len('"signature": "') + 10
    flipped = tmp_path / "flipped.json"
    flipped.write_text(text[:position] + ("0" if text[position] != "0" else "1") + text[position + 1 :])
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x00\xff not receipts")

    def nesa_audit(*args):
        return subprocess.run(
            [sys.executable, "-m", "nesa_node.cli", "audit", *args],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )

    result = nesa_audit(str(good))
    assert result.returncode == 0, result.stderr
    assert "4 records from 2 nodes in 2 sessions" in result.stdout and "roots 2/2" in result.stdout
    result = nesa_audit(str(flipped), "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert not report["ok"] and {failure["check"] for failure in report["failures"]} == {"signature", "root", "digest"}
    for path in (garbage, tmp_path / "missing.json"):
        result = nesa_audit(str(path))
        assert result.returncode == 2, result.stdout
        assert "Traceback" not in result.stderr and result.stderr.startswith("error: [")
