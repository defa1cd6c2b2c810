"""Request bodies and the gateway's memory (gateway/middleware.py LimitBody): a body must arrive whole within its
deadline (408 `request_timeout` past it, its bytes let go), and the bodies being read hold their size of one budget
shared by every caller, past which a request is refused at once (503 `server_busy`) before any of its body is read.
So clients trickling bodies over many connections hold a bounded amount of the gateway's memory, for a bounded time."""

from __future__ import annotations

import asyncio
import json

import uvicorn

from nesa_node.gateway.app import create_app
from nesa_node.gateway.middleware import BODIES_BUFFERED, LimitBody
from tests.support.gateway import fake_gateway


class Echo:
    """The app behind LimitBody: answers 200 with the length of the body it read; counts the requests it saw."""

    def __init__(self):
        self.seen = 0

    async def __call__(self, scope, receive, send) -> None:
        self.seen += 1
        message = await receive()
        body = json.dumps({"length": len(message["body"])}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class Client:
    """One request to `limit`: its headers, then the body parts given to `feed` (more_body until `end`); `gone`
    makes it disconnect."""

    def __init__(self, limit: LimitBody, headers: dict[bytes, bytes], method: str = "POST"):
        self.parts: asyncio.Queue = asyncio.Queue()
        self.answer: dict = {"status": None, "body": b""}
        self.reads = 0  # how many times the gateway received from this client
        scope = {"type": "http", "method": method, "path": "/v1/completions", "headers": list(headers.items())}
        self.task = asyncio.ensure_future(limit(scope, self.receive, self.send))

    async def receive(self) -> dict:
        self.reads += 1
        return await self.parts.get()

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.answer["status"] = message["status"]
        else:
            self.answer["body"] += message.get("body", b"")

    def feed(self, data: bytes, *, end: bool = False) -> None:
        self.parts.put_nowait({"type": "http.request", "body": data, "more_body": not end})

    def gone(self) -> None:
        self.parts.put_nowait({"type": "http.disconnect"})

    async def done(self) -> dict:
        await asyncio.wait_for(self.task, 5)
        return self.answer


def code_of(answer: dict) -> str:
    return json.loads(answer["body"])["error"]["code"]


def sized(length: int) -> dict[bytes, bytes]:
    return {b"content-type": b"application/json", b"content-length": str(length).encode()}


async def test_a_body_trickling_past_its_deadline_is_a_408_and_lets_its_bytes_go():
    echo = Echo()
    limit = LimitBody(echo, max_bytes=1000, timeout_s=0.3)
    client = Client(limit, sized(100))
    client.feed(b"x" * 10)  # and no more
    await asyncio.sleep(0.05)
    assert limit.reading == 100  # held while it arrives
    answer = await client.done()
    assert answer["status"] == 408 and code_of(answer) == "request_timeout"
    assert echo.seen == 0 and limit.reading == 0
    fast = Client(limit, sized(100))  # one arriving in time goes on, whole
    fast.feed(b"y" * 60)
    fast.feed(b"y" * 40, end=True)
    answer = await fast.done()
    assert answer["status"] == 200 and json.loads(answer["body"]) == {"length": 100} and limit.reading == 0


async def test_bodies_being_read_share_one_budget_past_which_requests_are_refused_at_once():
    echo = Echo()
    limit = LimitBody(echo, max_bytes=1000, budget_bytes=2500, timeout_s=30)
    slow = [Client(limit, sized(1000)) for _ in range(2)]
    await asyncio.sleep(0.05)
    assert limit.reading == 2000 and all(client.reads == 1 for client in slow)
    over = Client(limit, sized(600))  # 2600 > 2500: refused before any of it is read
    answer = await over.done()
    assert answer["status"] == 503 and code_of(answer) == "server_busy" and over.reads == 0
    fits = Client(limit, sized(500))  # 2500: fits
    fits.feed(b"z" * 500, end=True)
    assert (await fits.done())["status"] == 200
    bodiless = Client(limit, {}, method="GET")  # no Content-Length, not chunked: no body, holds nothing
    bodiless.feed(b"", end=True)
    assert (await bodiless.done())["status"] == 200
    slow[0].gone()  # a client that leaves lets its share go
    await slow[0].done()
    assert limit.reading == 1000
    again = Client(limit, sized(600))
    again.feed(b"w" * 600, end=True)
    assert (await again.done())["status"] == 200
    slow[1].feed(b"v" * 1000, end=True)
    assert (await slow[1].done())["status"] == 200 and limit.reading == 0 and echo.seen == 4


async def test_a_chunked_body_holds_the_largest_size_it_may_come_to():
    limit = LimitBody(Echo(), max_bytes=1000, budget_bytes=1500, timeout_s=30)
    chunked = Client(limit, {b"transfer-encoding": b"chunked"})
    await asyncio.sleep(0.05)
    assert limit.reading == 1000
    answer = await Client(limit, sized(600)).done()
    assert answer["status"] == 503 and code_of(answer) == "server_busy"
    chunked.feed(b"a" * 700)
    chunked.feed(b"a" * 400, end=True)  # past max_bytes in chunks: 413, and its share let go
    answer = await chunked.done()
    assert answer["status"] == 413 and limit.reading == 0


def test_the_budget_defaults_to_a_number_of_the_largest_bodies():
    assert LimitBody(Echo(), max_bytes=1000).budget_bytes == BODIES_BUFFERED * 1000


async def test_a_client_sending_half_a_body_over_a_socket_gets_a_408_and_is_disconnected():
    """Served by uvicorn on 127.0.0.1: a client that sends its headers and part of its body, then nothing, gets
    408 within the gateway's body timeout and its connection is closed; the gateway keeps serving others."""
    gateway = fake_gateway(body_timeout_s=0.5)
    server = uvicorn.Server(uvicorn.Config(create_app(gateway), host="127.0.0.1", port=0, log_level="warning"))
    server.capture_signals = lambda: _no_signals()
    serving = asyncio.ensure_future(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 2}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # to the end: the gateway closes the connection
        writer.close()
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a whole request is served as ever
        writer.write(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)


def _no_signals():
    import contextlib

    return contextlib.nullcontext()
