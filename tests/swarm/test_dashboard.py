"""The topology dashboard in headless Chromium against a real local swarm: it shows every node and the block
coverage, shows a node that joins within seconds, drops a killed node once its record expires, and draws the
persistence diagram. Screenshots are saved (NESA_SCREENSHOTS, else the test's folder) to be looked at."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nesa_node.client.async_model import AsyncDistributedModel
from nesa_node.gateway.app import Gateway
from tests.support.browser import Browser, browser_missing
from tests.support.gateway import Served
from tests.support.swarm import wait_until

pytestmark = [pytest.mark.cli, pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))]

PREFIX = "dashboard"
ANNOUNCE_S = 1.0
TTL_S = 3 * ANNOUNCE_S + 10  # NodeConfig.record_ttl_s
TOPOLOGY_PERIOD_S = 1.0  # the dashboard's snapshots: calibrated after 5 of them


def rows(browser: Browser) -> list[str]:
    return browser.run('return [...document.querySelectorAll("tr.node")].map(row => row.dataset.peer);')


def wait_rows(browser: Browser, predicate, timeout_s: float) -> float:
    started = time.monotonic()
    wait_until(lambda: predicate(rows(browser)), timeout_s=timeout_s)
    return time.monotonic() - started


def test_dashboard_shows_nodes_coverage_joins_departures_and_diagrams(module_swarm, tiny_llama, tmp_path):
    shots = Path(os.environ.get("NESA_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    first = module_swarm.start_node(tiny_llama, 0, 2, dht_prefix=PREFIX, announce_period_s=ANNOUNCE_S)
    second = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=PREFIX, announce_period_s=ANNOUNCE_S)
    model = module_swarm.run(
        AsyncDistributedModel.from_pretrained(tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix=PREFIX)
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    served = Served(module_swarm, Gateway(model, tokenizer, model_name="tiny", topology_period_s=TOPOLOGY_PERIOD_S))
    browser = Browser(height=1400)  # the whole page, events included, in the screenshots
    killed = None
    try:
        browser.get(served.url + "/")
        wait_rows(browser, lambda peers: set(peers) == {first.peer_id, second.peer_id}, timeout_s=20)
        assert browser.run('return document.querySelector("#gaps") === null;')  # every block covered
        servers = browser.run('return [...document.querySelectorAll(".cov tr:last-child td")].map(c => c.textContent);')
        assert servers == ["1", "1", "1", "1"], servers
        browser.screenshot(shots / "dashboard-two-nodes.png")
        # change detection calibrates on the unchanged two-node swarm before the third node comes
        wait_until(lambda: browser.run('return document.querySelector("#change-status").dataset.watching === "yes";'),
                   timeout_s=30)  # fmt: skip

        # a node joins: a process of its own, so that it can be killed without a goodbye below
        command = [sys.executable, "-m", "nesa_node.cli", "run", "--model", tiny_llama, "--blocks", "0:4",
                   "--initial-peers", *module_swarm.initial_peers, "--dht-prefix", PREFIX, "--announce-period",
                   str(ANNOUNCE_S), "--no-measure", "--rebalance", "off", "--address-file", str(tmp_path / "third.addr")]  # fmt: skip
        killed = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until(lambda: (tmp_path / "third.addr").is_file(), timeout_s=120)  # it serves and has announced
        joined_s = wait_rows(browser, lambda peers: len(peers) == 3, timeout_s=10)
        print(f"\na joining node shown after {joined_s:.2f} s")
        wait_until(lambda: browser.run('return document.querySelectorAll("#diagram .h0").length;') >= 1, timeout_s=10)
        assert browser.run('return document.querySelectorAll("#graph .vertex").length;') == 3
        session = module_swarm.run(model.open_session(max_length=16))  # a live chain, drawn as its nodes' ids
        try:
            wait_until(lambda: browser.run('return document.querySelectorAll("#chains .chain").length;') == 1,
                       timeout_s=5)  # fmt: skip
            chain = browser.run('return document.querySelector("#chains .chain").textContent;')
            assert all(peer[-8:] in chain for peer in session.chain.peer_ids), (chain, session.chain.peer_ids)
            vertices = browser.run(
                'return [...document.querySelectorAll("#graph .vertex")].map(v => v.getAttribute("cx") + "," + '
                'v.getAttribute("cy"));'
            )
            assert len(set(vertices)) == 3, vertices  # nodes at one point are drawn apart
            # scored against the calibrated threshold (whether a join counts as a change depends on the noise the
            # calibration saw: tests/unit/test_dashboard_state.py checks the detection itself)
            wait_until(lambda: browser.run('return document.querySelectorAll("#change .score").length;') >= 2,
                       timeout_s=10)  # fmt: skip
            browser.screenshot(shots / "dashboard-three-nodes.png")
        finally:
            module_swarm.run(session.close())
        wait_until(lambda: browser.run('return document.querySelectorAll("#chains .chain").length;') == 0,
                   timeout_s=5)  # fmt: skip

        killed.send_signal(signal.SIGKILL)  # no goodbye: its record lives until it expires
        killed.wait(timeout=10)
        dropped_s = wait_rows(browser, lambda peers: len(peers) == 2, timeout_s=TTL_S + 10)
        print(f"a killed node dropped after {dropped_s:.2f} s (record TTL {TTL_S:.0f} s)")
        events = browser.run('return document.querySelector("#events").textContent;')
        assert "joined" in events and "left" in events, events
        browser.screenshot(shots / "dashboard-node-killed.png")
    finally:
        browser.close()
        if killed is not None and killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait(timeout=10)
        served.close()
        module_swarm.run(model.close())
        for node in (first, second):
            module_swarm.stop_node(node)
