"""Batched passes of fixed shape (sharding/batch_graph.py): eagerly on the CPU a batch that repeats runs fixed and
computes what each session's own steps compute, across sessions of different lengths, rows and buffer capacities, a
session leaving and one growing its buffer; passes with LoRA rows and failed captures run eagerly; on CUDA
(`-m gpu`) the captured graph replays the same."""

import gc

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

    def close(self, index: int) -> None:
        """The session ends: its caches are dropped (freed once nothing else holds them)."""
        self.ours[index] = self.theirs[index] = None
        gc.collect()

    def grow(self, index: int) -> None:
        """New, larger buffers for the session's caches (what growth past a reservation does), the held tokens kept."""
        for cache in (self.ours[index], self.theirs[index]):
            for layer in cache.layers:
                if getattr(layer, "_keys", None) is not None:
                    keys, values = layer.keys, layer.values
                    layer._grow(keys[..., :1, :], values[..., :1, :], 2 * layer.capacity)

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
    # b sits a pass out: the batch still runs it, b's row at its free slot, and b's length stays
    held = sessions.ours[b].get_seq_length()
    with torch.inference_mode():
        fixed.hidden.normal_()  # whatever b's row runs on: its keys and values go to the slot its next step writes
    sessions.step([a, c])
    assert len(runs) == 5 and runs[-1] is fixed and sessions.ours[b].get_seq_length() == held
    sessions.step([a, b, c])  # b's output is still its own step's: its slot was written again before it was read
    assert len(runs) == 6 and runs[-1] is fixed
    # b closes: the batch covers no pass without it; a batch of a and c, eager once, then fixed
    sessions.close(b)
    sessions.step([a, c])
    assert len(runs) == 6
    sessions.step([a, c])
    assert len(runs) == 7 and runs[-1] is not fixed and runs[-1].rows == [1, 1]
    # a's buffer (16) fills at position 16: that pass cannot run fixed, and its grown buffer is a new batch
    while sessions.ours[a].get_seq_length() < 16:
        sessions.step([a, c])
    count = len(runs)
    sessions.step([a, c])  # a at position 16: grows
    assert len(runs) == count
    sessions.step([a, c])
    sessions.step([a, c])
    assert len(runs) == count + 1 and runs[-1].capacity == 64


def test_the_same_sessions_in_another_order_are_the_same_batch_and_shifting_groups_share_one(spans, runs):
    span, plain = spans
    sessions = Sessions(span, plain)
    a, b, c = sessions.open(4, reserve=16), sessions.open(6, reserve=16, rows=2), sessions.open(5, reserve=32)
    sessions.step([a, b, c])
    sessions.step([c, a, b])  # outputs checked in the order given
    sessions.step([b, c, a])
    assert len(runs) == 2 and runs[0] is runs[1] and len(batches(span)) == 1
    # a straggler left for the next pass, groups that shift: the one batch runs every pass
    for group in ([a, b], [c], [a], [b, c], [c, a], [b]):
        sessions.step(group)
    assert len(runs) == 2 + 6 and {id(run) for run in runs} == {id(runs[0])} and len(batches(span)) == 1
    assert batch_graph.counts(span) == {"passes": 8, "absent_rows": 1 + 3 + 3 + 1 + 2 + 2, "built": 1, "step_built": 0}


def test_a_batch_is_built_over_the_recent_sessions_within_its_row_bound(spans, runs, monkeypatch):
    """Groups that never meet make one batch: each pass's batch takes on the sessions of the span's recent passes
    (at most COVER_ROWS rows of them), and a session silent for RECENT_PASSES passes is not taken into a new one."""
    span, plain = spans
    sessions = Sessions(span, plain)
    a, b, c, d = (sessions.open(4 + index, reserve=32) for index in range(4))
    sessions.step([a, b])  # seen once: (a, b)
    sessions.step([c, d])  # seen once: (a, b, c, d)
    assert runs == []
    sessions.step([a, b])  # (a, b, c, d) again: built
    sessions.step([c, d])
    assert len(runs) == 2 and runs[0] is runs[1] and sorted(runs[0].rows) == [1, 1, 1, 1]
    # d sits out: the batch runs its row while d stepped in one of the span's last RECENT_PASSES passes, then not
    for _ in range(batch_graph.RECENT_PASSES - 1):
        sessions.step([a, b, c])
    assert len(runs) == 2 + batch_graph.RECENT_PASSES - 1 and runs[-1] is runs[0]
    sessions.step([a, b, c])  # d is idle: (a, b, c) seen once
    assert len(runs) == 2 + batch_graph.RECENT_PASSES - 1
    sessions.step([a, b, c])
    assert runs[-1] is not runs[0] and len(runs[-1].rows) == 3
    sessions.step([d])  # back: the batch of all four still holds its buffers
    assert runs[-1] is runs[0]
    sessions.grow(d)  # new buffers: no batch covers d; alone, it runs eagerly (a pass of one builds no batch)
    sessions.step([d])
    assert runs[-1] is runs[0] and len(runs) == 2 + batch_graph.RECENT_PASSES + 1
    sessions.step([c, d])  # a batch of c, d and the recent a and b, seen once, then built
    sessions.step([c, d])
    assert len(runs[-1].rows) == 4 and runs[-1] is not runs[0] and len(batches(span)) == 3
    # at most COVER_ROWS rows of absent sessions are taken on
    monkeypatch.setattr(batch_graph, "COVER_ROWS", 1)
    e = sessions.open(3, reserve=32, rows=2)
    sessions.step([d, e])
    sessions.step([d, e])
    assert sorted(runs[-1].rows) == [1, 1, 2]


def test_a_pass_of_one_replays_a_batch_covering_it_and_never_builds_one(spans, runs):
    """Sessions taking turns alone (a node's steps given alone) build no batch: nine of them would cycle more
    batches than a span holds. Once two step together, the batch built over them replays a pass of one of either."""
    span, plain = spans
    sessions = Sessions(span, plain)
    which = [sessions.open(4 + index, reserve=32) for index in range(9)]
    for _ in range(3):
        for index in which:
            sessions.step([index])
    assert runs == [] and not span._fixed_batch
    for _ in range(batch_graph.RECENT_PASSES + 2):  # built once the recent others stop changing with each pass
        sessions.step(which[:2])
    (fixed,) = batches(span)
    before = len(runs)
    for index in which[:2]:
        sessions.step([index])  # alone: replayed by the batch covering it
    assert runs[before:] == [fixed, fixed] and batches(span) == [fixed]


def test_an_absent_session_without_room_for_its_row_keeps_the_batch_from_running(spans, runs):
    span, plain = spans
    sessions = Sessions(span, plain)
    a, b = sessions.open(13, reserve=16), sessions.open(4, reserve=32)
    sessions.step([a, b])
    sessions.step([a, b])  # built: a at 15 of 16
    sessions.step([a])  # a at 16: full
    assert len(runs) == 2 and sessions.ours[a].get_seq_length() == 16
    sessions.step([b])  # a has no free slot: this pass cannot run a's row
    assert len(runs) == 2
    sessions.step([a, b])  # a grows: its steps and b's are still their own
    assert sessions.ours[a].get_seq_length() == 17


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
    before = dict(batch_graph.counts(span))
    with torch.inference_mode():
        fixed.hidden.normal_()  # what the absent row runs on: its keys go to the slot its next step writes
    sessions.step(which[1:])  # one sits out: the graph replays, its row at its free slot
    sessions.step(which)  # and its steps are still its own
    assert batches(span) == [fixed]
    counted = batch_graph.counts(span)
    assert counted["passes"] == before["passes"] + 2 and counted["absent_rows"] == before["absent_rows"] + 1
    sessions.close(0)  # one leaves: a new batch, captured in its turn
    sessions.step(which[1:])
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
    from nesa_node.metrics import _ComputeCollector
    from nesa_node.server.compute import BlockCompute
    from nesa_node.server.config import ComputeConfig, LimitsConfig

    span, plain = spans
    compute = BlockCompute(span, ComputeConfig(), LimitsConfig())
    try:
        sessions = Sessions(span, plain)
        a, b = sessions.open(4, reserve=16), sessions.open(6, reserve=16)
        sessions.step([a, b])
        sessions.step([a, b])
        sessions.step([b])  # a covered pass: a's row runs too
        compute.forget("a")  # another session is still open
        assert len(batches(span)) == 1
        compute.forget("b", last=True)
        assert batches(span) == [] and span._fixed_batch is None
        # the node's counters of fixed batches (its metrics), kept across a move to other blocks
        figures = (compute.fixed_passes, compute.fixed_built, compute.fixed_absent_rows)
        assert figures == (2, 1, 1)
        compute.use_span(None)
        assert (compute.fixed_passes, compute.fixed_built, compute.fixed_absent_rows) == figures
        compute.use_span(span)
        sessions.step([a, b])
        sessions.step([a, b])
        assert (compute.fixed_passes, compute.fixed_built) == (3, 2)
        scraped = {family.name: family.samples[0].value for family in _ComputeCollector(compute).collect()}
        assert scraped["nesa_node_fixed_passes"] == 3 and scraped["nesa_node_fixed_absent_rows"] == 1
        # off CUDA: fixed steps run eagerly (no capture to count), and no device memory is reported
        assert scraped["nesa_node_step_graphs_built"] == 0 and compute.device_memory() is None
        assert "nesa_node_device_memory_bytes" not in scraped
    finally:
        compute.close()
