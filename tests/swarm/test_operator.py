"""The command line as an operator meets it: signals to a command's process group end it at once and cleanly (the
dht, a node, a graph stage, generate, tune, training, the demo). Taken ports, a restarted bootstrap, mistakes, the
gateway and service managers: test_operator_more.py.

Every command runs as a real `nesa-node` process in a process group of its own (tests/support/cli.py), and each
signal goes to the whole group, as a terminal's Ctrl-C, `timeout` and systemd's default KillMode send it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request

import pytest

from tests.support.cli import (
    STOP_S,
    assert_stopped_cleanly,
    p2pd_sockets,
    start_bootstrap,
    start_node,
    wait_gone,
)
from tests.support.swarm import wait_until

pytestmark = pytest.mark.cli

# ---- signals ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rounds", [pytest.param(4, id="4"), pytest.param(20, id="20", marks=pytest.mark.slow)])
def test_dht_stops_on_every_signal_many_times_in_a_row(operator, rounds):
    seconds = []
    for round_ in range(rounds):
        sig = signal.SIGINT if round_ % 2 == 0 else signal.SIGTERM
        bootstrap, _ = start_bootstrap(operator, name=f"boot{round_}")
        seconds.append(assert_stopped_cleanly(operator, bootstrap, sig))
    assert max(seconds) < STOP_S


def test_node_announces_offline_on_sigterm_and_stops_on_sigint(operator, tiny_llama):
    _, address = start_bootstrap(operator)
    first = start_node(operator, tiny_llama, "0:2", address, "first")
    second = start_node(operator, tiny_llama, "2:4", address, "second")
    first_id = first.output().split("peer id ")[1].split()[0]

    assert_stopped_cleanly(operator, first, signal.SIGTERM)
    assert "SIGTERM received, stopping" in first.output()
    # its p2pd outlived the group's signal long enough to announce `offline` through the DHT
    status = operator.run("status", "--model", tiny_llama, "--initial-peers", address)
    row = next(line for line in status.stdout.splitlines() if first_id in line)
    assert "offline" in row, status.stdout

    assert_stopped_cleanly(operator, second, signal.SIGINT)
    assert "SIGINT received, stopping" in second.output()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_graph_stage_stops_on_signal(operator, sig):
    stage = operator.start(
        "run", "--graph-model", "nesa_node.graph.models:resnet_tiny", "--stage", "0", "--stages", "2",
        "--new-swarm", "--address-file", "stage.addr",
    )  # fmt: skip
    operator.wait_file("stage.addr", stage)
    assert_stopped_cleanly(operator, stage, sig)


@pytest.mark.parametrize(
    "sig, status, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")], ids=["INT", "TERM"]
)
def test_generate_tune_and_training_stop_on_signal(operator, tiny_llama, sig, status, word):
    _, address = start_bootstrap(operator)
    start_node(operator, tiny_llama, "0:4", address, "node", "--inject-delay-ms", "100")  # steps of 0.1 s at least
    generate = operator.start(
        "generate", "--model", tiny_llama, "--initial-peers", address, "--prompt", "hello", "--max-new-tokens", "500"
    )
    tune = operator.start("tune", "--scenario", "global-1000", "--out", "params.json")
    train = operator.start("model", "train-tiny", "trained", "--steps", "100000", "--no-progress")  # never cached
    # all under way: generating (500 steps take 50 s or more) once its p2pd is up, tuning (about 40 s), training
    wait_until(lambda: p2pd_sockets(generate) != [], timeout_s=60)
    time.sleep(3.0)
    for command, has_p2pd in ((generate, True), (tune, False), (train, False)):
        assert command.process.poll() is None, command.output()
        assert_stopped_cleanly(operator, command, sig, expected_status=status, has_p2pd=has_p2pd)
        assert command.output().strip().splitlines()[-1] == word


def test_demo_stops_what_it_started_on_ctrl_c(operator):
    demo = operator.start("demo", "--nodes", "2", "--max-new-tokens", "16")
    deadline = time.monotonic() + 120
    while "started pids:" not in demo.output():
        assert demo.process.poll() is None and time.monotonic() < deadline, demo.output()
        time.sleep(0.1)
    pids = [int(pid) for pid in demo.output().split("started pids: ")[1].split("\n")[0].split()]
    status, _ = operator.signal(demo, signal.SIGINT, timeout_s=STOP_S + 15)  # + the children's own drain
    output = demo.output()
    assert "Traceback" not in output, output
    assert status in (0, 130), output  # 0: the demo was already done when the signal came
    assert wait_gone(pids) == [], output


def test_demo_serves_the_gateway_until_ctrl_c(operator):
    """`make demo` (3 nodes): after its check the demo serves the gateway over its swarm, prints where, and Ctrl-C
    stops everything it started (bootstrap, nodes, gateway), each process group whole."""
    demo = operator.start("demo", "--nodes", "3", "--max-new-tokens", "8", "--serve", "--gateway-port", "0")
    deadline = time.monotonic() + 180
    while "Ctrl-C stops the gateway" not in demo.output():
        assert demo.process.poll() is None and time.monotonic() < deadline, demo.output()
        time.sleep(0.2)
    output = demo.output()
    assert "tokens equal the single-process reference: yes" in output, output
    pids = [int(pid) for pid in output.split("started pids: ")[1].split("\n")[0].split()]
    assert len(pids) == 4, output  # bootstrap + 3 nodes
    gateway_pid, url = re.search(r"gateway (\d+) at (http://\S+)", output).groups()
    health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
    assert health["status"] == "ok"
    wait_until(lambda: len(json.loads(urllib.request.urlopen(url + "/api/swarm", timeout=10).read())["nodes"]) == 3)
    curl = re.search(r"(curl -s .*)", output).group(1)  # the example the demo prints runs as printed
    answer = json.loads(subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60).stdout)
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] >= 1, answer
    pids.append(int(gateway_pid))
    status, _ = operator.signal(demo, signal.SIGINT, timeout_s=STOP_S + 15)  # + the children's own drain
    output = demo.output()
    assert "Traceback" not in output, output
    assert status == 0 and "stopped every process the demo started" in output, output  # Ctrl-C ends serving
    assert wait_gone(pids) == [], output
    wait_until(lambda: not any(group_alive(pid) for pid in pids), timeout_s=5)  # nor a child left in their groups


def group_alive(pid: int) -> bool:
    """Whether any process is left in the process group `pid` led."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_node_prints_its_moves_at_the_default_log_level(operator, tiny_llama):
    """Two nodes on blocks 0:2 and none on 2:4: one of them moves to cover the hole, and its terminal says so."""
    _, address = start_bootstrap(operator)
    settings = ("--announce-period", "1", "--rebalance-period", "2", "--rebalance", "periodic")
    nodes = [start_node(operator, tiny_llama, "0:2", address, f"node{index}", *settings) for index in range(2)]
    deadline = time.monotonic() + 90
    while not any("now serving blocks 2:4" in node.output() for node in nodes):
        assert time.monotonic() < deadline, "\n".join(node.output() for node in nodes)
        time.sleep(0.5)
    moved = next(node for node in nodes if "now serving blocks 2:4" in node.output())
    assert "moving from blocks 0:2 to 2:4" in moved.output()
