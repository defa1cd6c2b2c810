"""A node's decode batching with the gathering rule (server/compute.py, nesa_node/batching.py): once two sessions have
stepped together, a step of one waits for the other's, expected soon, and both run in one pass; a lone session's steps
never wait; a session that closed is not waited for."""

from __future__ import annotations

import asyncio
import time

import torch

from nesa_node.server.compute import BlockCompute
from nesa_node.server.config import ComputeConfig, LimitsConfig
from nesa_node.sharding.blocks import SpanSpec, load_block_span


def compute_of(tiny_llama, **settings) -> tuple[BlockCompute, object]:
    span = load_block_span(tiny_llama, SpanSpec(0, 4))
    return BlockCompute(span, ComputeConfig(**settings), LimitsConfig()), span


async def step(compute: BlockCompute, span, cache, position: int, member, delay_s: float = 0.0):
    await asyncio.sleep(delay_s)
    hidden = torch.randn(1, 1, span.hidden_size, generator=torch.Generator().manual_seed(position))
    output, _ = await compute.run_decode(hidden, cache, position, (0, 4), member=member)
    return output


async def batched_when_late(compute: BlockCompute, span, late_s: float) -> int:
    """Rounds 30 ms apart of one step per session: three with both sessions at once (each gets its period), then
    three with "b" `late_s` after "a"; the batched passes of the last three."""
    caches = {"a": span.new_cache(), "b": span.new_cache()}
    before = 0
    for position in range(6):
        if position == 3:
            before = compute.batches_run
        delay_s = late_s if position >= 3 else 0.0
        await asyncio.gather(
            step(compute, span, caches["a"], position, "a"), step(compute, span, caches["b"], position, "b", delay_s)
        )
        await asyncio.sleep(0.03)
    compute.close()
    return compute.batches_run - before


def test_a_step_waits_for_the_other_sessions_step_expected_soon(tiny_llama):
    compute, span = compute_of(tiny_llama, batch_window_ms=200.0)
    assert asyncio.run(batched_when_late(compute, span, 0.004)) == 3  # b 4 ms after a: gathered into a's pass


def test_without_a_window_a_late_step_runs_in_a_pass_of_its_own(tiny_llama):
    compute, span = compute_of(tiny_llama, batch_window_ms=0.0)
    assert asyncio.run(batched_when_late(compute, span, 0.004)) == 0


def test_a_lone_session_and_a_closed_one_are_not_waited_for(tiny_llama):
    compute, span = compute_of(tiny_llama, batch_window_ms=200.0)
    cache = span.new_cache()

    async def alone() -> None:
        for position in range(5):
            await step(compute, span, cache, position, "a")
            await asyncio.sleep(0.03)

    asyncio.run(alone())
    gathering = compute.gatherings[(0, 4)]
    assert gathering.wait_s({"a"}, time.monotonic(), time.monotonic(), late_s=0.01) == 0.0
    now = time.monotonic()
    gathering.arrived("b", now - 0.04)
    gathering.arrived("b", now - 0.01)  # b's next step is due at now + 0.02
    assert gathering.wait_s({"a"}, now + 0.015, now + 0.015, late_s=0.001) > 0  # a would wait for it
    compute.forget("b")
    assert gathering.wait_s({"a"}, now + 0.015, now + 0.015, late_s=0.001) == 0.0
    compute.close()
