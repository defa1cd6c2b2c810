"""Topology schema books and swarm recordings on disk: what `nesa-node schema` writes and `nesa-node run
--schema-book` reads (the book itself, its classes and templates: topology/schemas.py).

- A recording is JSON lines, one snapshot of the swarm a line: {"time": unix seconds, "num_blocks": B, "records":
  [NodeInfo, ...]}, the nodes' records as they were on the DHT (`nesa-node schema record`). Snapshots are rebuilt
  from them with swarm_view.build_snapshot, as a node's rebalancer builds its own.
- A book is one JSON object (topology.schemas.book_to_dict), written atomically. Its digest (sha256 of its canonical
  JSON, 16 hex characters) names it in logs, so an operator can tell that every node reads the same book: nodes
  that read different books plan different moves.

Every file is read with a size bound and checked field by field; anything else is a SchemaBookError naming the file
(and the line of a recording).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from nesa_node.errors import SchemaBookError
from nesa_node.files import write_atomically
from nesa_node.protocol.records import NodeInfo
from nesa_node.routing.snapshot import SwarmSnapshot
from nesa_node.swarm_view import build_snapshot
from nesa_node.topology.schemas import SchemaBook, book_from_dict, book_to_dict

MAX_BOOK_BYTES = 16 << 20  # 256 classes of a 100,000-node template fit; a book of a real swarm is kilobytes
MAX_RECORDING_BYTES = 1 << 30  # a day of one-minute snapshots of a 1,000-node swarm is ~2 GiB: split by days
MAX_RECORDS_PER_SNAPSHOT = 100_000

__all__ = [
    "RecordedSnapshot",
    "book_digest",
    "load_book",
    "read_recording",
    "recording_line",
    "save_book",
]


def _canonical(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def book_digest(book: SchemaBook) -> str:
    """sha256 of the book's canonical JSON, first 16 hex characters."""
    return hashlib.sha256(_canonical(book_to_dict(book))).hexdigest()[:16]


def save_book(book: SchemaBook, path: str | Path) -> None:
    """Write the book as JSON, atomically (a temporary file in the same folder, fsynced, then renamed)."""
    write_atomically(path, json.dumps(book_to_dict(book), indent=1, allow_nan=False).encode() + b"\n")


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    try:
        with path.open("rb") as file:
            data = file.read(limit + 1)
    except OSError as error:
        raise SchemaBookError(f"cannot read {what} {path}: {error.strerror or error}") from None
    if len(data) > limit:
        raise SchemaBookError(f"{what} {path} is over {limit} bytes")
    return data


def load_book(path: str | Path, *, num_blocks: int | None = None) -> SchemaBook:
    """The book in `path`, checked field by field; `num_blocks`, when given, must be the book's. Raises
    SchemaBookError naming the file and what is wrong."""
    path = Path(path)
    data = _read_bounded(path, MAX_BOOK_BYTES, "schema book")
    try:
        book = book_from_dict(json.loads(data))
    except (ValueError, RecursionError) as error:  # json's JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SchemaBookError(f"{path} is not a schema book: {error}") from None
    if num_blocks is not None and book.num_blocks != num_blocks:
        raise SchemaBookError(f"{path} is a schema book for {book.num_blocks} blocks; this model has {num_blocks}")
    return book


@dataclass(frozen=True)
class RecordedSnapshot:
    time_s: float  # unix time of the read
    num_blocks: int
    records: tuple[NodeInfo, ...]

    def snapshot(self) -> SwarmSnapshot:
        """The snapshot a node's rebalancer would build from these records (no client measurements)."""
        return build_snapshot(self.records, self.num_blocks)


def recording_line(infos: list[NodeInfo], num_blocks: int, time_s: float) -> str:
    """One line of a recording (newline included)."""
    records = [json.loads(info.to_wire()) for info in infos]
    return json.dumps({"time": time_s, "num_blocks": num_blocks, "records": records}, allow_nan=False) + "\n"


def _recorded(value, where: str) -> RecordedSnapshot:
    if not isinstance(value, dict) or not {"time", "num_blocks", "records"} <= value.keys():
        raise SchemaBookError(f"{where}: expected an object with time, num_blocks and records")
    time_s, num_blocks, records = value["time"], value["num_blocks"], value["records"]
    if isinstance(time_s, bool) or not isinstance(time_s, int | float) or not 0 <= time_s < 1e11:
        raise SchemaBookError(f"{where}: time must be unix seconds")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 1 <= num_blocks <= 100_000:
        raise SchemaBookError(f"{where}: num_blocks must be an integer in [1, 100000]")
    if not isinstance(records, list) or len(records) > MAX_RECORDS_PER_SNAPSHOT:
        raise SchemaBookError(f"{where}: records must be a list of at most {MAX_RECORDS_PER_SNAPSHOT} node records")
    infos = []
    for index, record in enumerate(records):
        try:
            infos.append(NodeInfo.from_wire(json.dumps(record)))
        except (ValueError, TypeError, RecursionError) as error:
            raise SchemaBookError(f"{where}: record {index} is not a node record: {error}") from None
    return RecordedSnapshot(float(time_s), num_blocks, tuple(infos))


def read_recording(path: str | Path) -> list[RecordedSnapshot]:
    """Every snapshot of a recording, in file order (blank lines skipped). Raises SchemaBookError naming the file and
    line of the first bad one, or when snapshots of different models (numbers of blocks) are mixed."""
    path = Path(path)
    data = _read_bounded(path, MAX_RECORDING_BYTES, "swarm recording")
    snapshots: list[RecordedSnapshot] = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as error:
            raise SchemaBookError(f"{where}: not JSON ({error})") from None
        snapshots.append(_recorded(value, where))
        if snapshots[-1].num_blocks != snapshots[0].num_blocks:
            raise SchemaBookError(
                f"{where}: a snapshot of {snapshots[-1].num_blocks} blocks among ones of "
                f"{snapshots[0].num_blocks}: one recording holds one model"
            )
    return snapshots
