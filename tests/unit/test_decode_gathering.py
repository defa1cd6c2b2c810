"""A node's decode batching with the gathering rule (server/compute.py, nesa_node/batching.py): once two sessions have
stepped together, a step of one waits for the other's, expected soon, and both run in one pass; a lone session's steps
never wait; a closed session is not waited for; sessions expected on one range of blocks never hold back a step on
another."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from nesa_node.metrics import _ComputeCollector
from nesa_node.server import compute as compute_module
from nesa_node.server.compute import BlockCompute, _DecodeStep
from nesa_node.server.config import ComputeConfig, LimitsConfig
from nesa_node.sharding.blocks import SpanSpec, load_block_span

ROUND_S = 0.08  # between rounds: a session's period, so it may be up to a quarter of it (20 ms) late and waited for


def compute_of(tiny_llama, **settings) -> tuple[BlockCompute, object]:
    span = load_block_span(tiny_llama, SpanSpec(0, 4))
    return BlockCompute(span, ComputeConfig(**settings), LimitsConfig()), span


async def step(compute: BlockCompute, cache, position: int, member, delay_s: float = 0.0, blocks=(0, 4)):
    await asyncio.sleep(delay_s)
    hidden = torch.randn(1, 1, compute.span.hidden_size, generator=torch.Generator().manual_seed(position))
    output, _ = await compute.run_decode(hidden, cache, position, blocks, member=member)
    return output


async def batched_when_late(compute: BlockCompute, late_s: float) -> int:
    """Rounds of one step per session: three with both sessions at once (each gets its period), then three with "b"
    `late_s` after "a"; the batched passes of the last three."""
    caches = {"a": compute.span.new_cache(), "b": compute.span.new_cache()}
    before = 0
    for position in range(6):
        if position == 3:
            before = compute.batches_run
        delay_s = late_s if position >= 3 else 0.0
        await asyncio.gather(
            step(compute, caches["a"], position, "a"), step(compute, caches["b"], position, "b", delay_s)
        )
        await asyncio.sleep(ROUND_S)
    compute.close()
    return compute.batches_run - before


@pytest.mark.serial  # a step 4 ms late: a busy host's hiccups exceed what is waited for
def test_a_step_waits_for_the_other_sessions_step_expected_soon(tiny_llama):
    compute, _ = compute_of(tiny_llama, batch_window_ms=200.0)
    assert asyncio.run(batched_when_late(compute, 0.004)) == 3  # b 4 ms after a: gathered into a's pass
    assert compute.gather_waits >= 3
    # the node's counters (its metrics): every pass held both sessions' steps, and ran on the compute thread; the
    # three late rounds each waited for b's step (4 ms after a's), the others not at all
    assert compute.steps_in_passes == 2 * compute.batches_run and compute.thread_steps >= compute.batches_run
    assert 3 * 0.003 <= compute.gather_wait_s < 1.0


@pytest.mark.serial  # a step 4 ms late: a busy host's hiccups exceed what is waited for
def test_without_a_window_a_late_step_runs_in_a_pass_of_its_own(tiny_llama):
    compute, _ = compute_of(tiny_llama, batch_window_ms=0.0)
    assert asyncio.run(batched_when_late(compute, 0.004)) == 0
    assert compute.gather_waits == 0 and compute.gather_wait_s < 0.003  # never waited (the time of a few checks)


def test_a_lone_session_never_waits_and_a_closed_one_is_not_waited_for(tiny_llama):
    compute, _ = compute_of(tiny_llama, batch_window_ms=200.0)

    async def rounds(members: list[str], count: int, start: int) -> None:
        caches = {member: compute.span.new_cache() for member in members}
        for position in range(count):
            await asyncio.gather(*(step(compute, caches[member], start + position, member) for member in members))
            await asyncio.sleep(ROUND_S)

    async def program() -> tuple[int, int]:
        await rounds(["a"], 5, 0)
        alone = compute.gather_waits
        await rounds(["b", "c"], 3, 0)  # b and c step together, then c's session closes
        compute.forget("c")
        before = compute.gather_waits
        await rounds(["b"], 3, 3)  # b alone now: c is not waited for
        compute.close()
        return alone, compute.gather_waits - before

    assert asyncio.run(program()) == (0, 0)


def test_a_cap_on_steps_a_pass_splits_a_round_into_passes_that_start_without_waiting(tiny_llama):
    """With --max-pass-steps 2, five sessions stepping together run in passes of at most two steps (three a round),
    none waiting for the others once two are queued (the window is long: without the cap every round is one pass
    after a wait), and each session's outputs equal its own steps run alone."""
    compute, span = compute_of(tiny_llama, batch_window_ms=500.0, max_pass_steps=2)
    members = ["a", "b", "c", "d", "e"]

    async def program() -> list[list[torch.Tensor]]:
        caches = {member: span.new_cache() for member in members}
        outputs = []
        for position in range(4):
            outputs.append(
                await asyncio.gather(*(step(compute, caches[member], position, member) for member in members))
            )
            await asyncio.sleep(ROUND_S)
        compute.close()
        return outputs

    rounds = asyncio.run(program())
    assert compute.steps_in_passes <= 2 * compute.batches_run and compute.batches_run >= 2 * 3
    alone = {member: span.new_cache() for member in members}
    with torch.inference_mode():
        for position, outputs in enumerate(rounds):
            for member, output in zip(members, outputs, strict=True):
                hidden = torch.randn(1, 1, span.hidden_size, generator=torch.Generator().manual_seed(position))
                assert torch.allclose(output, span(hidden, alone[member], position), atol=1e-5), (position, member)


@pytest.mark.serial  # the waits are timed
@pytest.mark.parametrize("cap", [0, 2])
def test_once_a_pass_of_steps_is_queued_nobody_is_waited_for(tiny_llama, cap):
    """a and b step together every round, c 30 ms after them. Without a cap their passes wait for c (expected within
    the window); with --max-pass-steps 2, a and b make a pass at once and c's step runs when it comes."""
    compute, span = compute_of(tiny_llama, batch_window_ms=200.0, max_pass_steps=cap)

    async def program() -> None:
        caches = {member: span.new_cache() for member in "abc"}
        for position in range(6):
            await asyncio.gather(
                step(compute, caches["a"], position, "a"),
                step(compute, caches["b"], position, "b"),
                step(compute, caches["c"], position, "c", 0.03 if position >= 2 else 0.0),
            )
            await asyncio.sleep(ROUND_S)
        compute.close()

    asyncio.run(program())
    if cap:
        assert compute.gather_wait_s < 0.02 and compute.steps_in_passes <= 2 * compute.batches_run
    else:
        assert compute.gather_wait_s >= 3 * 0.02  # rounds 3 to 6 waited for c (first two: its period unknown)


def test_sessions_expected_on_one_range_do_not_hold_back_a_step_on_another(tiny_llama):
    """Two sessions step on blocks 0:2 every round; then one of them stops while the other's step waits for it. A
    step on blocks 2:4 that comes meanwhile runs at once, not after 0:2's wait."""
    compute, _ = compute_of(tiny_llama, batch_window_ms=200.0)

    async def program() -> list[str]:
        caches = {name: compute.span.new_cache() for name in ("a", "b", "lone")}
        for position in range(3):
            await asyncio.gather(
                step(compute, caches["a"], position, "a", blocks=(0, 2)),
                step(compute, caches["b"], position, "b", blocks=(0, 2)),
            )
            await asyncio.sleep(ROUND_S)
        done = []

        async def tracked(name, coroutine):
            await coroutine
            done.append(name)

        await asyncio.gather(
            tracked("a", step(compute, caches["a"], 3, "a", blocks=(0, 2))),  # waits for b, which never comes
            tracked("lone", step(compute, caches["lone"], 0, "lone", 0.002, blocks=(2, 4))),
        )
        compute.close()
        return done

    assert asyncio.run(program()) == ["lone", "a"]


def test_a_lone_sessions_small_steps_skip_the_queue_and_give_the_spans_output(tiny_llama):
    """Alone, a session's one-token steps run at once on the loop once steps are known to be small (the first goes
    to the compute thread); their outputs are the span's own. A second session stepping sends steps through the
    queue again, where they are batched."""
    compute, span = compute_of(tiny_llama, batch_window_ms=200.0, inline_compute_ms=1000.0)  # steps run inline
    reference_cache, cache = span.new_cache(), span.new_cache()

    async def program() -> int:
        for position in range(6):
            output = await step(compute, cache, position, "a")
            hidden = torch.randn(1, 1, span.hidden_size, generator=torch.Generator().manual_seed(position))
            with torch.inference_mode():
                expected = span(hidden, reference_cache, position)
            assert torch.equal(output, expected)
        lone = compute.lone_steps
        compute.forget("a")
        caches = {"b": span.new_cache(), "c": span.new_cache()}
        after_first = compute.lone_steps
        for position in range(4):  # in the first round b may run alone: c has not stepped yet
            await asyncio.gather(*(step(compute, caches[member], position, member) for member in caches))
            await asyncio.sleep(ROUND_S)
            after_first = compute.lone_steps if position == 0 else after_first
        compute.close()
        return lone, compute.lone_steps - after_first

    assert asyncio.run(program()) == (5, 0)
    assert compute.batches_run >= 2


def test_a_small_step_waits_for_the_compute_thread_instead_of_running_beside_it(tiny_llama):
    """Short steps run on the loop, but never while the compute thread computes (a long prompt of another session):
    the node never runs two computations at once (on a GPU one may be a CUDA graph capture, which another thread's
    device work makes fail). The step waits for the thread and runs there, after the prompt."""
    compute, span = compute_of(tiny_llama, inline_compute_ms=1000.0)
    plain_step = span.step
    ran = []  # (tokens, thread, started, ended)

    def recorded_step(hidden, cache, position, blocks):
        started = time.perf_counter()
        if hidden.shape[1] > 1:
            time.sleep(0.3)  # a long prompt
        output = plain_step(hidden, cache, position, blocks)
        ran.append((hidden.shape[1], threading.current_thread().name, started, time.perf_counter()))
        return output

    span.step = recorded_step

    async def program() -> None:
        cache, other = span.new_cache(), span.new_cache()
        for position in range(2):  # the first small step goes to the thread; once timed as short, they run inline
            await step(compute, cache, position, "a")
        prompt = torch.randn(1, 16, span.hidden_size)
        prefill = asyncio.create_task(compute.run(prompt, other, 0, (0, 4)))
        await asyncio.sleep(0.05)  # the prompt is on the compute thread
        await step(compute, cache, 2, "a")
        await prefill
        compute.close()

    asyncio.run(program())
    (_, first, *_), (_, second, *_), (tokens, _, prompt_started, prompt_ended), last = ran
    assert first.startswith("nesa-compute") and second == threading.main_thread().name and tokens == 16
    assert last[1].startswith("nesa-compute") and last[2] >= prompt_ended  # after the prompt, on the thread


def test_a_thread_job_cancelled_before_it_ran_does_not_keep_steps_off_the_loop(tiny_llama):
    """A step whose session gave up while it waited behind a long job is taken out of the thread's queue unrun: the
    thread counts as idle once the long job is done, and short steps run on the loop again."""
    compute, span = compute_of(tiny_llama, inline_compute_ms=1000.0)

    async def program() -> tuple[int, bool]:
        cache = span.new_cache()
        await step(compute, cache, 0, "a")  # timed: the next short steps may run inline
        long_job = asyncio.create_task(compute.run_work(lambda: time.sleep(0.3)))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(compute.run_work(lambda: None))
        await asyncio.sleep(0.05)
        queued.cancel()  # still in the queue behind the long job
        await asyncio.gather(queued, return_exceptions=True)
        await long_job
        jobs, inline = compute._thread_jobs, compute._inline()
        compute.close()
        return jobs, inline

    assert asyncio.run(program()) == (0, True)


def _late_rounds(tiny_llama) -> tuple[BlockCompute, dict]:
    """Two sessions on a span with decode graphs, no gathering window: three rounds together, then three with b
    30 ms after a, each step of the late rounds given alone by the queue; every output checked against the span's
    own steps. Returns the compute and the sessions' caches."""
    span = load_block_span(tiny_llama, SpanSpec(0, 4, decode_graphs=True))
    plain = load_block_span(tiny_llama, SpanSpec(0, 4))
    compute = BlockCompute(span, ComputeConfig(batch_window_ms=0.0), LimitsConfig())  # a late step is not waited for
    caches, theirs = {m: span.new_cache() for m in "ab"}, {m: plain.new_cache() for m in "ab"}
    for cache in caches.values():
        cache.reserve(16)

    async def one(member: str, position: int, delay_s: float) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
        seed = 2 * position + (member == "b")
        hidden = torch.randn(1, 1, span.hidden_size, generator=torch.Generator().manual_seed(seed))
        output, _ = await compute.run_decode(hidden, caches[member], position, (0, 4), member=member)
        with torch.inference_mode():
            expected = plain(hidden, theirs[member], position)
        torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)

    async def program() -> None:
        for position in range(6):
            await asyncio.gather(one("a", position, 0.0), one("b", position, 0.03 if position >= 3 else 0.0))
            await asyncio.sleep(ROUND_S)
        compute.close()

    asyncio.run(program())
    return compute, caches


def test_steps_given_alone_while_others_step_run_as_passes_not_graphs_of_their_own(tiny_llama, monkeypatch):
    """On a span replaying batched passes, a step the queue gives alone while another session steps runs as a pass
    of one: the batch held for the two sessions replays it, the other's row absent, and neither session gets a
    fixed step (graph) of its own."""
    monkeypatch.setattr(compute_module, "SINGLES_AS_PASSES", 100)
    compute, caches = _late_rounds(tiny_llama)
    assert caches["a"].fixed_step is None and caches["b"].fixed_step is None
    assert compute.single_passes >= 4 and compute.fixed_built == 1 and compute.fixed_absent_rows >= 2
    assert compute.batches_run >= 2 and compute.steps_in_passes == 2 * compute.batches_run


def test_a_session_given_steps_alone_more_often_gets_a_graph_of_its_own(tiny_llama, monkeypatch):
    """After SINGLES_AS_PASSES of its steps given alone (1 here), a session's next such steps run its own fixed
    step, as a lone session's do."""
    monkeypatch.setattr(compute_module, "SINGLES_AS_PASSES", 1)
    compute, caches = _late_rounds(tiny_llama)
    assert caches["a"].fixed_step is not None and caches["b"].fixed_step is not None
    assert compute.single_passes == 2  # each session's first


def test_a_pass_of_one_that_fails_in_the_blocks_fails_its_step_with_its_cache_rewound(tiny_llama):
    """A pass of one that raises in the blocks after writing its cache (out of memory, say) is not a batch to split:
    its step gets the error, the cache is rewound to the step's position and nothing runs it again."""
    span = load_block_span(tiny_llama, SpanSpec(0, 4, decode_graphs=True))
    compute = BlockCompute(span, ComputeConfig(), LimitsConfig())
    cache, calls = span.new_cache(), []

    def failing_run_batch(steps, blocks):
        hidden, step_cache, position = steps[0]
        span.step(hidden, step_cache, position)  # the cache takes the token, then the pass fails
        calls.append(len(steps))
        raise RuntimeError("CUDA out of memory (a test's)")

    span.run_batch = failing_run_batch

    async def program():
        hidden = torch.randn(1, 2, span.hidden_size)
        with torch.inference_mode():
            span(hidden, cache, 0)  # two tokens held
        future = asyncio.get_running_loop().create_future()
        step = _DecodeStep(torch.randn(1, 1, span.hidden_size), cache, 2, (0, 4), future, member="a")
        await compute._settle_batch([step])
        compute.close()
        return future

    future = asyncio.run(program())
    assert isinstance(future.exception(), RuntimeError) and calls == [1]
    assert cache.get_seq_length() == 2 and compute.passes_split == 0


@pytest.mark.gpu
def test_a_cuda_nodes_session_outputs_come_back_on_the_host(tiny_llama):
    """On CUDA with decode graphs, the outputs of a session's prompt, of its lone steps and of two sessions' passes
    come back on the CPU (a pass's in one copy: the node sends bytes, and keeps a session's outputs together), equal
    to the span's own steps on the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    span = load_block_span(tiny_llama, SpanSpec(0, 4, device="cuda", decode_graphs=True))
    plain = load_block_span(tiny_llama, SpanSpec(0, 4, device="cuda"))
    compute = BlockCompute(span, ComputeConfig(batch_window_ms=200.0), LimitsConfig())
    caches, theirs = {m: span.new_cache() for m in "ab"}, {m: plain.new_cache() for m in "ab"}
    for cache in caches.values():
        cache.reserve(32)

    async def one(member: str, position: int, tokens: int = 1) -> None:
        seed = 2 * position + (member == "b")
        hidden = torch.randn(1, tokens, span.hidden_size, generator=torch.Generator().manual_seed(seed))
        output, _ = await compute.run_decode(hidden, caches[member], position, (0, 4), member=member)
        assert output.device.type == "cpu" and output.shape == (1, tokens, span.hidden_size)
        with torch.inference_mode():
            expected = plain(hidden.cuda(), theirs[member], position).cpu()
        torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)

    async def program() -> None:
        await one("a", 0, tokens=3)  # a's prompt, then its steps alone
        for position in range(3, 6):
            await one("a", position)
        await one("b", 0, tokens=3)
        for position in range(6, 12):  # then a and b together
            await asyncio.gather(one("a", position), one("b", position - 3))
            await asyncio.sleep(ROUND_S)
        compute.close()

    asyncio.run(program())
    assert compute.batches_run >= 3 and compute.fixed_passes >= 1
    assert compute.step_graphs_built >= 1  # a's steps alone: its own captured step
    # the node's metrics report the device memory its process holds
    scraped = {
        (family.name, tuple(sample.labels.items())): sample.value
        for family in _ComputeCollector(compute).collect()
        for sample in family.samples
    }
    memory = {
        state: scraped[("nesa_node_device_memory_bytes", (("state", state),))]
        for state in ("allocated", "reserved", "peak")
    }
    assert 0 < memory["allocated"] <= memory["reserved"] <= memory["peak"]
    assert scraped[("nesa_node_step_graphs_built", ())] == compute.step_graphs_built


def test_a_step_queued_before_the_node_moves_fails_rather_than_run_on_the_new_span(tiny_llama):
    """A step waits in the queue (its session expects another's step soon) while the node loads another span: its
    cache was built for the span it was checked against, so it fails (the client routes around the node) instead of
    running on the new span's layers."""
    from nesa_node.errors import TooManySessionsError

    compute, _ = compute_of(tiny_llama, batch_window_ms=300.0)

    async def program() -> None:
        caches = {"a": compute.span.new_cache(), "b": compute.span.new_cache()}
        for position in range(3):  # together: each now expects the other's steps
            await asyncio.gather(*(step(compute, caches[member], position, member) for member in caches))
            await asyncio.sleep(ROUND_S)
        waiting = asyncio.create_task(step(compute, caches["a"], 3, "a"))  # b's step expected soon: a's waits
        for _ in range(100):  # turns of the loop until it is queued (before any pass can take it)
            await asyncio.sleep(0)
            if compute._decode_queue:
                break
        assert not waiting.done() and compute._decode_queue
        compute.span = load_block_span(tiny_llama, SpanSpec(0, 4))  # a move: another span object
        with pytest.raises(TooManySessionsError, match="moved to other blocks"):
            await waiting
        compute.close()

    asyncio.run(program())
