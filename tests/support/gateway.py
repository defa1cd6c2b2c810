"""A gateway app served by uvicorn inside a test's local swarm (on the swarm's event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request

import uvicorn

from nesa_node.gateway.app import Gateway, create_app
from tests.support.swarm import wait_until


class Served:
    """A gateway app served by uvicorn on the swarm's event loop, on a free port of `host` (its URL names `host`, or
    127.0.0.1 for 0.0.0.0)."""

    def __init__(self, swarm, gateway: Gateway, host: str = "127.0.0.1"):
        self.swarm, self.gateway = swarm, gateway
        self.server = uvicorn.Server(uvicorn.Config(create_app(gateway), host=host, port=0, log_level="warning"))
        self.server.capture_signals = lambda: _nothing()
        self.task = asyncio.run_coroutine_threadsafe(self.server.serve(), swarm.loop)
        wait_until(lambda: self.server.started, timeout_s=30)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.task.result(timeout=30)


@contextlib.contextmanager
def gateway_over(swarm, model_path: str, nodes, *, dht_prefix: str, **client_options):
    """A Served gateway over a new AsyncDistributedModel of `model_path` (`client_options`: from_pretrained's), once
    its client sees the records of every node of `nodes`; both closed on exit."""
    from transformers import AutoTokenizer

    from nesa_node.client.async_model import AsyncDistributedModel

    model = swarm.run(
        AsyncDistributedModel.from_pretrained(
            model_path, initial_peers=swarm.initial_peers, dht_prefix=dht_prefix, **client_options
        )
    )
    served = None
    try:
        served = Served(swarm, Gateway(model, AutoTokenizer.from_pretrained(model_path), model_name="tiny"))
        wanted = {node.peer_id for node in nodes}
        wait_until(lambda: wanted <= {r.info.peer_id for r in swarm.run(model.swarm.node_records(fresh=True))}, 30)
        yield served
    finally:
        if served is not None:
            served.close()
        swarm.run(model.close())


def complete(served: Served, body: dict) -> dict:
    """POST `body` to the gateway's /v1/completions; its JSON answer."""
    request = urllib.request.Request(
        served.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def metrics_text(served: Served) -> str:
    """The gateway's /metrics page."""
    with urllib.request.urlopen(served.url + "/metrics", timeout=10) as answer:
        return answer.read().decode()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False
