"""Where a decode step's time goes, from the marks of nesa_node/step_trace.py: `summarize` reads the trace files of
a client and its nodes and gives the median of each segment of a step's way down a direct chain and back.

For one session at a time (the segments pair each mark with the one after it in the same process, and a `receive`
with the last `send` of another process before it). Segments, in milliseconds:

    node NAME: received_to_compute   frame read and opened -> its step's computation starts (parse, checks, queue)
               compute_wall          the computation as the node's event loop sees it (its own compute time and
                                     what the node does around it: input checks, cache, waiting for the thread)
               compute_own           the compute time the node reports
               computed_to_sent      output -> its frame written (encode, tag, message, seal)
    client:    received_to_stepped   the last node's frame read -> the forward has the hidden states
               stepped_to_logits     the LM head (and sampling's inputs)
               logits_to_forward     generate's own work between two forwards (sampling, stopping, inputs)
               forward_to_embedded   the forward's checks and the embedding
               embedded_to_sent      the step made and sent to the first node
    transport:                       a frame written -> read by another process (the socket, and the wake-up)
    token:                           one forward to the next: a decoded token's whole time
"""

from __future__ import annotations

import statistics
from pathlib import Path

# (segment name, first mark, the mark after it) within one process
NODE_SEGMENTS = (
    ("received_to_compute", "receive", "compute"),
    ("compute_wall", "compute", "computed"),
    ("computed_to_sent", "computed", "send"),
)
CLIENT_SEGMENTS = (
    ("received_to_stepped", "receive", "stepped"),
    ("stepped_to_logits", "stepped", "logits"),
    ("logits_to_forward", "logits", "forward"),
    ("forward_to_embedded", "forward", "embedded"),
    ("embedded_to_sent", "embedded", "send"),
)


def read_marks(path: Path, since_ns: int, until_ns: int) -> list[tuple[int, str, int]]:
    """The marks of one trace file within [since_ns, until_ns], in time order (a line that is not a time, an event
    and a number, as a process stopped mid-write may leave, is skipped)."""
    marks = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 3 or not (parts[0].isdigit() and parts[2].isdigit()):
            continue
        at, event, value = int(parts[0]), parts[1], int(parts[2])
        if since_ns <= at <= until_ns:
            marks.append((at, event, value))
    marks.sort()
    return marks


def _segments(marks: list[tuple[int, str, int]], pairs) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {name: [] for name, _, _ in pairs}
    for (at, event, _), (next_at, next_event, _) in zip(marks, marks[1:], strict=False):
        for name, first, then in pairs:
            if event == first and next_event == then:
                found[name].append((next_at - at) / 1e6)
    return found


def _medians(found: dict[str, list[float]], counted: str) -> dict:
    """The median of each segment, and "steps": how many times the segment `counted` was seen."""
    return {name: round(statistics.median(values), 3) if values else None for name, values in found.items()} | {
        "steps": len(found[counted])
    }


def summarize(directory: str | Path, pids: dict[str, int], since_ns: int, until_ns: int) -> dict:
    """Per process named in `pids` (name: pid; "client" for the client), the medians of its segments within the
    window, the transport's, and a token's."""
    marks = {
        name: read_marks(Path(directory) / f"{pid}.trace", since_ns, until_ns)
        for name, pid in pids.items()
        if (Path(directory) / f"{pid}.trace").is_file()
    }
    summary: dict = {}
    for name, own in marks.items():
        if name == "client":
            found = _segments(own, CLIENT_SEGMENTS)
            forwards = [at for at, event, _ in own if event == "forward"]
            found["token"] = [(b - a) / 1e6 for a, b in zip(forwards, forwards[1:], strict=False)]
        else:
            found = _segments(own, NODE_SEGMENTS)
            found["compute_own"] = [value / 1e3 for _, event, value in own if event == "computed"]
        summary[name] = _medians(found, "embedded_to_sent" if name == "client" else "received_to_compute")
    everything = sorted((at, name, event) for name, own in marks.items() for at, event, _ in own)
    transport, last_send = [], None
    for at, name, event in everything:
        if event == "send":
            last_send = (at, name)
        elif event == "receive" and last_send is not None and last_send[1] != name:
            transport.append((at - last_send[0]) / 1e6)
            last_send = None
    summary["transport_ms"] = round(statistics.median(transport), 3) if transport else None
    return summary
