"""The command line as an operator meets it: signals to a command's process group end it at once and cleanly, taken
ports are refused, a swarm outlives its bootstrap peer, mistakes print one line and exit 2.

Every command runs as a real `nesa-node` process in a process group of its own (tests/support/cli.py), and each
signal goes to the whole group, as a terminal's Ctrl-C, `timeout` and systemd's default KillMode send it."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch

from tests.support.cli import Operator, wait_gone
from tests.support.swarm import wait_until

pytestmark = pytest.mark.cli

STOP_S = 10.0  # the bound of the acceptance; a clean stop takes about 0.5 s (dht) to 3 s (a node)
# a peer address of the right form that nothing listens on
SILENT_PEER = "/ip4/127.0.0.1/tcp/{port}/p2p/QmVjXs6BHfUPfdE6yhUMEKBo6YFxUWnDhSSfWHDDWDHeQW"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def silent_peer() -> str:
    return SILENT_PEER.format(port=free_port())


@pytest.fixture
def operator(tmp_path):
    operator = Operator(tmp_path)
    yield operator
    operator.stop_all()


def start_bootstrap(operator: Operator, *extra: str, name: str = "boot") -> tuple:
    command = operator.start("dht", "--address-file", f"{name}.addr", *extra, name=name)
    return command, operator.wait_file(f"{name}.addr", command).split()[0]


def start_node(operator: Operator, model: str, blocks: str, bootstrap: str, name: str, *extra: str):
    command = operator.start(
        "run", "--model", model, "--blocks", blocks, "--initial-peers", bootstrap, "--address-file", f"{name}.addr",
        "--torch-threads", "1", *extra, name=name,
    )  # fmt: skip
    operator.wait_file(f"{name}.addr", command)
    return command


def assert_stopped_cleanly(
    operator: Operator, command, sig: int, expected_status: int = 0, *, has_p2pd: bool = True
) -> float:
    sockets = p2pd_sockets(command)
    status, seconds = operator.signal(command, sig, timeout_s=STOP_S)
    output = command.output()
    assert status == expected_status, output
    assert "Traceback" not in output and "Task exception" not in output, output
    assert wait_gone(command.children) == [], "a p2pd outlived its process"
    # the process stopped its p2pd itself (hivemind removes the control socket then), not the kernel at its death
    assert bool(sockets) == has_p2pd and not any(os.path.exists(path) for path in sockets), sockets
    return seconds


def p2pd_sockets(command) -> list[str]:
    """The control sockets of the command's p2pd daemons (their -listen=/unix/PATH argument)."""
    paths = []
    for pid in command.watch_children():
        try:
            arguments = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        paths += [argument.split("/unix", 1)[1] for argument in arguments if argument.startswith("-listen=/unix/")]
    return paths


def one_error_line(result, code: str) -> str:
    """The failure's stderr is exactly one line `error: [code] ...`; returns it."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: [{code}] "), result.stderr
    assert result.returncode == 2, result.stderr
    return lines[0]


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
    """`make demo`: after its check the demo serves the gateway over its swarm, prints where, and Ctrl-C stops
    everything it started, the gateway included."""
    demo = operator.start("demo", "--nodes", "2", "--max-new-tokens", "8", "--serve", "--gateway-port", "0")
    deadline = time.monotonic() + 180
    while "Ctrl-C stops the gateway" not in demo.output():
        assert demo.process.poll() is None and time.monotonic() < deadline, demo.output()
        time.sleep(0.2)
    output = demo.output()
    assert "tokens equal the single-process reference: yes" in output, output
    pids = [int(pid) for pid in output.split("started pids: ")[1].split("\n")[0].split()]
    gateway_pid, url = re.search(r"gateway (\d+) at (http://\S+)", output).groups()
    health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
    assert health["status"] == "ok"
    wait_until(lambda: len(json.loads(urllib.request.urlopen(url + "/api/swarm", timeout=10).read())["nodes"]) == 2)
    curl = re.search(r"(curl -s .*)", output).group(1)  # the example the demo prints runs as printed
    answer = json.loads(subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60).stdout)
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] >= 1, answer
    pids.append(int(gateway_pid))
    status, _ = operator.signal(demo, signal.SIGINT, timeout_s=STOP_S + 15)  # + the children's own drain
    output = demo.output()
    assert "Traceback" not in output, output
    assert status == 0 and "stopped every process the demo started" in output, output  # Ctrl-C ends serving
    assert wait_gone(pids) == [], output


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


# ---- ports, bootstrap ------------------------------------------------------------------------------------------------


def test_a_taken_port_is_refused_in_one_line(operator, tiny_llama):
    port = str(free_port())
    start_bootstrap(operator, "--port", port)
    for args, option in (
        (("dht", "--port", port), "--port"),
        (("run", "--model", tiny_llama, "--blocks", "0:2", "--new-swarm", "--port", port), "--port"),
        (("run", "--model", tiny_llama, "--blocks", "0:2", "--new-swarm", "--lane-port", port), "--lane-port"),
    ):
        line = one_error_line(operator.run(*args, timeout_s=60), "port_in_use")
        assert f"{option} {port}" in line and "already in use" in line


@pytest.mark.parametrize("down_s", [pytest.param(10, id="10s"), pytest.param(120, id="2min", marks=pytest.mark.slow)])
def test_swarm_is_found_again_through_a_restarted_bootstrap(operator, tiny_llama, down_s):
    period = 4.0  # announce period of the nodes
    boot_args = ("--identity", "boot.key", "--port", str(free_port()))
    bootstrap, address = start_bootstrap(operator, *boot_args)
    for index, blocks in enumerate(("0:2", "2:4")):
        start_node(operator, tiny_llama, blocks, address, f"node{index}", "--announce-period", str(period))
    os.killpg(bootstrap.pid, signal.SIGKILL)  # no goodbye
    bootstrap.process.wait()
    time.sleep(down_s)

    (operator.workdir / "boot.addr").unlink()
    _, again = start_bootstrap(operator, *boot_args)
    assert again == address  # the same identity and port: the address nodes and clients know
    time.sleep(2 * period)
    status = operator.run("status", "--model", tiny_llama, "--initial-peers", address)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "2 nodes" in status.stdout and "all 4 blocks covered" in status.stdout, status.stdout

    # clients take several initial peers and use any that answers
    result = operator.run(
        "generate", "--model", tiny_llama, "--initial-peers", silent_peer(), address, "--prompt", "hi",
        "--max-new-tokens", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hi")


# ---- generation defaults -------------------------------------------------------------------------------------------


def test_generate_without_a_length_gives_what_transformers_gives(operator, tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nesa_node.client.model import DistributedModelForCausalLM

    _, address = start_bootstrap(operator)
    start_node(operator, tiny_llama, "0:4", address, "node")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tokenizer("Beautiful is better", return_tensors="pt").input_ids
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    reference.generation_config.eos_token_id = None  # 20 new tokens exactly, whatever the random model says
    with torch.no_grad():
        expected = reference.generate(ids, do_sample=False, eos_token_id=None)
    assert expected.shape[1] == ids.shape[1] + 20

    with DistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[address], compression="none") as model:
        model.generation_config.eos_token_id = None
        assert torch.equal(model.generate(ids, do_sample=False, eos_token_id=None), expected)

    result = operator.run("generate", "--model", tiny_llama, "--initial-peers", address, "--prompt", "Beautiful is")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "UserWarning" not in result.stderr, result.stderr

    # the client keeping one block at each edge prints the same text (the swarm then serves blocks 1:3 only)
    edges = operator.run(
        "generate", "--model", tiny_llama, "--initial-peers", address, "--prompt", "Beautiful is",
        "--private-edges", "1,1",
    )  # fmt: skip
    assert edges.returncode == 0, edges.stderr
    assert edges.stdout == result.stdout and result.stdout.strip()


# ---- mistakes --------------------------------------------------------------------------------------------------------


def _mistakes(model: str) -> list[tuple[tuple[str, ...], str, str]]:
    """(arguments, code, a phrase of the message) for mistakes people make."""
    silent = silent_peer()
    mistakes = [
        (("generate", "--model", "./wrong-path", "--prompt", "x", "--initial-peers", silent), "model_load", "config"),
        (("generate", "--model", model, "--prompt", "x", "--initial-peers", "garbage"), "initial_peers", "/p2p/"),
        (("generate", "--model", model, "--prompt", "x", "--initial-peers", silent), "initial_peers", "any running"),
        (("status", "--model", model, "--initial-peers", silent), "initial_peers", "any running"),
        (("generate", "--model", model, "--prompt", "x", "--initial-peers", silent, "--max-new-tokens", "0"),
         "usage", "above 0"),
        (("run", "--model", model, "--blocks", "0:9", "--new-swarm"), "model_load", "outside"),
        (("run", "--model", model, "--blocks", "0:2"), "bad_value", "--new-swarm"),
        (("run", "--model", model, "--blocks", "5:2"), "usage", "START < END"),
        (("run", "--model", model, "--blocks", "0:2", "--new-swarm", "--cuda-graphs"), "bad_value", "--device cuda"),
        (("run", "--model", model, "--blocks", "0:2", "--initial-peers", "garbage"), "initial_peers", "/p2p/"),
        (("tune", "--scenario", "nowhere", "--out", "p.json"), "bad_value", "nowhere"),
        (("launch",), "usage", "invalid choice"),
        (("gateway", "--model", model, "--initial-peers", silent, "--api-key-file", "./no-keys"), "bad_value",
         "--api-key-file ./no-keys"),
    ]  # fmt: skip
    if not torch.cuda.is_available():
        mistakes.append((("run", "--model", model, "--blocks", "0:2", "--new-swarm", "--device", "cuda"), "device", ""))
    return mistakes


def test_mistakes_print_one_line_and_exit_2(operator, tiny_llama):
    mistakes = _mistakes(tiny_llama)
    with ThreadPoolExecutor(3) as pool:  # each spends most of its time starting Python and waiting on the network
        results = list(pool.map(lambda mistake: operator.run(*mistake[0], timeout_s=120), mistakes))
    for (args, code, phrase), result in zip(mistakes, results, strict=True):
        line = one_error_line(result, code)
        assert phrase in line, (args, line)


def test_verbose_shows_the_traceback(operator):
    result = operator.run("-v", "generate", "--model", "./wrong-path", "--prompt", "x", "--initial-peers", "garbage")
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: [model_load] ")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_gateway_serves_then_stops_on_signal(operator, tiny_llama, sig):
    """`nesa-node gateway` as an operator runs it: it answers the OpenAI API over a real swarm, and a signal stops
    it within the bound with no traceback and no p2pd left behind."""
    _, address = start_bootstrap(operator)
    start_node(operator, tiny_llama, "0:4", address, "node")
    gateway = operator.start(
        "gateway", "--model", tiny_llama, "--initial-peers", address, "--port", "0", "--address-file", "gw.addr",
        name="gateway",
    )  # fmt: skip
    url = operator.wait_file("gw.addr", gateway).strip()
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    body = {"model": Path(tiny_llama).name, "prompt": "import os", "max_tokens": 4, "temperature": 0}
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    answer = json.loads(connection.getresponse().read())
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 4, answer
    assert assert_stopped_cleanly(operator, gateway, sig) < STOP_S


# ---- under a service manager -----------------------------------------------------------------------------------------


class Supervisor:
    """The service manager's side of `Type=notify` (systemd's sd_notify protocol): a datagram socket in the abstract
    namespace whose name goes to the command as NOTIFY_SOCKET; `messages` keeps what it said, in order."""

    def __init__(self):
        self.name = f"@nesa-test-notify-{os.getpid()}-{time.monotonic_ns()}"
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind("\0" + self.name[1:])
        self.messages: list[dict[str, str]] = []

    def wait_for(self, key: str, timeout_s: float) -> dict[str, str]:
        """The first message (from now on, or already received) holding `key`."""
        deadline = time.monotonic() + timeout_s
        while not any(key in message for message in self.messages):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key} from the command within {timeout_s} s: {self.messages}")
            self.socket.settimeout(left)
            try:
                data = self.socket.recv(4096)
            except TimeoutError:
                continue
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line))
        return next(message for message in self.messages if key in message)

    def drain(self) -> list[dict[str, str]]:
        """Read what the command has sent so far; every message received."""
        self.socket.setblocking(False)
        try:
            while True:
                data = self.socket.recv(4096)
                self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line))
        except BlockingIOError:
            pass
        finally:
            self.socket.setblocking(True)
        return self.messages

    def close(self) -> None:
        self.socket.close()


@pytest.mark.parametrize("command", ["run", "dht"])
def test_under_a_service_manager_a_command_says_ready_beats_the_watchdog_and_stops_cleanly(
    operator, tiny_llama, monkeypatch, command
):
    """What a `Type=notify` unit with `WatchdogSec=` sees (deploy/systemd/nesa-node@.service): READY=1 once the
    command serves (a node: its address file written, its blocks loaded), with its main pid; WATCHDOG=1 at half the
    watchdog period while it runs; STOPPING=1 at SIGTERM, then a drain and a clean exit within the bound."""
    supervisor = Supervisor()
    monkeypatch.setenv("NOTIFY_SOCKET", supervisor.name)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    try:
        if command == "run":
            args = ("run", "--model", tiny_llama, "--blocks", "0:4", "--new-swarm", "--torch-threads", "1")
        else:
            args = ("dht",)
        process = operator.start(*args, "--address-file", "served.addr", name=command)
        ready = supervisor.wait_for("READY", timeout_s=120)
        assert ready["READY"] == "1" and ready["MAINPID"] == str(process.pid), ready
        assert "serving" in ready["STATUS"]
        assert operator.wait_file("served.addr", process, timeout_s=1)  # ready means it serves
        time.sleep(1.6)  # a beat at READY, then one every 0.5 s
        beats = [message for message in supervisor.drain() if "WATCHDOG" in message]
        assert len(beats) >= 3, supervisor.messages
        seconds = assert_stopped_cleanly(operator, process, signal.SIGTERM)
        stopping = supervisor.wait_for("STOPPING", timeout_s=1)
        assert "SIGTERM" in stopping["STATUS"]
        print(f"{command}: ready, watchdog beats, stopped {seconds:.1f} s after SIGTERM")
    finally:
        supervisor.close()
