"""`nesa-node schema`: the topology schema book of a swarm (Nesa sec. 2.7.1; topology/schemas.py).

A swarm goes through a few topological states (regions up and down, clusters joining, slow backbones). A schema book
holds, for each state seen, a block assignment computed ahead; nodes given the book (`nesa-node run --schema-book`)
classify every snapshot of the swarm and, when its class changes, move toward that class's assignment instead of
planning from scratch. Three steps:

    nesa-node schema record --model ./model --initial-peers ... --out swarm.jsonl --every 60   # days, in all states
    nesa-node schema build swarm.jsonl --out book.json
    nesa-node run ... --schema-book book.json          # every node the same book

`record` appends the nodes' records as read from the DHT, one snapshot a line; `build` clusters the snapshots into
topology classes (k-medoids on their H0 persistence diagrams, the number of classes by silhouette unless
`--classes` is given) and keeps each class's best block assignment; `show` prints a book and, with `--recording`,
the class of every recorded snapshot (or "far": a state the book does not know, for which nodes recompute).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from nesa_node.cli.options import PARSERS


def add_parser(commands, add_peer_args) -> None:
    schema = commands.add_parser(
        "schema",
        help="record the swarm's topology states and build the schema book nodes rebalance by",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = schema.add_subparsers(dest="schema_command", required=True)
    record = actions.add_parser(
        "record",
        help="append snapshots of the swarm's records to a recording (JSON lines)",
        description="Read every node's record from the DHT every --every seconds and append them to --out as one "
        "line. Stops after --count snapshots, or at Ctrl-C or SIGTERM (every line written is complete).",
    )
    add_peer_args(record)
    record.add_argument("--out", required=True, metavar="FILE", help="recording to append to (JSON lines)")
    record.add_argument(
        "--every", type=PARSERS["positive"], default=60.0, metavar="S", help="seconds between snapshots (default 60)"
    )
    record.add_argument(
        "--count", type=PARSERS["positive_int"], default=None, metavar="N", help="snapshots to take (default: until "
        "stopped)"
    )  # fmt: skip
    build = actions.add_parser(
        "build",
        help="build a schema book from recordings",
        description="Cluster the recorded snapshots into topology classes and keep each class's best block "
        "assignment, as a schema book for `nesa-node run --schema-book`.",
    )
    build.add_argument("recordings", nargs="+", metavar="RECORDING", help="recordings of one model (JSON lines)")
    build.add_argument("--out", required=True, metavar="FILE", help="where to write the book (JSON)")
    build.add_argument(
        "--classes",
        type=PARSERS["positive_int"],
        default=None,
        metavar="K",
        help="number of topology classes (default: the best silhouette among 2 to 8)",
    )
    build.add_argument("--seed", type=int, default=0, help="seed of the clustering's restarts (default 0)")
    build.add_argument(
        "--far-factor",
        type=float,
        default=None,
        metavar="F",
        help="a snapshot further than F times the book's widest class spread from every class is a state the "
        "book does not know (default 1.2, measured)",
    )
    show = actions.add_parser("show", help="print a schema book, and the class of each recorded snapshot")
    show.add_argument("book", metavar="BOOK", help="schema book (JSON)")
    show.add_argument("--recording", default=None, metavar="FILE", help="classify the snapshots of this recording")


def run_schema(args) -> int:
    if args.schema_command == "record":
        return _record(args)
    if args.schema_command == "build":
        return _build(args)
    return _show(args)


def _record(args) -> int:
    from nesa_node import event_loop
    from nesa_node.client.swarm import Swarm
    from nesa_node.protocol.dht import default_dht_prefix
    from nesa_node.schema_book import recording_line
    from nesa_node.sharding.blocks import load_config

    num_blocks = load_config(args.model).num_hidden_layers
    prefix = args.dht_prefix or default_dht_prefix(args.model)
    out = Path(args.out)

    async def record() -> int:
        taken = 0
        async with await Swarm.create(args.initial_peers, dht_prefix=prefix) as swarm:
            while args.count is None or taken < args.count:
                began = time.monotonic()
                infos = [record.info for record in await swarm.node_records(fresh=True)]
                await asyncio.to_thread(_append, out, recording_line(infos, num_blocks, time.time()))
                taken += 1
                states = {}
                for info in infos:
                    states[info.state.value] = states.get(info.state.value, 0) + 1
                summary = ", ".join(f"{count} {state}" for state, count in sorted(states.items())) or "no nodes"
                print(f"snapshot {taken}: {summary}", file=sys.stderr, flush=True)
                if args.count is None or taken < args.count:
                    await asyncio.sleep(max(0.0, args.every - (time.monotonic() - began)))
        return taken

    taken = event_loop.run(record())
    print(f"recorded {taken} snapshots to {out}")
    return 0


def _append(path: Path, line: str) -> None:
    with path.open("a") as file:  # one write per line: an interrupted run leaves whole lines
        file.write(line)


def _build(args) -> int:
    import numpy as np

    from nesa_node.errors import SchemaBookError
    from nesa_node.schema_book import book_digest, read_recording, save_book
    from nesa_node.topology.schemas import FAR_FACTOR, build_book

    recorded = [snapshot for path in args.recordings for snapshot in read_recording(path)]
    if len({snapshot.num_blocks for snapshot in recorded}) > 1:
        raise SchemaBookError("the recordings are of models with different numbers of blocks")
    snapshots = [entry.snapshot() for entry in recorded if entry.records]
    if len(snapshots) < 3:
        raise SchemaBookError(f"a book needs at least 3 snapshots with nodes; the recordings hold {len(snapshots)}")
    if args.classes is not None and args.classes > len(snapshots):
        raise SchemaBookError(f"--classes {args.classes} is more than the {len(snapshots)} snapshots")
    far_factor = FAR_FACTOR if args.far_factor is None else args.far_factor
    if not far_factor >= 1.0:
        raise ValueError(f"--far-factor must be at least 1, got {args.far_factor}")
    print(f"building a book from {len(snapshots)} snapshots ...", file=sys.stderr, flush=True)
    book = build_book(snapshots, rng=np.random.default_rng(args.seed), classes=args.classes, far_factor=far_factor)
    save_book(book, args.out)
    _print_book(book)
    print(f"wrote {args.out} (book {book_digest(book)})")
    return 0


def _print_book(book) -> None:
    print(f"{len(book.schemas)} topology classes of a {book.num_blocks}-block model; radius {book.radius:.2f}")
    for schema in book.schemas:
        template = "; ".join(
            f"length {length} at {' '.join(map(str, starts.tolist()))}"
            for length, starts in zip(schema.lengths, schema.starts, strict=True)
        )
        print(
            f"  class {schema.label}: {schema.snapshots} snapshots, {schema.throughput_tps:.1f} tok/s, fit "
            f"{schema.fit:.3f}; {template}"
        )


def _show(args) -> int:
    from nesa_node.schema_book import book_digest, load_book, read_recording
    from nesa_node.topology.graph import swarm_graph
    from nesa_node.topology.homology import diagrams, features
    from nesa_node.topology.schemas import classify

    book = load_book(args.book)
    print(f"{args.book} (book {book_digest(book)})")
    _print_book(book)
    if args.recording is None:
        return 0
    for number, recorded in enumerate(read_recording(args.recording), start=1):
        if recorded.num_blocks != book.num_blocks:
            raise ValueError(
                f"{args.recording} is of a {recorded.num_blocks}-block model, the book of {book.num_blocks}"
            )
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(recorded.time_s))
        if not recorded.records:
            print(f"  {number:4d} {stamp}: no nodes")
            continue
        label, distance = classify(book, features(diagrams(swarm_graph(recorded.snapshot()))))
        verdict = f"class {label}" if book.knows(distance) else "far from every class"
        print(f"  {number:4d} {stamp}: {len(recorded.records)} nodes, {verdict} (distance {distance:.2f})")
    return 0
