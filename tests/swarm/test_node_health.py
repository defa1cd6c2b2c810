"""A node's /health beside its /metrics (--metrics-port): 200 with its state and peer id while it serves, 503 when
its event loop does not answer (what a container's HEALTHCHECK reads, deploy/Dockerfile)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_health_says_online_with_the_peer_id_and_metrics_stay_served(local_swarm, tiny_llama):
    node = local_swarm.start_node(tiny_llama, 0, 2, metrics_port=0)
    status, body = get(node.metrics_url.removesuffix("/metrics") + "/health")
    assert status == 200, body
    health = json.loads(body)
    assert health["status"] == "ok" and health["state"] == "online" and health["event_loop"] == "responsive"
    assert health["peer_id"] == node.peer_id
    assert (health["start_block"], health["end_block"]) == (0, 2)
    status, metrics = get(node.metrics_url)
    assert status == 200 and b"nesa_node_sessions" in metrics


def test_health_is_503_while_the_event_loop_is_blocked(local_swarm, tiny_llama):
    node = local_swarm.start_node(tiny_llama, 0, 2, metrics_port=0)
    blocked, release = threading.Event(), threading.Event()

    def block() -> None:  # runs on the node's event loop and holds it
        blocked.set()
        release.wait(10)

    local_swarm.loop.call_soon_threadsafe(block)
    assert blocked.wait(10)
    try:
        started = time.monotonic()
        healthy, body = node.health(local_swarm.loop, timeout_s=0.5)
        assert not healthy and body["status"] == "unavailable"
        assert body["event_loop"] == "no answer within 0.5 s"
        assert time.monotonic() - started < 5
    finally:
        release.set()
    healthy, body = node.health(local_swarm.loop, timeout_s=5)
    assert healthy and body["event_loop"] == "responsive"
