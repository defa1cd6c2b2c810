"""The next token of each session: the scores of the client's LM head, batched over concurrent sessions, and the
choice among them (greedy or sampled).

`HeadBatcher`: the last hidden states of the sessions waiting for their next token's scores at the same time go
through the final norm and the LM head in one pass. With many sessions in one client process (a gateway), the
client's own layers become the swarm's bottleneck: the LM head reads its whole (vocab, hidden) matrix in every pass,
whatever the number of rows (65 MB in float32 for a 32000 x 512 head), so a pass of 8 rows costs 2-4x one row on a
CPU, not 8x. Scoring the sessions one after the other would also space their next steps a head pass apart, and the
nodes would then get them one at a time and not batch them either.

While no other session is stepping, a pass runs at once on the event loop, as without batching (a thread hand-off
costs more than it saves). Otherwise passes run on a thread of their own, so the loop keeps reading the other
sessions' answers meanwhile: answers that arrive while a pass runs form the next pass, and a pass about to start
waits, within a window (at most half a session's round), for the sessions whose answers are due by then
(nesa_node/batching.py, the nodes' rule too), so sessions that started apart end up scored together.

With `waves` above 1 the sessions are dealt into that many waves (each new session to the wave with the fewest), and a
pass scores one wave's sessions only, gathering for that wave's members: the waves go round the chain one behind the
other, so while the nodes compute one wave's steps the client scores another's (a pipeline; with one wave, every
process of the chain waits while another computes the round's single batch). A node gathers its passes by the same
rule, so with waves its gathering window is best 0 (`--batch-window-ms 0`): a window of half a round would merge the
waves again. A row's scores
in a pass equal its scores alone up to rounding (a matrix product of several rows may sum in another order), as in a
node's batched pass. The head reads the client's layers off the event loop: they are fixed once the model is loaded.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from nesa_node.batching import Gathering
from nesa_node.errors import SessionStateError

Head = Callable[[torch.Tensor], torch.Tensor]  # last hidden states (rows, hidden) -> scores (rows, vocab)
# passes whose median time is how late a session's answer may be and still be waited for (as many as the node's
# StepPlacement keeps: a median of nine ignores a few slow passes)
RECENT_PASSES = 9


@dataclass
class _Request:
    hidden: torch.Tensor  # (rows, hidden)
    member: Hashable
    arrived_s: float  # time.monotonic()
    future: asyncio.Future


class HeadBatcher:
    """Scores of the rows asked for by concurrent sessions, computed by `head` in shared passes (module docstring).
    `window_s` caps the gathering window; `waves`: the groups of sessions passes keep apart (1: none)."""

    def __init__(self, head: Head, *, window_s: float = 0.025, waves: int = 1):
        if waves < 1:
            raise ValueError(f"waves must be 1 or more, got {waves}")
        self.head = head
        self.window_s = window_s
        self.closed = False
        self.passes = 0  # passes run
        self.batched_passes = 0  # passes that scored the rows of more than one session
        self.gatherings = [Gathering(window_s=window_s) for _ in range(waves)]  # one a wave
        self._waves: dict[Hashable, int] = {}  # member -> its wave (while it is open)
        self.recent_passes: deque[float] = deque(maxlen=RECENT_PASSES)  # seconds of the last passes
        self._waiting: list[_Request] = []
        self._arrival: asyncio.Future | None = None  # resolved when a request joins the queue (a gathering waits)
        self._runner: asyncio.Task | None = None  # the task taking the queue (held: the loop keeps weak refs only)
        self._executor: ThreadPoolExecutor | None = None  # made on the first concurrent pass

    async def scores(self, hidden: torch.Tensor, member: Hashable) -> torch.Tensor:
        """Scores (rows, vocab) of the last hidden states `hidden` (rows, hidden) of session `member` (a key of it).
        SessionStateError once closed."""
        if self.closed:
            raise SessionStateError("the model is closed")
        now = time.monotonic()
        self.gatherings[self._wave_of(member)].arrived(member, now)
        idle = not self._waiting and (self._runner is None or self._runner.done())
        if idle and not any(gathering.others_active(member, now) for gathering in self.gatherings):
            scores, seconds = self._timed(hidden)
            self.recent_passes.append(seconds)
            return scores
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Request(hidden, member, now, future))
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._take_queue())
        return await future

    def forget(self, member: Hashable) -> None:
        """Session `member` closed: none of its answers is expected any more."""
        wave = self._waves.pop(member, None)
        if wave is not None:
            self.gatherings[wave].forget(member)

    def _wave_of(self, member: Hashable) -> int:
        """`member`'s wave: a new member joins the wave with the fewest open members (the first of them)."""
        wave = self._waves.get(member)
        if wave is None:
            sizes = [0] * len(self.gatherings)
            for taken in self._waves.values():
                sizes[taken] += 1
            wave = self._waves[member] = sizes.index(min(sizes))
        return wave

    def _timed(self, hidden: torch.Tensor) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        scores = self.head(hidden)
        self.passes += 1
        return scores, time.perf_counter() - started

    async def _take_queue(self) -> None:
        loop = asyncio.get_running_loop()
        batch: list[_Request] = []
        try:
            await asyncio.sleep(0)  # requests of this turn of the loop join the first pass
            while True:
                self._waiting = [request for request in self._waiting if not request.future.done()]  # not given up
                if not self._waiting:
                    break
                wave = self._waves.get(self._waiting[0].member, 0)  # the oldest request's: its wave's pass is next
                await self._gather(wave)
                batch, kept = [], []
                for request in self._waiting:
                    if request.future.done():
                        continue  # given up
                    (batch if self._waves.get(request.member, 0) == wave else kept).append(request)
                self._waiting = kept
                if not batch:
                    continue
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nesa-client-head")
                try:
                    rows = torch.cat([request.hidden for request in batch])  # (all rows, hidden)
                    scores, seconds = await loop.run_in_executor(self._executor, self._timed, rows)
                except Exception as exc:  # every caller of the pass gets its error; the next pass still runs
                    for request in batch:
                        if not request.future.done():
                            request.future.set_exception(exc)
                    batch = []
                    continue
                self.recent_passes.append(seconds)
                self.batched_passes += len(batch) > 1
                parts = scores.split([request.hidden.shape[0] for request in batch])  # each request's rows
                for request, part in zip(batch, parts, strict=True):
                    if not request.future.done():
                        request.future.set_result(part)
                batch = []
        except Exception as exc:  # a fault of the queue itself: its callers get it, not a cancellation
            for request in batch + self._waiting:
                if not request.future.done():
                    request.future.set_exception(exc)
            self._waiting = []
        finally:  # cancelled (the client closes): nobody is left waiting on a pass that will not come
            for request in batch + self._waiting:
                request.future.cancel()
            self._waiting = []

    async def _gather(self, wave: int) -> None:
        """Wait, by the gathering rule, for the members of `wave` expected soon (the oldest request is of it)."""
        late_s = statistics.median(self.recent_passes) if self.recent_passes else 0.0
        loop = asyncio.get_running_loop()
        while self._waiting:
            queued = {request.member for request in self._waiting if self._waves.get(request.member, 0) == wave}
            delay = self.gatherings[wave].wait_s(queued, self._waiting[0].arrived_s, time.monotonic(), late_s)
            if delay <= 0:
                return
            self._arrival = loop.create_future()
            try:
                async with asyncio.timeout(delay):
                    await self._arrival
            except TimeoutError:
                return

    async def close(self) -> None:
        """Stop taking requests; waiting callers are cancelled."""
        self.closed = True
        if self._runner is not None and not self._runner.done():
            self._runner.cancel()
            await asyncio.wait([self._runner])  # raises only if this task itself is cancelled
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def choose_tokens(
    scores: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float, generator
) -> torch.Tensor:
    """The next token per row of `scores` (batch, vocab): the argmax, or a sample after temperature, top-k and top-p
    (nucleus) filtering; ValueError for a temperature that is not above 0."""
    if not do_sample:
        return scores.argmax(dim=-1)
    if not temperature > 0:
        raise ValueError(f"temperature must be above 0, got {temperature}")
    # from the row's best score down, by a temperature no smaller than the scores' dtype holds: one near 0 sends the
    # others to -inf, never the best past +inf or to 0/0 (the softmax would be NaN)
    temperature = max(temperature, torch.finfo(scores.dtype).tiny)
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]  # (batch, 1)
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - ordered.softmax(dim=-1) >= top_p  # keep the smallest prefix reaching top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -torch.inf)
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator)[:, 0]


__all__ = ["HeadBatcher", "choose_tokens"]
