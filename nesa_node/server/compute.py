"""Running the node's blocks: the span being served, the compute thread, and what every step is checked against
before it runs (blocks inside the span, hidden states of the right shape, dtype and values).

Inference runs under `torch.inference_mode`, chosen here and not in the span (sharding/blocks.py), so a training
service can run the same blocks with autograd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from nesa_node.batching import Gathering
from nesa_node.compression.codec import WIRE_DTYPES, all_finite
from nesa_node.errors import BadRequestError, NesaError, TooManySessionsError, WrongBlocksError
from nesa_node.protocol.channel import Frame
from nesa_node.protocol.tensors import WireCodec, tensor_from_proto
from nesa_node.server.config import ComputeConfig, LimitsConfig
from nesa_node.server.throughput import synchronize
from nesa_node.sharding import batch_graph
from nesa_node.sharding.lora import adapters_for_rows

logger = logging.getLogger(__name__)
_BASE = contextlib.nullcontext()  # a pass without LoRA rows: nothing to set (reusable, it holds no state)
T = TypeVar("T")
SMALL_STEP_TOKENS = 8  # batch x seq of a decode step; such steps may run inline (ComputeConfig.inline_compute_ms)
RECENT_STEPS = 9  # small steps whose median decides where the next one runs
# a session's steps given alone while others step that run as passes of one before it gets a graph of its own
# (`BlockCompute._as_pass`; guess: sessions joining a batched swarm have one or two, at their start)
SINGLES_AS_PASSES = 3


class StepPlacement:
    """Where a small step runs: on the event loop while the median of the last RECENT_STEPS small steps' compute
    times (synchronized with the device) is below `inline_s`, else on the compute thread. A median, not a moving
    average: the first step of each new cache length on a GPU, or a step slowed by a busy host, costs several times
    a warm one, and an average pushed over the limit by one of them would send the next few steps to the thread and
    back, giving the steps a heavy tail; a median moves only when most recent steps did."""

    def __init__(self, inline_s: float, recent: int = RECENT_STEPS):
        self.inline_s = inline_s
        self.recent: deque[float] = deque(maxlen=recent)

    def inline(self) -> bool:
        """Whether the next small step runs on the event loop (never before a first step has been timed)."""
        return bool(self.recent) and statistics.median(self.recent) < self.inline_s

    def record(self, seconds: float) -> None:
        self.recent.append(seconds)


@dataclass
class _DecodeStep:
    hidden: torch.Tensor  # (rows, seq, hidden): seq 1, or a prompt's tokens where the span batches prompts
    cache: object
    position: int
    blocks: tuple[int, int]
    future: asyncio.Future
    adapter: object = None  # the session's AdapterSlice (LoRA), or None
    member: Hashable = None  # the session it belongs to (its SessionKey: gathering), or None
    arrived_s: float = 0.0  # time.monotonic() when it was queued
    span: object = None  # the span its blocks and cache were checked against when it was queued


class BlockCompute:
    """The span of blocks this node serves (None while it loads others) and the thread its steps run on."""

    def __init__(self, span, compute: ComputeConfig, limits: LimitsConfig):
        self.span = span
        self.config = compute
        self.limits = limits
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nesa-compute")
        self.accepted_codecs = tuple(dict.fromkeys(("none", *compute.codecs)))  # "none" always works
        self.compute_seconds = 0.0  # total time spent in the blocks
        self.steps_served = 0
        self.placement = StepPlacement(compute.inline_compute_ms / 1000)
        self._decode_queue: list[_DecodeStep] = []  # one-token steps waiting to run together (decode batching)
        self._decoder: asyncio.Task | None = None  # the task taking the queue (held: the loop keeps only weak refs)
        self._arrival: asyncio.Future | None = None  # resolved when a step joins the queue (a gathering waits on it)
        self.gatherings: dict[tuple[int, int], Gathering] = {}  # per blocks: when its sessions' next steps are due
        self.recent_passes: deque[float] = deque(maxlen=RECENT_STEPS)  # seconds of the last decode passes
        self.batches_run = 0  # batched passes of more than one step (for stats and tests)
        self.single_passes = 0  # steps given alone while others stepped, run as a pass of one (`_as_pass`)
        self._singles: dict = {}  # member -> its steps given alone so far (forgotten when the session closes)
        self.gather_waits = 0  # times a pass about to start waited for other sessions' steps (for stats and tests)
        self.lone_steps = 0  # one-token steps run at once on the loop, no other session stepping (stats, tests)
        self.prompts_batched = 0  # steps of several tokens that ran in a pass with other steps (stats, tests)
        self.passes_split = 0  # passes that failed in the blocks and were run again a step at a time (stats, tests)
        self.steps_in_passes = 0  # steps run in those batched passes (over batches_run: how full passes are)
        self.gather_wait_s = 0.0  # seconds passes about to start waited for other sessions' steps
        self.inline_steps = 0  # steps and passes computed on the event loop / on the compute thread
        self.thread_steps = 0
        self._thread_jobs = 0  # jobs handed to the compute thread and not done (nor cancelled unrun) yet
        self._thread_jobs_lock = threading.Lock()  # counted down on the compute thread or the loop's
        self._fixed_before: dict[str, int] = {}  # fixed-batch counts of the spans served before this one

    def use_span(self, span) -> None:
        """Serve `span` (a node that moved); None while the node loads other blocks: requests are refused."""
        if self.span is not None:  # its counts move here (counters never go down, whichever span is served)
            counts = batch_graph.counts(self.span)
            for name, value in counts.items():
                self._fixed_before[name] = self._fixed_before.get(name, 0) + value
                counts[name] = 0
        self.span = span

    def _fixed(self, name: str) -> int:
        now = batch_graph.counts(self.span)[name] if self.span is not None else 0
        return self._fixed_before.get(name, 0) + now

    @property
    def fixed_passes(self) -> int:
        """Passes run as a fixed batch (replayed as a CUDA graph: sharding/batch_graph.py), passes of one included."""
        return self._fixed("passes")

    @property
    def fixed_absent_rows(self) -> int:
        """Rows those passes ran for sessions that had no step in them."""
        return self._fixed("absent_rows")

    @property
    def fixed_built(self) -> int:
        """Fixed batches built (each a CUDA graph capture)."""
        return self._fixed("built")

    @property
    def step_graphs_built(self) -> int:
        """One-token steps of a session captured as CUDA graphs (sharding/decode_graph.py), the warm-up's at start
        and after a move included."""
        return self._fixed("step_built")

    def device_memory(self) -> dict[str, int] | None:
        """Bytes of the served span's CUDA device this process holds: allocated (tensors), reserved (torch's caching
        allocator, CUDA graphs' pools included) and peak (the most reserved since start); None off CUDA."""
        span = self.span  # read once: a move may take it away meanwhile (this runs on the metrics thread)
        device = span.spec.device if span is not None else ""
        if not device.startswith("cuda"):
            return None
        import torch

        return {
            "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "peak": torch.cuda.max_memory_reserved(device),
        }

    # ---- checks ------------------------------------------------------------------------------------------------

    def check_blocks(self, start_block: int, end_block: int) -> tuple[int, int]:
        """(first, end) of the blocks a peer asks this node to run: inside the model and inside this node's span.
        TooManySessionsError while the node loads other blocks, BadRequestError past the model's blocks,
        WrongBlocksError outside the span (the peer read a stale record: the node moved)."""
        span = self.span
        if span is None:
            raise TooManySessionsError("node is loading other blocks (rebalancing); route around it")
        total = span.config.num_hidden_layers
        if end_block > total:
            raise BadRequestError(f"unknown block {end_block - 1}: the model has blocks 0..{total - 1}")
        if not span.start <= start_block < end_block <= span.end:
            raise WrongBlocksError(
                f"this node serves blocks {span.start}..{span.end - 1}, not {start_block}..{end_block - 1}"
            )
        return start_block, end_block

    def codec(self, codec: WireCodec) -> WireCodec:
        """`codec` if this node accepts it; BadRequestError otherwise."""
        if codec.name not in self.accepted_codecs:
            raise BadRequestError(
                f"codec {codec.name!r} is not accepted here; accepted: {', '.join(self.accepted_codecs)}"
            )
        return codec

    def read_hidden(self, frame: Frame, codec: WireCodec, *, batch: int | None) -> torch.Tensor:
        """The hidden states (batch, seq, hidden) a frame carries; BadRequestError unless they are one finite tensor
        of this model's width within the step limit (and of `batch` rows, when given)."""
        span = self.span
        if span is None:
            raise TooManySessionsError("node is loading other blocks (rebalancing); route around it")
        if len(frame.tensors) != 1:
            raise BadRequestError(f"expected one tensor of hidden states, got {len(frame.tensors)}")
        hidden = tensor_from_proto(
            frame.tensors[0],
            allowed_dtypes=tuple(WIRE_DTYPES),
            max_elements=self.limits.max_tokens_per_step * span.hidden_size,
            rank=3,
            codec=self.codec(codec),
        )
        rows, seq, width = hidden.shape  # (batch, seq, hidden)
        if width != span.hidden_size:
            raise BadRequestError(f"hidden size {width} does not match the model's {span.hidden_size}")
        if seq == 0 or rows == 0:
            raise BadRequestError("hidden states must hold at least one token")
        if batch is not None and rows != batch:
            raise BadRequestError(f"batch of {rows} rows in a session opened with {batch}")
        if not all_finite(hidden):
            raise BadRequestError("hidden states contain NaN or Inf")
        return hidden

    # ---- running -----------------------------------------------------------------------------------------------

    async def run(
        self, hidden: torch.Tensor, cache, position: int, blocks: tuple[int, int], adapter=None
    ) -> tuple[torch.Tensor, float]:
        """Run `blocks` (first, end) on `hidden` with `cache` from `position`, with the LoRA `adapter` (an
        AdapterSlice) on every row when given; (output, seconds in the blocks). Short steps run on the loop itself,
        others on the compute thread (ComputeConfig.inline_compute_ms)."""
        span = self.span  # the span the blocks were checked against, even if the node moves meanwhile
        if span is None:
            raise TooManySessionsError("node is loading other blocks (rebalancing); route around it")

        def run() -> tuple[torch.Tensor, float]:
            started = time.perf_counter()
            rows = adapters_for_rows(span, [adapter] * hidden.shape[0], blocks=blocks) if adapter is not None else _BASE
            with torch.inference_mode(), rows:  # base-weight steps may replay a captured graph (span.step)
                output = (span if adapter is not None else span.step)(hidden, cache, position, blocks)
            synchronize(span)  # the time of the computation, not of its launch (a GPU runs it asynchronously)
            seconds = time.perf_counter() - started
            return (output if cache is None else _on_host([output])[0]), seconds

        small = hidden.shape[0] * hidden.shape[1] <= SMALL_STEP_TOKENS
        if small and self._inline():
            output, seconds = run()
            self.inline_steps += 1
        else:
            output, seconds = await self._on_thread(run)
            self.thread_steps += 1
        if small:
            self.placement.record(seconds)
        self.compute_seconds += seconds
        self.steps_served += 1
        return output, seconds

    def _inline(self) -> bool:
        """Whether a small step may run on the loop now: recent small steps were short, and the compute thread has
        no job (running or queued). A step on the loop while the thread computes would run two computations of the
        node at once; on a GPU one of them may be a CUDA graph capture, which another thread's device work (a
        prefill, its synchronization) makes fail."""
        return self._thread_jobs == 0 and self.placement.inline()

    async def _on_thread(self, work: Callable[[], T]) -> T:
        """`work()` on the compute thread, counted in `_thread_jobs` until it is done there, or taken out of the
        queue unrun (its caller cancelled before it started)."""
        job = self.executor.submit(work)  # raises once shut down
        with self._thread_jobs_lock:
            self._thread_jobs += 1
        job.add_done_callback(self._thread_job_done)  # on the thread when done, on the canceller's when cancelled
        return await asyncio.wrap_future(job)

    def _thread_job_done(self, job) -> None:
        with self._thread_jobs_lock:
            self._thread_jobs -= 1

    async def run_work(self, work: Callable[[], T]) -> tuple[T, float]:
        """`work()` on the compute thread (a training pass: it runs the span itself, under its own grad mode); (its
        result, seconds it took), counted with the steps' compute time."""
        if self.span is None:
            raise TooManySessionsError("node is loading other blocks (rebalancing); route around it")

        def timed() -> tuple[T, float]:
            started = time.perf_counter()
            result = work()
            return result, time.perf_counter() - started

        result, seconds = await self._on_thread(timed)
        self.compute_seconds += seconds
        self.steps_served += 1
        self.thread_steps += 1
        return result, seconds

    async def run_decode(
        self, hidden: torch.Tensor, cache, position: int, blocks: tuple[int, int], adapter=None, *, member=None
    ) -> tuple[torch.Tensor, float]:
        """A one-token step, run together with the other sessions' one-token steps on the same blocks that are
        waiting at the same time (each with its own cache and position): one pass instead of one per session.
        Steps that arrive while a pass runs form the next one; when nothing runs, a pass starts at once unless other
        sessions' steps are expected within the gathering window (nesa_node/batching.py: `member` is the step's
        session, whose steps are timed). A small step of a lone session (no other stepping, nothing queued or
        running) that runs on the loop skips the queue and its task, whose extra turns of the loop every hop would pay.
        Sessions with different LoRA adapters (or none) share a pass, each row with
        its own. With `batch_prompts`, steps of several tokens (prompts) join the passes too where the span runs
        attention a session at a time (`span.batches_prompts`), so the prompts of sessions that start together run
        in one pass; otherwise they run alone, as does a prompt with no other session stepping. (output, seconds of the
        pass it was in)."""
        span = self.span
        if not self.config.batch_decode or span is None or not span.batches_decode:
            return await self.run(hidden, cache, position, blocks, adapter)
        prompt = hidden.shape[1] != 1
        if prompt and not (self.config.batch_prompts and span.batches_prompts):
            return await self.run(hidden, cache, position, blocks, adapter)
        now = time.monotonic()
        gathering = None
        if member is not None:
            gathering = self.gatherings.get(blocks)
            if gathering is None:
                gathering = self.gatherings[blocks] = Gathering(window_s=self.config.batch_window_ms / 1000)
            if not prompt:  # a session's period is the gap between its one-token steps (a prompt comes a round early)
                gathering.arrived(member, now)
        idle = not self._decode_queue and (self._decoder is None or self._decoder.done())
        lone = idle and (gathering is None or not gathering.others_active(member, now))
        if prompt and idle and self._thread_jobs == 0:
            # nothing to share a pass with: a prompt runs at once, as without batching; prompts that arrive while
            # the compute thread is busy queue, and the next pass takes them together
            return await self.run(hidden, cache, position, blocks, adapter)
        if lone and hidden.shape[0] <= SMALL_STEP_TOKENS and self._inline():
            # a lone session's step on the loop: nothing can join it while it runs (the loop is held), so the queue
            # and its task are skipped
            output, seconds = await self.run(hidden, cache, position, blocks, adapter)
            self.recent_passes.append(seconds)
            self.lone_steps += 1
            return output, seconds
        future = asyncio.get_running_loop().create_future()
        self._decode_queue.append(_DecodeStep(hidden, cache, position, blocks, future, adapter, member, now, span))
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)
        if self._decoder is None or self._decoder.done():
            self._decoder = asyncio.create_task(self._take_decode_queue())
        return await future

    def forget(self, member, *, last: bool = False) -> None:
        """A session that closed: no step of it is expected any more; `last`: the node has no session open now (the
        span's batched-pass graphs are dropped, none of their batches comes again)."""
        for gathering in self.gatherings.values():
            gathering.forget(member)
        self._singles.pop(member, None)
        if last and self.span is not None:
            batch_graph.release(self.span)

    async def _take_decode_queue(self) -> None:
        batch: list[_DecodeStep] = []
        try:
            await asyncio.sleep(0)  # steps that arrived in this turn of the loop join the first pass
            while self._decode_queue:
                blocks = await self._gather()
                batch = self._of_this_span(self._next_decode_batch(blocks))
                if len(batch) == 1 and not self._as_pass(batch[0]):  # empty when every step was given up
                    await self._settle(batch, self._run_alone(batch[0]))
                elif batch:
                    await self._settle_batch(batch)
                batch = []
        finally:  # cancelled (the node stops): no step is left waiting for a pass that will not come
            for step in batch + self._decode_queue:
                if not step.future.done():
                    step.future.cancel()

    async def _gather(self) -> tuple[int, int]:
        """The blocks of the next pass: the first range (in queue order) whose pass need not wait for other sessions'
        steps, waiting (within the window: batching.py) while every queued range expects some soon. Each range is
        judged by its own sessions, so a range's expected steps never hold back a step on another."""
        late_s = statistics.median(self.recent_passes) if self.recent_passes else 0.0
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        while True:
            ranges: dict[tuple[int, int], list[_DecodeStep]] = {}
            for step in self._decode_queue:
                if not step.future.done():  # a step given up is dropped when the pass is taken
                    ranges.setdefault(step.blocks, []).append(step)
            if not ranges:
                return self._decode_queue[0].blocks  # every step was given up: the pass takes none of them
            delays = {}
            now = time.monotonic()
            cap = self.config.max_pass_steps
            for blocks, steps in ranges.items():
                gathering = self.gatherings.get(blocks)
                queued = {step.member for step in steps}
                full = cap and len(steps) >= cap  # a pass's worth queued: nobody is waited for
                delays[blocks] = (
                    0.0 if gathering is None or full else gathering.wait_s(queued, steps[0].arrived_s, now, late_s)
                )
                if delays[blocks] <= 0:
                    self.gather_wait_s += now - started
                    return blocks
            self.gather_waits += 1
            self._arrival = loop.create_future()
            try:
                async with asyncio.timeout(min(delays.values())):
                    await self._arrival
            except TimeoutError:
                pass  # judged again: a range whose window is over runs now

    def _next_decode_batch(self, blocks: tuple[int, int]) -> list[_DecodeStep]:
        """The waiting steps on `blocks`, the first of them within the step limit (tokens: rows x seq) and the cap
        of steps a pass (`max_pass_steps`); the rest wait."""
        batch, rest, tokens, cap = [], [], 0, self.config.max_pass_steps or len(self._decode_queue)
        for step in self._decode_queue:
            size = step.hidden.shape[0] * step.hidden.shape[1]
            room = not batch or (tokens + size <= self.limits.max_tokens_per_step and len(batch) < cap)
            fits = step.blocks == blocks and room
            if fits and not step.future.done():
                batch.append(step)
                tokens += size
            elif not step.future.done():
                rest.append(step)
        self._decode_queue = rest
        return batch

    def _of_this_span(self, batch: list[_DecodeStep]) -> list[_DecodeStep]:
        """The steps of `batch` queued on the span the node serves now; the others (queued before a move to other
        blocks: their caches were built for the span they were checked against) fail, their sessions routed
        around this node, rather than run on another span's layers."""
        stale = [step for step in batch if step.span is not self.span]
        if stale:
            self._fail(stale, TooManySessionsError("node moved to other blocks (rebalancing); route around it"))
        return [step for step in batch if step.span is self.span]

    def _as_pass(self, step: _DecodeStep) -> bool:
        """Whether a step the queue gives alone (other sessions are stepping) runs as a pass of one: a base-weight
        one-token step on a span replaying batched passes as CUDA graphs, among the first SINGLES_AS_PASSES of its
        session given alone. A held batch covering the session replays it (its row alone present; batch_graph.py),
        else it runs eagerly on the compute thread; either way the session captures no graph of its own (tens of
        milliseconds, on the event loop) for steps that mostly come batched. A session given steps alone more often
        than that steps alone for good: its own graph then pays."""
        graphs = getattr(self.span, "batch_graphs", False)
        if not graphs or step.hidden.shape[1] != 1 or step.adapter is not None:
            return False
        singles = self._singles.get(step.member, 0)
        if singles >= SINGLES_AS_PASSES:
            return False
        if step.member is not None:
            self._singles[step.member] = singles + 1
        self.single_passes += 1
        return True

    async def _run_alone(self, step: _DecodeStep) -> tuple[list[torch.Tensor], float]:
        output, seconds = await self.run(step.hidden, step.cache, step.position, step.blocks, step.adapter)
        return [output], seconds

    async def _run_batch(self, batch: list[_DecodeStep]) -> tuple[list[torch.Tensor], float]:
        span = self.span
        if span is None:
            raise TooManySessionsError("node is loading other blocks (rebalancing); route around it")

        # one per row the span runs: a pass with prompts lays every step's tokens one after the other
        adapters = [step.adapter for step in batch for _ in range(step.hidden.shape[0] * step.hidden.shape[1])]
        if all(adapter is None for adapter in adapters):
            rows = _BASE
        else:  # entered in the compute thread, where the rows' setting must live
            rows = adapters_for_rows(span, adapters, blocks=batch[0].blocks)

        def run() -> tuple[list[torch.Tensor], float]:
            started = time.perf_counter()
            with torch.inference_mode(), rows:
                outputs = span.run_batch([(step.hidden, step.cache, step.position) for step in batch], batch[0].blocks)
            synchronize(span)
            seconds = time.perf_counter() - started
            return _on_host(outputs), seconds

        outputs, seconds = await self._on_thread(run)
        self.compute_seconds += seconds
        self.steps_served += len(batch)
        if len(batch) > 1:  # not a pass of one (`_as_pass`)
            self.batches_run += 1
            self.steps_in_passes += len(batch)
        self.thread_steps += 1
        self.prompts_batched += sum(step.hidden.shape[1] > 1 for step in batch)
        return outputs, seconds

    async def _settle_batch(self, batch: list[_DecodeStep]) -> None:
        """Run `batch` as one pass and give each step its output. A pass that fails in the blocks (a torch error: out
        of device memory, say), not by a refusal of the node's, is run again one step at a time, each step's cache
        first rewound to its step's position (the failed pass may have written some of its layers): a step that
        cannot run then fails its own session alone, not every session it shared the pass with."""
        try:
            outputs, seconds = await self._run_batch(batch)
        except NesaError as exc:
            self._fail(batch, exc)
            return
        except Exception as exc:  # the blocks' own error
            if len(batch) == 1:  # a pass of one: the error is its step's own, its cache rewound
                _rewind(batch[0].cache, batch[0].position)
                self._fail(batch, exc)
                return
            logger.warning("a pass of %d steps failed (%r): running them one at a time", len(batch), exc)
            self.passes_split += 1
            for step in batch:
                _rewind(step.cache, step.position)
            for step in batch:
                if not step.future.done():  # not given up meanwhile
                    await self._settle([step], self._run_alone(step))
            return
        self._give(batch, outputs, seconds)

    async def _settle(self, batch: list[_DecodeStep], work) -> None:
        """Give each step of `batch` its output (or the error of the pass)."""
        try:
            outputs, seconds = await work
        except Exception as exc:
            self._fail(batch, exc)
            return
        self._give(batch, outputs, seconds)

    def _give(self, batch: list[_DecodeStep], outputs: list[torch.Tensor], seconds: float) -> None:
        if all(step.hidden.shape[1] == 1 for step in batch):  # how late a step may be: one-token passes only
            self.recent_passes.append(seconds)
        for step, output in zip(batch, outputs, strict=True):
            if not step.future.done():
                step.future.set_result((output, seconds))

    @staticmethod
    def _fail(batch: list[_DecodeStep], exc: Exception) -> None:
        for step in batch:
            if not step.future.done():
                step.future.set_exception(exc)

    def close(self) -> None:
        """Stop the compute thread and the decode queue (called on the node's loop); steps still waiting are
        cancelled."""
        if self._decoder is not None:
            self._decoder.cancel()
        with contextlib.suppress(Exception):
            self.executor.shutdown(wait=False, cancel_futures=True)


def _on_host(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A session's step outputs (rows, seq, hidden) on the CPU, all of a pass in one copy: they leave as bytes, and
    each step's checks and wire bytes taken from a device tensor on the event loop would wait for the device (and
    hand the interpreter lock back and forth with the compute thread) once a step, 16 times for a pass of 16
    sessions. A session's outputs all live on the host, so those kept for a replacement of the next node
    (`ServerSession.outputs`) and for its audit windows join without a copy across devices."""
    if not outputs or outputs[0].device.type == "cpu":
        return outputs
    if len(outputs) == 1:
        return [outputs[0].cpu()]
    host = torch.cat([output.reshape(-1, output.shape[-1]) for output in outputs]).cpu()  # (all tokens, hidden)
    parts = host.split([output.shape[0] * output.shape[1] for output in outputs])
    return [part.view(output.shape) for part, output in zip(parts, outputs, strict=True)]


def _rewind(cache, position: int) -> None:
    """Forget what `cache` holds past `position` tokens, in every layer (a failed pass's partial writes)."""
    for layer in getattr(cache, "layers", ()):
        extra = layer.get_seq_length() - position
        if extra > 0:
            layer.crop(-extra)


__all__ = ["BlockCompute", "SMALL_STEP_TOKENS", "StepPlacement"]
