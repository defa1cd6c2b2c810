"""Step marks (nesa_node/step_trace.py) and their summary (bench/trace_summary.py)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nesa_node import step_trace

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def summary_module():
    spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "bench" / "trace_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_marks_go_to_the_process_file_only_between_start_and_stop(tmp_path):
    step_trace.stop()
    step_trace.mark("send", 5)
    assert not list(tmp_path.iterdir())
    step_trace.start(tmp_path / "marks")
    try:
        step_trace.mark("send", 5)
        step_trace.mark("receive", 7)
        lines = (tmp_path / "marks" / f"{os.getpid()}.trace").read_text().splitlines()  # written as they come
    finally:
        step_trace.stop()
    step_trace.mark("send", 9)
    assert [line.split()[1:] for line in lines] == [["send", "5"], ["receive", "7"]]
    first, second = (int(line.split()[0]) for line in lines)
    assert 0 < first <= second
    assert len((tmp_path / "marks" / f"{os.getpid()}.trace").read_text().splitlines()) == 2


def test_a_mark_that_cannot_be_written_is_lost_without_an_error(tmp_path):
    step_trace.start(tmp_path)
    try:
        step_trace._out.close()  # as `stop` on another thread, or a failing disk, would leave it
        step_trace.mark("receive", 3)
    finally:
        step_trace.stop()
    assert (tmp_path / f"{os.getpid()}.trace").read_text() == ""


def test_a_directory_that_cannot_be_written_leaves_the_process_running_without_marks(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    script = "from nesa_node import step_trace; step_trace.mark('send', 1); print(step_trace._out is None)"
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, step_trace.ENV: str(blocker / "marks")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "True"
    assert "no step marks" in done.stderr


def _write(path: Path, marks: list[tuple[float, str, int]]) -> None:
    path.write_text("".join(f"{int(at * 1e6)} {event} {value}\n" for at, event, value in marks))


def test_a_chain_of_two_nodes_is_summed_up_segment_by_segment(tmp_path, summary_module):
    # one token every 10 ms (times in ms): client -> node A -> node B -> client
    client, node_a, node_b = [], [], []
    for token in range(5):
        t = 10.0 * token
        client += [(t, "forward", 0), (t + 0.2, "embedded", 0), (t + 0.7, "send", 900)]
        node_a += [(t + 0.9, "receive", 900), (t + 1.2, "compute", 0), (t + 3.2, "computed", 1800)]
        node_a += [(t + 3.6, "send", 900)]
        node_b += [(t + 3.9, "receive", 900), (t + 4.2, "compute", 0), (t + 6.2, "computed", 1900)]
        node_b += [(t + 6.6, "send", 900)]
        client += [(t + 6.8, "receive", 900), (t + 7.3, "stepped", 0), (t + 8.3, "logits", 0)]
    _write(tmp_path / "11.trace", client)
    _write(tmp_path / "12.trace", node_a)
    _write(tmp_path / "13.trace", node_b + [(1000.0, "send", 1)])  # outside the window
    (tmp_path / "13.trace").write_text((tmp_path / "13.trace").read_text() + "1000000 torn\n1000 send 12x\n")
    pids = {"client": 11, "node0": 12, "node1": 13, "node2": 99}  # node2 left no file
    summary = summary_module.summarize(tmp_path, pids, 0, int(60 * 1e6))
    assert summary["node0"] == {
        "received_to_compute": 0.3,
        "compute_wall": 2.0,
        "computed_to_sent": 0.4,
        "compute_own": 1.8,
        "steps": 5,
    }
    assert summary["node1"]["compute_own"] == 1.9 and summary["node1"]["steps"] == 5
    assert summary["client"] == {
        "received_to_stepped": 0.5,
        "stepped_to_logits": 1.0,
        "logits_to_forward": 1.7,
        "forward_to_embedded": 0.2,
        "embedded_to_sent": 0.5,
        "token": 10.0,
        "steps": 5,
    }
    assert summary["transport_ms"] == 0.2
    assert "node2" not in summary
