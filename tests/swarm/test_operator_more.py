"""The command line as an operator meets it, continued from test_operator.py (split so that the parallel test pass
can balance them): taken ports are refused, a swarm outlives its bootstrap peer, generation defaults, mistakes print
one line and exit 2, the gateway stops on a signal, and commands under a service manager."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.support.cli import (
    STOP_S,
    assert_stopped_cleanly,
    free_port,
    one_error_line,
    silent_peer,
    start_bootstrap,
    start_node,
)

pytestmark = pytest.mark.cli

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
        (("gateway", "--model", model, "--initial-peers", silent, "--admin-key-file", "./no-admins"), "bad_value",
         "--admin-key-file ./no-admins"),
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
