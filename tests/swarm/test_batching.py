"""Decode batching across sessions: a node runs the one-token steps of concurrent sessions on the same blocks in one
pass, each with its own KV cache and position, and the client scores their next tokens in shared LM head passes.
Every session's tokens equal its own single-process run (compression "none", float32, CPU), and the nodes and the
client did batch."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.config import ClientConfig
from nesa_node.sharding.blocks import SpanSpec, load_block_span
from tests.support.swarm import wait_for_chain, wait_until

pytestmark = pytest.mark.serial  # measures time: run alone, after the parallel pass (Makefile)

PROMPTS = [[5, 6, 7], [100, 3, 44, 9, 12], [8], [301, 302], [17, 18, 19, 20, 21, 22], [999, 1]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def references(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False) for prompt in PROMPTS
        ]


def generate_concurrently(model) -> list[torch.Tensor]:
    async def all_at_once():
        return await asyncio.gather(
            *(
                model.client.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
                for prompt in PROMPTS
            )
        )

    return model.call(all_at_once(), timeout=120)


def sessions_at_once(swarm, path: str, prefix: str) -> list[torch.Tensor]:
    """Every prompt's generation, all at once, by a client of the nodes under `prefix`."""
    with DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=swarm.initial_peers, dht_prefix=prefix, compression="none"
    ) as model:
        wait_for_chain(model)
        return generate_concurrently(model)


@pytest.mark.parametrize(
    "spans, waves",
    [(((0, 4),), 1), (((0, 2), (2, 4)), 1), (((0, 2), (2, 4)), 3)],
    ids=["one-node", "two-nodes", "two-nodes-3-waves"],
)
def test_concurrent_sessions_batched_give_each_its_own_tokens(module_swarm, tiny_llama, references, spans, waves):
    """With head_waves 3 the client keeps its sessions in 3 waves (passes of 2 sessions, the nodes gathering none):
    every session's tokens are still its own."""
    prefix = f"batch-{len(spans)}-{waves}"
    window = {} if waves == 1 else {"batch_window_ms": 0.0}
    nodes = [module_swarm.start_node(tiny_llama, start, end, dht_prefix=prefix, **window) for start, end in spans]
    # each step's output a node keeps (for a replacement of its next node) owns its storage: not a view of the pass
    owned, compute_step = [], nodes[0].inference._compute_step

    async def recording(session, request, step, pushed):
        output, seconds = await compute_step(session, request, step, pushed)
        owned.append(output.untyped_storage().nbytes() == output.numel() * output.element_size())
        return output, seconds

    nodes[0].inference._compute_step = recording
    try:
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama,
            initial_peers=module_swarm.initial_peers,
            dht_prefix=prefix,
            compression="none",
            config=ClientConfig(head_waves=waves),
        ) as model:
            wait_for_chain(model)
            rows, head = [], model.client.head.head
            model.client.head.head = lambda hidden: rows.append(hidden.shape[0]) or head(hidden)
            outputs = generate_concurrently(model)
            head_passes = model.client.head.batched_passes
        assert max(rows) <= len(PROMPTS) // waves and (waves == 1 or max(rows) > 1), rows  # a wave's sessions a pass
        for output, reference in zip(outputs, references, strict=True):
            assert torch.equal(output, reference)
        assert all(node.compute.batches_run > 0 for node in nodes), [node.compute.batches_run for node in nodes]
        assert all(node.compute.prompts_batched == 0 for node in nodes)  # prompts run alone unless asked
        assert head_passes > 0
        assert owned and all(owned), owned
    finally:
        for node in nodes:
            module_swarm.stop_node(node)


def test_a_node_told_not_to_batch_runs_each_step_alone(module_swarm, tiny_llama, references):
    node = module_swarm.start_node(tiny_llama, 0, 4, dht_prefix="no-batch", batch_decode=False)
    try:
        outputs = sessions_at_once(module_swarm, tiny_llama, "no-batch")
        assert all(torch.equal(output, reference) for output, reference in zip(outputs, references, strict=True))
        assert node.compute.batches_run == 0
    finally:
        module_swarm.stop_node(node)


def test_a_pass_that_fails_in_the_blocks_is_run_again_a_step_at_a_time(module_swarm, tiny_llama, references):
    """A batched pass that raises a torch error after writing part of the caches (out of memory, say) fails no
    session: the caches are rewound to their steps' positions and each step runs alone. Tokens stay each session's
    own (a cache left holding the failed pass's token would change them)."""
    node = module_swarm.start_node(tiny_llama, 0, 4, dht_prefix="split")
    span = node.compute.span
    run_batch, failed = span.run_batch, []

    def failing_run_batch(steps, blocks):
        if len(failed) < 3:
            hidden, cache, position = steps[0]
            span.step(hidden, cache, position)  # the first session's cache takes the token, then the pass fails
            failed.append(len(steps))
            raise RuntimeError("CUDA out of memory (a test's)")
        return run_batch(steps, blocks)

    span.run_batch = failing_run_batch
    try:
        outputs = sessions_at_once(module_swarm, tiny_llama, "split")
        for output, reference in zip(outputs, references, strict=True):
            assert torch.equal(output, reference)
        assert len(failed) == 3 and all(steps > 1 for steps in failed), failed
        assert node.compute.passes_split == 3
    finally:
        module_swarm.stop_node(node)


@pytest.mark.parametrize("attention", ["per_session", "padded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_batched_pass_equals_each_sessions_own_steps(tiny_models, arch, attention):
    """Sessions of different lengths and rows, stepped together and alone, for several steps; attention once a
    session over its cache (the CPU's pass) or once over the caches padded to the longest (a GPU's)."""
    span = load_block_span(tiny_models[arch], SpanSpec(0, 4))
    assert span.batches_decode and span._rotate is not None  # the CPU runs attention a session by default
    if attention == "padded":
        span._rotate = None
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, 3), (2, 7), (1, 1), (3, 5)]  # (rows, prompt tokens)
    alone, together = [span.new_cache() for _ in shapes], [span.new_cache() for _ in shapes]
    positions = [tokens for _, tokens in shapes]
    with torch.inference_mode():
        for (rows, tokens), first, second in zip(shapes, alone, together, strict=True):
            prompt = torch.randn(rows, tokens, span.hidden_size, generator=generator)
            span(prompt, first, 0)
            span(prompt, second, 0)
        for _ in range(5):
            steps = [torch.randn(rows, 1, span.hidden_size, generator=generator) for rows, _ in shapes]
            expected = [
                span(step, cache, position) for step, cache, position in zip(steps, alone, positions, strict=True)
            ]
            outputs = span.decode_batch(list(zip(steps, together, positions, strict=True)), (0, 4))
            for output, reference in zip(outputs, expected, strict=True):
                torch.testing.assert_close(output, reference, atol=1e-5, rtol=0)
            positions = [position + 1 for position in positions]
    assert [cache.get_seq_length() for cache in together] == [cache.get_seq_length() for cache in alone]


def test_spans_with_sliding_window_layers_do_not_batch(tiny_models):
    span = load_block_span(tiny_models["mistral"], SpanSpec(0, 4))
    assert not span.batches_decode and not span.batches_prompts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_pass_of_prompts_and_one_token_steps_equals_each_sessions_own_steps(tiny_models, arch):
    """First prompts, prompts after cached tokens (causal among their own tokens), one-token steps, several rows:
    one pass, each step's output and cache as its own forward gives them."""
    span = load_block_span(tiny_models[arch], SpanSpec(0, 4))
    assert span.batches_prompts
    generator = torch.Generator().manual_seed(3)
    shapes = [(1, 0, 9), (2, 5, 1), (1, 0, 3), (1, 7, 4), (3, 2, 1), (2, 0, 6), (2, 4, 3)]  # (rows, cached, new)
    alone, together, steps = [], [], []
    with torch.inference_mode():
        for rows, cached, new in shapes:
            first, second = span.new_cache(), span.new_cache()
            if cached:
                prefix = torch.randn(rows, cached, span.hidden_size, generator=generator)
                span(prefix, first, 0)
                span(prefix, second, 0)
            alone.append(first)
            together.append(second)
            steps.append(torch.randn(rows, new, span.hidden_size, generator=generator))
        expected = [span(step, cache, cached) for step, cache, (_, cached, _) in zip(steps, alone, shapes, strict=True)]
        outputs = span.run_batch(
            [(step, cache, cached) for step, cache, (_, cached, _) in zip(steps, together, shapes, strict=True)], (0, 4)
        )
        for output, reference in zip(outputs, expected, strict=True):
            assert output.shape == reference.shape
            torch.testing.assert_close(output, reference, atol=1e-5, rtol=0)
        # the caches hold what each session's own steps wrote: a next step of each gives the same output
        for first, second in zip(alone, together, strict=True):
            assert first.get_seq_length() == second.get_seq_length()
            torch.testing.assert_close(second.layers[3].keys, first.layers[3].keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(second.layers[3].values, first.layers[3].values, atol=1e-5, rtol=0)


def test_prompts_of_sessions_that_start_together_run_in_one_pass(module_swarm, tiny_llama, references):
    """While the node's compute thread is busy, the prompts of sessions starting together queue and run together
    in the next pass; every session's tokens are still its own."""
    node = module_swarm.start_node(tiny_llama, 0, 4, dht_prefix="prompts", batch_prompts=True)
    release = threading.Event()
    try:
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix="prompts", compression="none"
        ) as model:
            wait_for_chain(model)
            held = asyncio.run_coroutine_threadsafe(node.compute._on_thread(release.wait), module_swarm.loop)

            def release_once_prompts_wait():
                # the first prompt runs alone, the second takes a pass of its own: the others queue behind them
                with contextlib.suppress(AssertionError):
                    wait_until(lambda: sum(step.hidden.shape[1] > 1 for step in node.compute._decode_queue) >= 2)
                release.set()

            releaser = threading.Thread(target=release_once_prompts_wait, daemon=True)
            releaser.start()
            outputs = generate_concurrently(model)
            releaser.join()
            held.result(timeout=10)
        for output, reference in zip(outputs, references, strict=True):
            assert torch.equal(output, reference)
        assert node.compute.prompts_batched >= 2, node.compute.prompts_batched
    finally:
        release.set()
        module_swarm.stop_node(node)
