"""A gateway app served by uvicorn inside a test's local swarm (on the swarm's event loop); and, for unit tests, a
gateway over a fake model and tokenizer driven through ASGI calls (no sockets, no swarm)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from types import SimpleNamespace

import torch
import uvicorn

from nesa_node.errors import AdapterMissingError
from nesa_node.gateway.app import Gateway, create_app


class Served:
    """A gateway app served by uvicorn on the swarm's event loop, on a free port of `host` (its URL names `host`, or
    127.0.0.1 for 0.0.0.0)."""

    def __init__(self, swarm, gateway: Gateway, host: str = "127.0.0.1"):
        self.swarm, self.gateway = swarm, gateway
        self.server = uvicorn.Server(uvicorn.Config(create_app(gateway), host=host, port=0, log_level="warning"))
        from tests.support.swarm import wait_until  # the swarm's support: not for unit tests, which import this module

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
        from tests.support.swarm import wait_until

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


class WordTokenizer:
    """A tokenizer of one token per word (split on whitespace), each id 3 + the word's length; ids decode to letters.
    `tokenized` records the length of every text it was asked to tokenize. As a real (Rust) tokenizer, it fails on a
    string that is not valid Unicode."""

    eos_token_id = 0
    chat_template = "{% for message in messages %}{{ message.content }} {% endfor %}"

    def __init__(self):
        self.tokenized: list[int] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        self.tokenized.append(len(text))
        text.encode("utf-8")
        return SimpleNamespace(input_ids=[3 + len(word) % 200 for word in text.split()])

    def decode(self, tokens: list[int], **options) -> str:
        return "".join(chr(97 + token % 26) for token in tokens)

    def apply_chat_template(self, messages, chat_template=None, add_generation_prompt=True, tokenize=False) -> str:
        return " ".join(message["content"] for message in messages)


class FakeSession:
    def __init__(self):
        self.closed = False
        self.failovers: list[dict] = []

    async def close(self) -> None:
        self.closed = True


class FakeModel:
    """What a Gateway asks of its AsyncDistributedModel, with no swarm: sessions that record their closing, and
    streams of one token each `delay_s` (never the end of sequence). `max_length`: the model's context."""

    auditor = None
    canary_checker = None
    generation_config = None

    def __init__(self, *, delay_s: float = 0.001, max_length: int = 2048):
        self.delay_s = delay_s
        self.model_config = SimpleNamespace(max_position_embeddings=max_length, num_hidden_layers=4)
        routing_table = SimpleNamespace(uid_to_peer_id={})
        self.swarm = SimpleNamespace(
            dht=SimpleNamespace(protocol=SimpleNamespace(routing_table=routing_table)), records_at_hand=lambda: []
        )
        self.config = SimpleNamespace(verify="off")
        self.own_adapters: dict[str, str] = {}
        self.sessions: list[FakeSession] = []
        self.streams_closed = 0

    async def open_session(self, **options) -> FakeSession:
        self.sessions.append(FakeSession())
        return self.sessions[-1]

    async def stream(self, ids, *, max_new_tokens: int, session, **sampling):
        try:
            for step in range(max_new_tokens):
                await asyncio.sleep(self.delay_s)
                yield torch.tensor([5 + step % 20])
        finally:
            self.streams_closed += 1

    async def adapter_by_name(self, name: str) -> str:
        raise AdapterMissingError(f"adapter {name!r}: no node announces it")

    async def announced_adapters(self, max_age_s: float | None = None) -> dict:
        return {}


def fake_gateway(*, delay_s: float = 0.001, max_length: int = 2048, **options) -> Gateway:
    """A Gateway named "m" over a FakeModel and a WordTokenizer; `options`: Gateway's."""
    return Gateway(FakeModel(delay_s=delay_s, max_length=max_length), WordTokenizer(), model_name="m", **options)


async def asgi_request(
    app,
    method: str,
    path: str,
    body: dict | bytes | None = None,
    *,
    headers: dict[str, str] | None = None,
    client: tuple[str, int] = ("127.0.0.1", 50000),
    gone: asyncio.Event | None = None,
    stop_reading_after: int | None = None,
) -> dict:
    """Call ASGI `app` as uvicorn would: {"status", "headers", "body", "chunks", "reads"} ("reads": how many times
    the app received, its body or waiting for a disconnect). `gone`: once set, the client has disconnected;
    `stop_reading_after`: a client that takes that many body chunks, then none (each later send waits forever, as
    on a full socket)."""
    raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
    header_list = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    header_list += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": header_list, "client": client, "server": ("127.0.0.1", 8000)}  # fmt: skip
    answer: dict = {"status": None, "headers": {}, "chunks": [], "reads": 0}
    gone = gone or asyncio.Event()

    async def receive() -> dict:
        answer["reads"] += 1
        if answer["reads"] == 1:
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            answer["headers"] = {name.decode(): value.decode() for name, value in message["headers"]}
        elif message["type"] == "http.response.body":
            if stop_reading_after is not None and len(answer["chunks"]) >= stop_reading_after:
                await asyncio.Event().wait()
            answer["chunks"].append(message.get("body", b""))

    await app(scope, receive, send)
    answer["body"] = b"".join(answer["chunks"])
    return answer


def error_of(answer: dict) -> dict:
    """The OpenAI-shaped error of an ASGI answer: its "error" object (KeyError for any other shape)."""
    return json.loads(answer["body"])["error"]
