"""Streamed answers do not wait for their canary checks (verify="canary:P"): those run after them, at most
max_concurrency at once, and at most CHECKS_WAITING_PER_SLOT x max_concurrency waiting; answers streamed faster than
their checks run go unchecked past that (counted "skipped"), instead of the checks piling up without bound."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from nesa_node.gateway.app import CHECKS_WAITING_PER_SLOT, Gateway, create_app
from tests.support.gateway import FakeModel, FakeSession, WordTokenizer, asgi_request


class SlowCanaries(FakeModel):
    """A model whose canary checks wait until `release` is set."""

    canary_checker = object()

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(verify="canary:1.0")
        self.release = asyncio.Event()
        self.checked = 0

    async def open_session(self, **options) -> FakeSession:
        session = await super().open_session(**options)
        session.chain = SimpleNamespace(hops=())
        return session

    async def check_canaries(self, chain, *, max_length: int, prompt_tokens: int):
        await self.release.wait()
        self.checked += 1
        return SimpleNamespace(report=lambda: {"mode": "canary:1.0", "checks": {"passed": 1}, "blamed": []})


def skipped(gateway: Gateway) -> float:
    return gateway.metrics.verification_checks_total.labels("skipped")._value.get()


async def test_streamed_answers_past_the_checks_backlog_go_unchecked():
    model = SlowCanaries()
    gateway = Gateway(model, WordTokenizer(), model_name="m", max_concurrency=1)
    app = create_app(gateway)
    limit = CHECKS_WAITING_PER_SLOT * 1
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}
    for _ in range(limit + 2):
        answer = await asgi_request(app, "POST", "/v1/completions", body)
        assert answer["status"] == 200 and answer["body"].endswith(b"data: [DONE]\n\n"), answer
    assert skipped(gateway) == 2  # the last two answers went unchecked
    model.release.set()
    for _ in range(200):
        if model.checked >= limit and gateway._canary_pending == 0:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # a check left waiting (one past the backlog) would run meanwhile, one at a time
    assert model.checked == limit and gateway._canary_pending == 0
