"""What one client can hold of a gateway (nesa_node/gateway/streams.py, callers.py): a stream whose client stops
reading ends once a chunk waits `send_timeout_s`, freeing its generation slot and closing its session (with no error
in uvicorn's log); and one caller
(an API key, or a client address without keys) has at most `max_requests_per_caller` requests running or waiting
while the gateway's slots are all taken."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from nesa_node.gateway import streams
from nesa_node.gateway.app import create_app
from nesa_node.gateway.auth import ApiKeys
from nesa_node.gateway.callers import caller_address
from tests.support.gateway import asgi_request, error_of, fake_gateway

LONG_STREAM = {"model": "m", "prompt": "hello there", "max_tokens": 5000, "stream": True}
SHORT = {"model": "m", "prompt": "hello there", "max_tokens": 2}


async def until(condition, timeout_s: float = 5.0) -> None:
    """Poll `condition` until it holds; AssertionError past `timeout_s`."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition did not come true")


async def test_a_stream_whose_client_stops_reading_ends_and_frees_its_slot_and_session():
    gateway = fake_gateway(max_concurrency=1, send_timeout_s=0.2)
    app = create_app(gateway)
    # the client takes three chunks, then nothing: without a bound on each write, the stream would wait forever
    stalled = await asyncio.wait_for(
        asgi_request(app, "POST", "/v1/completions", LONG_STREAM, stop_reading_after=3), 10
    )
    assert stalled["status"] == 200 and len(stalled["chunks"]) == 3
    assert not gateway.slots.locked() and gateway.callers.held("address:127.0.0.1") == 0
    assert gateway.model.streams_closed == 1
    await until(lambda: gateway.model.sessions[0].closed, timeout_s=1)  # closed in a task of its own
    assert gateway.metrics.requests_running._value.get() == 0
    # the one slot serves the next request at once
    answer = await asyncio.wait_for(asgi_request(app, "POST", "/v1/completions", SHORT), 5)
    assert answer["status"] == 200


async def test_a_stream_cut_for_a_stalled_reader_leaves_no_error_in_uvicorns_log(caplog, monkeypatch):
    """Through a real uvicorn server: a client that stops reading fills the socket, the stream is cut after
    `send_timeout_s`, and the log says so at INFO, with no ERROR line (uvicorn's about the unfinished response is
    dropped for such a stream) and no traceback; the slot is free again."""
    import json
    import socket

    import uvicorn

    # what uvicorn's error logger lets through (its handlers run after its filters; an earlier test's uvicorn may
    # have stopped it propagating to the root logger), and what the filter dropped
    passed, dropped = [], []
    seen = logging.Handler()
    seen.emit = passed.append
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(seen)
    filter_of = streams._QuietCutStreams.filter

    def spied(self, record) -> bool:
        kept = filter_of(self, record)
        dropped.extend([] if kept else [record.getMessage()])
        return kept

    monkeypatch.setattr(streams._QuietCutStreams, "filter", spied)
    gateway = fake_gateway(max_concurrency=1, delay_s=0, max_length=200_000, send_timeout_s=0.5)
    server = uvicorn.Server(uvicorn.Config(create_app(gateway), host="127.0.0.1", port=0, log_config=None))
    server.capture_signals = contextlib.nullcontext  # the test's loop keeps its signal handlers
    serving = asyncio.ensure_future(server.serve())
    caplog.set_level(logging.INFO)
    client = socket.socket()
    try:
        await until(lambda: server.started)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes block
        client.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(client, server.servers[0].sockets[0].getsockname()[:2])
        body = json.dumps({**LONG_STREAM, "max_tokens": 100_000}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        await loop.sock_sendall(client, f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
        assert (await asyncio.wait_for(loop.sock_recv(client, 256), 10)).startswith(b"HTTP/1.1 200")
        await until(lambda: gateway.model.streams_closed == 1, timeout_s=20)  # then it reads nothing more
        await until(lambda: not gateway.slots.locked())
        await until(lambda: gateway.model.sessions[0].closed, timeout_s=1)  # closed in a task of its own
        await until(lambda: dropped)  # uvicorn's line, written once the app returned (the client still connected)
    finally:
        uvicorn_log.removeHandler(seen)
        client.close()
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
    assert "took nothing of its stream" in caplog.text
    assert dropped == [streams.UNFINISHED]
    errors = [record for record in caplog.records + passed if record.levelno >= logging.ERROR]
    assert errors == [] and "Traceback" not in caplog.text, caplog.text


async def test_a_client_that_goes_away_mid_stream_frees_its_slot_at_once():
    gateway = fake_gateway(max_concurrency=1, delay_s=0.01)
    app = create_app(gateway)
    gone = asyncio.Event()
    streaming = asyncio.ensure_future(asgi_request(app, "POST", "/v1/completions", LONG_STREAM, gone=gone))
    await until(lambda: gateway.model.sessions)
    gone.set()
    await asyncio.wait_for(streaming, 5)
    assert not gateway.slots.locked() and gateway.model.streams_closed == 1
    await until(lambda: gateway.model.sessions[0].closed, timeout_s=1)


@pytest.mark.parametrize("keys", [False, True])
async def test_one_caller_holds_at_most_its_share_of_a_full_gateway(keys):
    """Without keys a caller is a client address; with keys, a key, from whichever address it comes. While slots
    are free a caller may use them past its share; once they are all taken, it gets no more (not even a waiting
    place), while others still wait for the next free slot and are served."""
    gateway = fake_gateway(
        max_concurrency=4, delay_s=0.01, api_keys=ApiKeys(["sk-a", "sk-b"]) if keys else None
    )  # a quarter of 4: 1 request per caller while the gateway is full
    app = create_app(gateway)
    first = {"headers": {"Authorization": "Bearer sk-a"}} if keys else {"client": ("192.0.2.1", 1)}
    same = {"headers": {"Authorization": "Bearer sk-a"}, "client": ("192.0.2.9", 2)} if keys else first
    other = {"headers": {"Authorization": "Bearer sk-b"}} if keys else {"client": ("192.0.2.2", 1)}
    gone = asyncio.Event()
    held = []
    for count in range(1, 5):  # past its share of 1, each taking a free slot
        held.append(
            asyncio.ensure_future(asgi_request(app, "POST", "/v1/completions", LONG_STREAM, gone=gone, **first))
        )
        await until(lambda count=count: len(gateway.model.sessions) == count)
    assert gateway.slots.locked()

    refused = await asyncio.wait_for(asgi_request(app, "POST", "/v1/completions", SHORT, **same), 5)
    assert refused["status"] == 429
    error = error_of(refused)
    assert error["code"] == "too_many_concurrent_requests" and error["type"] == "rate_limit_error"
    assert ("this API key" if keys else "this client address") in error["message"] and "at most 1" in error["message"]
    assert gateway.contended
    caller = gateway.api_keys.identify("Bearer sk-a") if keys else "address:192.0.2.1"
    assert gateway.callers.held(caller) == 4
    # another caller waits for the next free slot, and is served once the first caller's streams end
    waiting = asyncio.ensure_future(asgi_request(app, "POST", "/v1/completions", SHORT, **other))
    await until(lambda: not waiting.done() and gateway._waiting == 1)
    gone.set()
    assert (await asyncio.wait_for(waiting, 5))["status"] == 200
    await asyncio.wait_for(asyncio.gather(*held), 5)
    assert gateway.callers.held(caller) == 0
    answer = await asyncio.wait_for(asgi_request(app, "POST", "/v1/completions", SHORT, **same), 5)
    assert answer["status"] == 200


async def test_a_refused_request_gives_its_place_back():
    gateway = fake_gateway(max_concurrency=4)  # one request per caller
    app = create_app(gateway)
    for _ in range(3):  # each refused before its generation: its place is free for the next
        answer = await asgi_request(app, "POST", "/v1/completions", {"model": "m", "prompt": "x", "best_of": 2})
        assert answer["status"] == 400 and error_of(answer)["code"] == "unsupported_parameter"
    answer = await asyncio.wait_for(asgi_request(app, "POST", "/v1/completions", SHORT), 5)
    assert answer["status"] == 200 and gateway.callers.held("address:127.0.0.1") == 0


def test_a_callers_share_is_a_quarter_of_the_slots_unless_set():
    assert fake_gateway(max_concurrency=64).callers.limit == 16
    assert fake_gateway(max_concurrency=3).callers.limit == 1
    assert fake_gateway(max_concurrency=3, max_requests_per_caller=5).callers.limit == 5
    assert fake_gateway().send_timeout_s == 30.0


@pytest.mark.parametrize(
    ("host", "caller"),
    [
        ("192.0.2.7", "address:192.0.2.7"),
        ("2001:db8:1:2:aaaa::1", "address:2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::9", "address:2001:db8:1:2::/64"),
        ("::ffff:192.0.2.7", "address:192.0.2.7"),
        ("64:ff9b::c000:207", "address:192.0.2.7"),  # NAT64: each IPv4 host behind the translator its own caller
        ("64:ff9b::c000:208", "address:192.0.2.8"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "address:192.0.2.45"),  # a Teredo client (RFC 4380's example)
        ("2002:c000:0207:1::1", "address:192.0.2.7"),  # a 6to4 site, whichever of its /64s
        ("2002:c000:0207:2::1", "address:192.0.2.7"),
        ("fe80::1", "address:fe80::/64"),  # link-local: one caller a link, whatever addresses its hosts take
        ("fe80::2%eth0", "address:fe80::/64%eth0"),
        ("fe80::3%eth0", "address:fe80::/64%eth0"),
        ("fe80::2%eth1", "address:fe80::/64%eth1"),
        ("testclient", "address:testclient"),
    ],
)
def test_an_ipv6_client_is_one_caller_per_64(host, caller):
    """A host given a whole /64 (as IPv6 hosts and sites commonly are) is one caller, not one per address; an IPv6
    address standing for an IPv4 host is that host, and link-local addresses are one caller a link."""
    assert caller_address(host) == caller


async def test_a_burst_past_the_slots_is_held_to_the_share_from_its_first_request_over():
    """Requests are counted as they are admitted (before their prompts are prepared or their adapters looked up):
    a burst of one caller takes the free slots, and past them it is refused at once, the waiting places left to
    others."""
    gateway = fake_gateway(max_concurrency=4, delay_s=0.01)  # a share of 1 while the gateway is full
    app = create_app(gateway)
    gone = asyncio.Event()
    burst = [asyncio.ensure_future(asgi_request(app, "POST", "/v1/completions", LONG_STREAM, gone=gone))
             for _ in range(6)]  # fmt: skip
    await until(lambda: sum(task.done() for task in burst) == 2)  # the two past the slots, refused
    refused = [task.result() for task in burst if task.done()]
    assert [answer["status"] for answer in refused] == [429, 429]
    assert {error_of(answer)["code"] for answer in refused} == {"too_many_concurrent_requests"}
    # the four admitted ones take the four slots (their prompts may still be in the tokenizer's thread for a moment)
    await until(lambda: gateway._waiting == 0 and gateway.metrics.requests_running._value.get() == 4)
    assert gateway.callers.total == 4 and sum(task.done() for task in burst) == 2
    gone.set()
    await asyncio.wait_for(asyncio.gather(*burst), 5)
    assert gateway.callers.total == 0
