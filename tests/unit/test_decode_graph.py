"""Fixed-shape decode steps (sharding/decode_graph.py): eagerly on the CPU they compute what the span's forward does,
step after step and across a buffer that grows; on CUDA (`-m gpu`) the captured graphs replay the same."""

import pytest
import torch

from nesa_node.sharding.blocks import SpanSpec, load_block_span
from nesa_node.sharding.decode_graph import FixedStep, with_room
from nesa_node.sharding.span_cache import MIN_CAPACITY


def _run_both(span, plain, reserve: int, steps: int, batch: int = 1, device: str = "cpu", dtype=torch.float32):
    """A 6-token prefill then `steps` one-token steps, through `span.step` with a cache reserved `reserve` tokens and
    through `plain`'s forward: both outputs per step, and the fixed steps `span.step` used."""
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(batch, 6 + steps, span.hidden_size, generator=generator).to(device, dtype)
    ours, theirs = span.new_cache(), plain.new_cache()
    ours.reserve(reserve)
    pairs, used = [], []
    with torch.inference_mode():
        span.step(hidden[:, :6], ours, 0)
        plain(hidden[:, :6], theirs, 0)
        for position in range(6, 6 + steps):
            token = hidden[:, position : position + 1]
            pairs.append((span.step(token, ours, position), plain(token, theirs, position)))
            if isinstance(ours.fixed_step, FixedStep) and ours.fixed_step not in used:
                used.append(ours.fixed_step)
    assert ours.get_seq_length() == theirs.get_seq_length() == 6 + steps
    return pairs, used


def test_fixed_steps_compute_what_forward_does_and_a_grown_buffer_gets_a_new_one(tiny_llama):
    span = load_block_span(tiny_llama, SpanSpec(0, 4, decode_graphs=True))
    plain = load_block_span(tiny_llama, SpanSpec(0, 4))
    assert span.decode_graphs and not plain.decode_graphs
    pairs, used = _run_both(span, plain, reserve=16, steps=20, batch=2)
    for got, expected in pairs:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # positions 6..15 in the reserved buffer (16); 16 grows it (a plain step) to the minimum of an unreserved
    # growth (64); 17..25 in that one
    assert [step.capacity for step in used] == [16, MIN_CAPACITY]
    assert all(step.graph is None for step in used)  # no capture off CUDA


def test_a_part_of_the_span_runs_fixed_too(tiny_llama):
    whole = load_block_span(tiny_llama, SpanSpec(0, 4, decode_graphs=True))
    part = load_block_span(tiny_llama, SpanSpec(1, 3))
    hidden = torch.randn(1, 12, whole.hidden_size, generator=torch.Generator().manual_seed(12))
    ours, theirs = whole.new_cache(), part.new_cache()
    with torch.inference_mode():
        whole.step(hidden[:, :4], ours, 0, blocks=(1, 3))
        part(hidden[:, :4], theirs, 0)
        for position in range(4, 12):
            token = hidden[:, position : position + 1]
            torch.testing.assert_close(
                whole.step(token, ours, position, blocks=(1, 3)), part(token, theirs, position), atol=1e-5, rtol=1e-5
            )
    assert ours.fixed_step is not None and (ours.fixed_step.first, ours.fixed_step.end) == (1, 3)
    assert ours.get_seq_length(0) == 0 and ours.get_seq_length(1) == 12


def test_spans_and_calls_a_fixed_step_cannot_serve_run_as_usual(tiny_models):
    sliding = load_block_span(tiny_models["mistral"], SpanSpec(0, 4, decode_graphs=True))
    assert not sliding.decode_graphs  # a window mask per step is not a fixed shape
    span = load_block_span(tiny_models["llama"], SpanSpec(0, 4, decode_graphs=True))
    hidden = torch.randn(1, 3, span.hidden_size, generator=torch.Generator().manual_seed(13))
    cache = span.new_cache()
    with torch.no_grad():  # grad mode off but not inference mode: a fixed step is fine
        span.step(hidden[:, :2], cache, 0)
        span.step(hidden[:, 2:3], cache, 2)
    assert cache.fixed_step is not None
    cache = span.new_cache()
    span.step(hidden[:, :2], cache, 0)  # autograd on (a training pass): always the plain forward
    span.step(hidden[:, 2:3], cache, 2)
    assert cache.fixed_step is None


@pytest.mark.parametrize("out_of_memory", [False, True], ids=["capture-error", "out-of-memory"])
def test_a_failed_capture_runs_the_step_as_usual_and_only_memory_spares_the_spans_graphs(
    tiny_llama, monkeypatch, out_of_memory
):
    """A first run of a fixed step (a capture on CUDA) that raises leaves the cache's length where it was and the step
    runs as a plain forward, with the same outputs; an error turns the span's graphs off, running out of device
    memory only the session's while its buffers stay (once they grow it is tried again; the next session gets its
    fixed step)."""
    span = load_block_span(tiny_llama, SpanSpec(0, 4, decode_graphs=True))
    plain = load_block_span(tiny_llama, SpanSpec(0, 4))
    calls = []

    def fail(self, hidden, position):
        calls.append(position)
        raise torch.OutOfMemoryError("out of memory") if out_of_memory else RuntimeError("operation not permitted")

    with monkeypatch.context() as patched:
        patched.setattr(FixedStep, "__call__", fail)
        pairs, used = _run_both(span, plain, reserve=16, steps=15)
    for got, expected in pairs:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # tried at the first one-token step, not again in that buffer; position 16 grows it (a plain step) and, out of
    # memory, 17 tries the new buffer once
    assert calls == ([6, 17] if out_of_memory else [6]) and used == []
    assert span.decode_graphs is out_of_memory
    _, used = _run_both(span, plain, reserve=16, steps=3)
    assert len(used) == (1 if out_of_memory else 0)


def test_a_replay_that_fails_drops_the_sessions_fixed_step(tiny_llama, monkeypatch):
    """A fixed step whose graph exists (captured) and fails raises, and the session does not replay it again: its
    next step makes a new fixed step."""
    span = load_block_span(tiny_llama, SpanSpec(0, 2, decode_graphs=True))
    hidden = torch.randn(1, 5, span.hidden_size, generator=torch.Generator().manual_seed(14))
    cache = span.new_cache()
    with torch.inference_mode():
        span.step(hidden[:, :3], cache, 0)
        span.step(hidden[:, 3:4], cache, 3)
        broken = cache.fixed_step
        broken.graph = object()  # as if captured

        def fail(self, hidden, position):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        with monkeypatch.context() as patched:
            patched.setattr(FixedStep, "__call__", fail)
            with pytest.raises(RuntimeError, match="illegal memory access"):
                span.step(hidden[:, 4:5], cache, 4)
        assert cache.fixed_step is None and span.decode_graphs  # the span's graphs stay on
        span.step(hidden[:, 4:5], cache, 4)
    assert cache.fixed_step is not None and cache.fixed_step is not broken


def test_a_capture_out_of_memory_is_tried_again_once_after_freeing():
    attempts, freed = [], []

    def attempt(failures: int):
        def run():
            attempts.append(len(freed))
            if len(attempts) <= failures:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return "graph"

        return run

    assert with_room(attempt(1), lambda: freed.append(1)) == "graph"
    assert attempts == [0, 1] and freed == [1]  # the second attempt came after the cached blocks were freed
    attempts.clear(), freed.clear()
    with pytest.raises(torch.OutOfMemoryError):
        with_room(attempt(2), lambda: freed.append(1))
    assert attempts == [0, 1] and freed == [1]  # twice at most
    attempts.clear(), freed.clear()

    def other_error():
        attempts.append(0)
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="capturing"):
        with_room(other_error, lambda: freed.append(1))
    assert attempts == [0] and freed == []  # only running out of memory is tried again


def test_a_fixed_step_refuses_a_position_past_its_buffers(tiny_llama):
    span = load_block_span(tiny_llama, SpanSpec(0, 2, decode_graphs=True))
    cache = span.new_cache()
    cache.reserve(8)
    with torch.inference_mode():
        span(torch.zeros(1, 3, span.hidden_size), cache, 0)
        fixed = FixedStep(span, cache, 0, 2, rows=1)
        with pytest.raises(ValueError, match="capacity 8"):
            fixed(torch.zeros(1, 1, span.hidden_size), 8)
    assert cache.get_seq_length() == 3


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_steps_replay_what_forward_computes_on_cuda(tiny_llama, dtype):
    span = load_block_span(tiny_llama, SpanSpec(0, 4, dtype=dtype, device="cuda", decode_graphs=True))
    plain = load_block_span(tiny_llama, SpanSpec(0, 4, dtype=dtype, device="cuda"))
    pairs, used = _run_both(span, plain, reserve=16, steps=40, device="cuda", dtype=span.dtype_)
    tolerance = 1e-4 if dtype == "float32" else 3e-2
    for got, expected in pairs:
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert [step.capacity for step in used] == [16, MIN_CAPACITY] and all(step.graph is not None for step in used)


@pytest.mark.gpu
@needs_cuda
def test_replays_equal_the_same_step_run_eagerly_across_interleaved_sessions_and_closed_ones(tiny_llama):
    """Three sessions on one span, interleaved; one closes (its graph freed) and a fourth captures after it; a
    capacity past 1,024 keys. Each replay is compared with the same fixed step run eagerly, tightly, in float32."""
    import gc

    span = load_block_span(tiny_llama, SpanSpec(0, 4, device="cuda", decode_graphs=True))
    generator = torch.Generator().manual_seed(14)

    def session(prompt: int, reserve: int):
        cache = span.new_cache()
        cache.reserve(reserve)
        with torch.inference_mode():
            span.step(torch.randn(1, prompt, span.hidden_size, generator=generator).cuda(), cache, 0)
        return cache

    def advance(cache, steps: int = 3):
        with torch.inference_mode():
            for _ in range(steps):
                position = cache.get_seq_length()
                token = torch.randn(1, 1, span.hidden_size, generator=generator).cuda()
                eager = FixedStep(span, cache, 0, 4, rows=1)  # no capture stream: runs eagerly, same buffers
                expected = eager(token, position)
                for layer in cache.layers:
                    layer._view(position)  # undo the eager step's length: the replay writes the same slot
                got = span.step(token, cache, position)
                torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
                assert cache.fixed_step.graph is not None

    a, b, c = session(5, 64), session(9, 64), session(1100, 1200)
    for _ in range(3):
        advance(a), advance(b), advance(c)
    del b
    gc.collect()
    d = session(3, 64)
    for _ in range(3):
        advance(d), advance(a), advance(c)
