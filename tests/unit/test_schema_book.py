"""Schema books and swarm recordings on disk (nesa_node.schema_book) and `nesa-node schema build|show` on them."""

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nesa_node.cli import main
from nesa_node.errors import SchemaBookError
from nesa_node.schema_book import (
    MAX_BOOK_BYTES,
    book_digest,
    load_book,
    read_recording,
    recording_line,
    save_book,
)
from nesa_node.swarm_view import build_snapshot
from nesa_node.topology.schemas import apply_schema
from tests.support import topology_states


@pytest.fixture(scope="module")
def book():
    return topology_states.make_book()


def test_a_saved_book_loads_with_the_same_digest_and_assignments(book, tmp_path):
    path = tmp_path / "book.json"
    save_book(book, path)
    again = load_book(path, num_blocks=4)
    assert book_digest(again) == book_digest(book) and again.radius == book.radius
    assert [name for name in os.listdir(tmp_path)] == ["book.json"]  # no temporary file left
    for state in topology_states.STATES:
        snapshot = build_snapshot(topology_states.state_records(state, topology_states.default_starts(state)), 4)
        assert apply_schema(snapshot, again).starts == apply_schema(snapshot, book).starts


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a schema book"),
        (b"{", "not a schema book"),
        (b"\xff\xfe", "not a schema book"),
        (b"[1, 2]", "must be an object"),
        (b"[" * 100_000, "not a schema book"),  # nesting past the parser's recursion limit
        (json.dumps({"format": "nesa-schema-book/1"}).encode(), "lacks"),
    ],
)
def test_a_file_that_is_no_book_is_a_typed_error_naming_it(tmp_path, content, message):
    path = tmp_path / "book.json"
    path.write_bytes(content)
    with pytest.raises(SchemaBookError, match=message) as raised:
        load_book(path)
    assert str(path) in str(raised.value) and raised.value.code == "schema_book"


def test_missing_oversized_and_other_models_books_are_refused(book, tmp_path):
    with pytest.raises(SchemaBookError, match="cannot read"):
        load_book(tmp_path / "missing.json")
    big = tmp_path / "big.json"
    with big.open("wb") as file:
        file.truncate(MAX_BOOK_BYTES + 1)
    with pytest.raises(SchemaBookError, match="over"):
        load_book(big)
    path = tmp_path / "book.json"
    save_book(book, path)
    with pytest.raises(SchemaBookError, match="for 4 blocks"):
        load_book(path, num_blocks=32)


def test_a_recording_reads_back_its_snapshots(tmp_path):
    path = tmp_path / "swarm.jsonl"
    states = list(topology_states.STATES)
    with path.open("w") as file:
        for index, state in enumerate(states):
            infos = topology_states.state_records(state, topology_states.default_starts(state))
            file.write(recording_line(infos, 4, 1_700_000_000.0 + index))
            file.write("\n")  # blank lines are skipped
    recorded = read_recording(path)
    assert [entry.time_s for entry in recorded] == [1_700_000_000.0, 1_700_000_001.0]
    assert [len(entry.records) for entry in recorded] == [6, 6]
    assert recorded[0].records == tuple(topology_states.state_records("atlantic", topology_states.default_starts(
        "atlantic")))  # fmt: skip
    assert recorded[1].snapshot().num_blocks == 4


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[]", "expected an object"),
        ('{"time": -1, "num_blocks": 4, "records": []}', "time"),
        ('{"time": 1, "num_blocks": true, "records": []}', "num_blocks"),
        ('{"time": 1, "num_blocks": 4, "records": {}}', "records"),
        ('{"time": 1, "num_blocks": 4, "records": [{"peer_id": "a"}]}', "record 0"),
        ('{"time": 1, "num_blocks": 8, "records": []}', "one recording holds one model"),
    ],
)
def test_a_bad_recording_line_is_named(tmp_path, line, message):
    path = tmp_path / "swarm.jsonl"
    path.write_text(recording_line([], 4, 1.0) + line + "\n")
    with pytest.raises(SchemaBookError, match=message) as raised:
        read_recording(path)
    assert f"{path}:2" in str(raised.value)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400))
def test_any_bytes_in_a_recording_or_book_give_a_typed_error_or_a_valid_result(tmp_path, data):
    path = tmp_path / "any"
    path.write_bytes(data)
    for read in (read_recording, load_book):
        try:
            read(path)
        except SchemaBookError:
            pass


def test_schema_build_and_show_from_a_recording(tmp_path, capsys):
    recording = tmp_path / "swarm.jsonl"
    rng = np.random.default_rng(5)
    lines = [
        recording_line(
            topology_states.state_records(state, topology_states.default_starts(state), rng=rng), 4, 1e9 + 60 * i
        )
        for i, state in enumerate(["atlantic", "pacific"] * 4)
    ]
    recording.write_text("".join(lines))
    out = tmp_path / "book.json"
    assert main(["schema", "build", str(recording), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    book = load_book(out)
    assert len(book.schemas) == 2 and f"book {book_digest(book)}" in printed and "2 topology classes" in printed
    assert main(["schema", "show", str(out), "--recording", str(recording)]) == 0
    shown = capsys.readouterr().out.splitlines()
    classes = [line.split("class ")[1].split()[0] for line in shown if "nodes, class" in line]
    assert len(classes) == 8 and classes[0::2] == [classes[0]] * 4 and classes[1::2] == [classes[1]] * 4
    assert classes[0] != classes[1]
    # too few snapshots, and a bad recording: one error line, status 2
    short = tmp_path / "short.jsonl"
    short.write_text("".join(lines[:2]))
    assert main(["schema", "build", str(short), "--out", str(tmp_path / "x.json")]) == 2
    assert "[schema_book] a book needs at least 3 snapshots" in capsys.readouterr().err
    short.write_text("{")
    assert main(["schema", "show", str(out), "--recording", str(short)]) == 2
    assert f"[schema_book] {short}:1: not JSON" in capsys.readouterr().err
