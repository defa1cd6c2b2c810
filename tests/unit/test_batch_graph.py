"""Batched passes of fixed shape (sharding/batch_graph.py): eagerly on the CPU a batch that repeats runs fixed and
computes what each session's own steps compute, across sessions of different lengths, rows and buffer capacities, a
session leaving and one growing its buffer; passes with LoRA rows and failed captures run eagerly; on CUDA
(`-m gpu`) the captured graph replays the same."""

import pytest
import torch

from nesa_node.sharding import batch_graph
from nesa_node.sharding.batch_graph import FixedBatch
from nesa_node.sharding.blocks import SpanSpec, load_block_span

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


class Sessions:
    """Sessions on `span` (decode_graphs on) and their twins on `plain`, each prefilled; `step` runs one batched
    pass of the given sessions through `span.decode_batch` and their one-token steps alone through `plain`."""

    def __init__(self, span, plain, seed: int = 21, device: str = "cpu", dtype=torch.float32):
        self.span, self.plain, self.device, self.dtype = span, plain, device, dtype
        self.generator = torch.Generator().manual_seed(seed)
        self.ours, self.theirs, self.rows = [], [], []

    def _random(self, rows: int, seq: int) -> torch.Tensor:
        return torch.randn(rows, seq, self.span.hidden_size, generator=self.generator).to(self.device, self.dtype)

    def open(self, prompt: int, reserve: int, rows: int = 1) -> int:
        ours, theirs = self.span.new_cache(), self.plain.new_cache()
        ours.reserve(reserve)
        hidden = self._random(rows, prompt)
        with torch.inference_mode():
            self.span(hidden, ours, 0)
            self.plain(hidden, theirs, 0)
        self.ours.append(ours)
        self.theirs.append(theirs)
        self.rows.append(rows)
        return len(self.ours) - 1

    def step(self, which: list[int]) -> None:
        tokens = [self._random(self.rows[index], 1) for index in which]
        positions = [self.ours[index].get_seq_length() for index in which]
        with torch.inference_mode():
            got = self.span.decode_batch(
                [(token, self.ours[i], position) for token, i, position in zip(tokens, which, positions, strict=True)],
                (self.span.start, self.span.end),
            )
            for token, index, position, output in zip(tokens, which, positions, got, strict=True):
                expected = self.plain(token, self.theirs[index], position)
                torch.testing.assert_close(output.float(), expected.float(), **self.tolerance)
                assert self.ours[index].get_seq_length() == position + 1

    tolerance = TOLERANCE


def batches(span) -> list:
    """The fixed batches the span holds (not those only seen once)."""
    return [held for held in (span._fixed_batch or {}).values() if isinstance(held, FixedBatch)]


@pytest.fixture
def spans(tiny_llama):
    return load_block_span(tiny_llama, SpanSpec(0, 4, decode_graphs=True)), load_block_span(tiny_llama, SpanSpec(0, 4))


@pytest.fixture
def runs(monkeypatch) -> list:
    """Every fixed batch run, in order (one entry a run)."""
    calls = []
    original = FixedBatch.__call__
    monkeypatch.setattr(FixedBatch, "__call__", lambda self, *args: calls.append(self) or original(self, *args))
    return calls


def test_a_repeating_batch_runs_fixed_and_computes_what_each_sessions_own_steps_do(spans, runs):
    span, plain = spans
    sessions = Sessions(span, plain)
    # different prompt lengths, rows and capacities (16, 32 and an unreserved buffer of 64)
    a, b, c = sessions.open(5, reserve=16), sessions.open(9, reserve=32, rows=2), sessions.open(3, reserve=0)
    sessions.step([a, b, c])  # seen once: eager
    assert runs == [] and batches(span) == []
    for _ in range(4):
        sessions.step([a, b, c])
    assert len(runs) == 4 and len(set(map(id, runs))) == 1
    fixed = runs[0]
    assert fixed.capacity == 64 and sorted(fixed.rows) == [1, 1, 2] and fixed.graph is None  # no capture off CUDA
    # b leaves: a new batch, eager once, then fixed again
    sessions.step([a, c])
    assert len(runs) == 4
    sessions.step([a, c])
    assert len(runs) == 5 and runs[-1] is not fixed and runs[-1].rows == [1, 1]
    # a's buffer (16) fills at position 16: that pass cannot run fixed, and its grown buffer is a new batch
    while sessions.ours[a].get_seq_length() < 16:
        sessions.step([a, c])
    count = len(runs)
    sessions.step([a, c])  # a at position 16: grows
    assert len(runs) == count
    sessions.step([a, c])
    sessions.step([a, c])
    assert len(runs) == count + 1 and runs[-1].capacity == 64


def test_the_same_sessions_in_another_order_are_the_same_batch_and_a_few_batches_alternate(spans, runs):
    span, plain = spans
    sessions = Sessions(span, plain)
    a, b, c = sessions.open(4, reserve=16), sessions.open(6, reserve=16, rows=2), sessions.open(5, reserve=32)
    sessions.step([a, b, c])
    sessions.step([c, a, b])  # outputs checked in the order given
    sessions.step([b, c, a])
    assert len(runs) == 2 and runs[0] is runs[1] and len(batches(span)) == 1
    # a straggler left for the next pass: two batches alternate, each replayed once seen
    for _ in range(3):
        sessions.step([a, b])
        sessions.step([c])
    assert len(batches(span)) == 3 and len(runs) == 2 + 4
    assert len(span._fixed_batch) <= batch_graph.HELD


def test_passes_with_lora_rows_run_eagerly_and_keep_the_batch(spans, monkeypatch):
    from nesa_node.sharding import lora_rows

    span, plain = spans
    sessions = Sessions(span, plain)
    a, b = sessions.open(4, reserve=16), sessions.open(6, reserve=16)
    sessions.step([a, b])
    sessions.step([a, b])
    held = batches(span)
    monkeypatch.setattr(lora_rows, "rows_active", lambda span: True)
    monkeypatch.setattr(batch_graph, "rows_active", lora_rows.rows_active)
    calls = []
    monkeypatch.setattr(FixedBatch, "__call__", lambda self, *args: calls.append(self))
    sessions.step([a, b])
    assert calls == [] and batches(span) == held and len(held) == 1


@pytest.mark.parametrize("out_of_memory", [False, True], ids=["capture-error", "out-of-memory"])
def test_a_failed_capture_runs_the_pass_eagerly_and_an_error_turns_batch_graphs_off(spans, monkeypatch, out_of_memory):
    """A capture that raises leaves every cache where it was and the pass runs eagerly; an error turns the span's
    batch graphs off, running out of device memory only that batch's (tried once while it is held)."""
    span, plain = spans
    tried = []

    def fail(self, caches):
        tried.append(len(caches))
        raise torch.OutOfMemoryError("out of memory") if out_of_memory else RuntimeError("operation not permitted")

    monkeypatch.setattr(span, "_capture_stream", lambda: object())  # as on CUDA: the first fixed run captures
    monkeypatch.setattr(FixedBatch, "_capture", fail)
    sessions = Sessions(span, plain)
    a, b = sessions.open(4, reserve=16), sessions.open(6, reserve=16)
    for _ in range(4):
        sessions.step([a, b])  # outputs and lengths checked: the failed capture moved nothing
    assert tried == [2] and batches(span) == []
    assert span.batch_graphs is out_of_memory and span.decode_graphs  # sessions' own fixed steps are not affected
    if out_of_memory:
        assert list(span._fixed_batch.values()) == [batch_graph.NO_MEMORY]
        c = sessions.open(5, reserve=16)
        sessions.step([a, b, c])
        sessions.step([a, b, c])  # another batch is tried
        assert tried == [2, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_batches_replay_what_each_sessions_own_steps_compute_on_cuda(tiny_llama, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    span, plain = (
        load_block_span(tiny_llama, SpanSpec(0, 4, dtype=dtype, device="cuda", decode_graphs=graphs))
        for graphs in (True, False)
    )
    sessions = Sessions(span, plain, device="cuda", dtype=span.dtype_)
    if dtype == "bfloat16":
        sessions.tolerance = {"atol": 3e-2, "rtol": 3e-2}
    which = [sessions.open(4 + index, reserve=64 * (1 + index % 2), rows=1 + index % 3 // 2) for index in range(6)]
    for _ in range(30):
        sessions.step(which)
    (fixed,) = batches(span)
    assert fixed.graph is not None
    sessions.step(which[1:])  # one leaves: a new batch, captured in its turn
    sessions.step(which[1:])
    assert len(batches(span)) == 2 and all(held.graph is not None for held in batches(span))


def test_buffer_stamps_change_with_the_buffers_only_and_are_never_shared(spans):
    span, _ = spans
    caches = [span.new_cache(), span.new_cache()]
    with torch.inference_mode():
        for cache in caches:
            cache.reserve(8)
            span(torch.randn(1, 6, span.hidden_size), cache, 0)
        layer = caches[0].layers[0]
        stamp = layer.stamp
        span(torch.randn(1, 1, span.hidden_size), caches[0], 6)  # written in place
        caches[0].crop(-2)
        assert layer.stamp == stamp
        span(torch.randn(1, 4, span.hidden_size), caches[0], 5)  # 9 tokens: past the 8 reserved, the buffer grows
        assert layer.stamp != stamp and layer.capacity > 8
    stamps = [layer.stamp for cache in caches for layer in cache.layers]
    assert len(set(stamps)) == len(stamps)


def test_a_node_left_without_sessions_drops_its_batches(spans):
    from nesa_node.server.compute import BlockCompute
    from nesa_node.server.config import ComputeConfig, LimitsConfig

    span, plain = spans
    compute = BlockCompute(span, ComputeConfig(), LimitsConfig())
    try:
        sessions = Sessions(span, plain)
        a, b = sessions.open(4, reserve=16), sessions.open(6, reserve=16)
        sessions.step([a, b])
        sessions.step([a, b])
        compute.forget("a")  # another session is still open
        assert len(batches(span)) == 1
        compute.forget("b", last=True)
        assert batches(span) == [] and span._fixed_batch is None
    finally:
        compute.close()
