"""Batched decode passes of fixed shape, replayed as CUDA graphs (the batched twin of sharding/decode_graph.py).

A node batching the one-token steps of 16 sessions runs one pass for all of them (`BlockSpan.decode_batch`), but
eagerly that pass still launches every kernel of every block from the host, plus the cache work of each session,
and on a GPU the host's launches set its pace. Sessions that decode together keep decoding together: the same
sessions, in the same order, pass after pass, each one token further. `FixedBatch` is such a pass written with
fixed shapes and addresses, so that it can be captured once and replayed:

- each session's keys and values are written at its position (a device tensor per row) into its own `SpanCache`
  buffers with `index_copy_`; the attention reads every session's buffers whole, padded to the largest capacity
  and laid one after the other (rows, kv_heads, capacity, head_dim), each row's keys after its position masked out;
- the rotary rows come from the span's table, indexed on the device by each row's position;
- the input and the output live in tensors of the pass's own, filled and read around each replay.

A batch is known by its sessions' buffers (their stamps: span_cache.py), rows and blocks, whatever the order its steps
arrived in. The sessions of a swarm's passes do not arrive together every round: a pass takes the steps queued when it
starts, ten of sixteen sessions one pass and the other six the next, in shifting groups. So a batch is built over the
pass's sessions and those of the span's last RECENT_PASSES passes (at most COVER_ROWS rows), and replays any pass of
its sessions, whichever of them step: a session absent from the pass runs a row all the same, on the input its last
step left, and writes keys and values at its cache's length, the slot its next step writes again before any attention
reads it (every step writes its own position first); its length does not move and its output is dropped. Rows cost
little on a GPU next to the launches a graph saves. An absent session is run only while it stepped in one of the last
RECENT_PASSES passes (an idle one's row is not worth its attention over its buffers), its cache is alive with its
buffers unchanged (weakly held: a closed session's buffers are freed as usual, and the batch then covers no pass) and
it has room for that slot. `run` captures a batch the second time it meets it (a batch seen once, as sessions join or
leave, runs as the eager pass does) and replays it while it covers the passes; a span keeps its HELD most recent
batches (a batch dropped frees its graph's memory). Passes with LoRA rows run eagerly (a graph replays the base
weights). Eagerly, on any device, a fixed batch computes what the eager pass does, up to the rounding of attention
over masked keys: how it is tested without a GPU. Captures follow decode_graph.py's rules (one stream per span, a
pool per graph, the process-wide lock, the warm-up run with the real input at the real positions).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import OrderedDict

import torch
from torch import nn

from nesa_node.sharding.decode_graph import _LOCK, _buffers, _stamps, capture
from nesa_node.sharding.lora_rows import rows_active
from nesa_node.sharding.span_cache import SpanCache

logger = logging.getLogger(__name__)

NO_MEMORY = "no memory"  # held for a batch whose capture ran out of device memory: eager while it is held
HELD = 4  # batches a span keeps (graphs, and batches seen once), the least recently run dropped first (guess)
RECENT_PASSES = 8  # a session that ran in one of the span's last this many passes is taken into a new batch (guess)
COVER_ROWS = 64  # the most rows a new batch takes on for sessions absent from the pass that builds it (guess)


class _RowsSlotCache:
    """What the layers of a fixed batch see as their cache: each session's new keys and values written at its
    position, every session's whole buffers read back padded to the largest capacity."""

    def __init__(self, caches: list[SpanCache], bounds: list[int], positions: torch.Tensor, capacity: int):
        self.caches = caches
        self.bounds = bounds
        self.slots = [positions[start : start + 1] for start in bounds[:-1]]  # each session's position, a view
        self.capacity = capacity

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        read_keys, read_values = [], []
        for cache, slot, start, stop in zip(self.caches, self.slots, self.bounds, self.bounds[1:], strict=False):
            layer = cache.layers[layer_idx]
            layer._keys.index_copy_(2, slot, keys[start:stop])
            layer._values.index_copy_(2, slot, values[start:stop])
            pad = (0, 0, 0, self.capacity - layer.capacity)
            read_keys.append(nn.functional.pad(layer._keys, pad) if pad[-1] else layer._keys)
            read_values.append(nn.functional.pad(layer._values, pad) if pad[-1] else layer._values)
        return torch.cat(read_keys), torch.cat(read_values)


def signature(steps: list, first: int, end: int) -> tuple | None:
    """What a batch of `steps` ((hidden, cache, position) each) through span layers [first, end) is known by: per
    session its rows and the stamps of its run layers' buffers (span_cache.py: equal stamps, the same buffer
    objects, so the same addresses); None when a step cannot run fixed (not a one-token step of a SpanCache at its
    length, its buffers not allocated, of one capacity and with room). A cache's buffers are examined once per
    change of stamps (`batch_memo`), so a pass's key costs an attribute read a layer."""
    parts = []
    for hidden, cache, position in steps:
        if hidden.shape[1] != 1:
            return None
        part = _part(cache, first, end, position)
        if part is None or part[0] != hidden.shape[0]:
            return None
        parts.append(part)
    return (first, end, *parts)


def _part(cache, first: int, end: int, position: int | None = None) -> tuple | None:
    """A session's part of a batch key, (rows, identity of its layers, stamps of their buffers), for a one-token step
    at `position` (its length when None); None unless the step can run fixed (`signature`)."""
    if not isinstance(cache, SpanCache):
        return None
    run = cache.layers[first:end]
    stamps = _stamps(cache.layers, first, end)
    memo = cache.batch_memo
    if memo is None or memo[0] != stamps:
        buffers = None if None in stamps else _buffers(cache.layers, first, end)
        memo = cache.batch_memo = (stamps, None if buffers is None else (buffers[0][1][0], run[0].capacity))
    if memo[1] is None:
        return None
    rows, capacity = memo[1]
    length = run[0].length
    if position is None:
        position = length
    if position != length or position >= capacity:
        return None
    return (rows, id(cache.layers), stamps)  # the identity too: a copied layer would carry its stamp


class FixedBatch:
    """A batched one-token pass of sessions of `rows` rows each through span layers [first, end), over the buffers
    of `caches` as they are now (module docstring). `__call__(caches, inputs, positions)` runs it for caches of the
    batch's `key` and moves each cache's length; with `capture_stream` (CUDA) its first call captures it as a graph,
    later calls replay that. It holds no cache: a closed session's buffers are freed as usual, and a batch whose key
    matches again has, by its stamps, the very buffers the graph writes and reads."""

    def __init__(self, span, caches: list[SpanCache], first: int, end: int, rows: list[int], key: tuple,
                 capture_stream=None):  # fmt: skip
        self.span, self.key = span, key
        self.parts = {part: index for index, part in enumerate(key[2:])}  # each session's part: its place in the batch
        self.sessions = [weakref.ref(cache) for cache in caches]  # not held: a closed session's buffers are freed
        self.first, self.end, self.rows = first, end, rows
        self.bounds = [sum(rows[:index]) for index in range(len(rows) + 1)]
        self.capacity = max(cache.layers[first].capacity for cache in caches)
        device, dtype = caches[0].layers[first]._keys.device, span.dtype_
        table = span._table(self.capacity)
        if table is None:
            raise ValueError("a fixed batch needs the span's rotary table (this rotary type is not tabulated)")
        self.cos, self.sin = table[0][0], table[1][0]  # (positions, head_dim)
        total = self.bounds[-1]
        self.hidden = torch.zeros(total, 1, span.hidden_size, device=device, dtype=dtype)
        self.positions = torch.zeros(total, dtype=torch.long, device=device)
        self.key_positions = torch.arange(self.capacity, device=device)
        self.open_mask = torch.zeros(total, self.capacity, device=device, dtype=dtype)
        self.capture_stream = capture_stream
        self.graph = None
        self.output: torch.Tensor | None = None

    def _run(self, caches: list[SpanCache]) -> torch.Tensor:
        positions = self.positions
        cache = _RowsSlotCache(caches, self.bounds, positions, self.capacity)
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # (rows, 1, head_dim)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        closed = self.key_positions[None, :] > positions[:, None]  # (rows, capacity): keys after each row's own
        mask = self.open_mask.masked_fill(closed, torch.finfo(self.open_mask.dtype).min)[:, None, None, :]
        hidden = self.hidden
        for layer in self.span.layers[self.first : self.end]:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=positions.view(-1, 1),
                past_key_values=cache,
                use_cache=True,
                position_embeddings=(cos, sin),
            )
        return hidden

    def _capture(self, caches: list[SpanCache]) -> None:
        """Warm up (writing the same keys the replay writes again), then capture, inputs and positions already set."""
        self.graph, self.output = capture(self.capture_stream, lambda: self._run(caches))

    def covering(self, steps: list, parts: list[tuple], recent: dict) -> list[SpanCache] | None:
        """The batch's caches, in its order, if it can run a pass of `steps` whose sessions have `parts` (`_part`):
        each of them is one of the batch's, and each of its other sessions stepped in one of the span's last
        RECENT_PASSES passes (`recent`: `_note`; an idle session's row is not worth its attention over its buffers)
        and is alive with the same buffers and room for a row's slot at its length (module docstring); else None."""
        if len(parts) > len(self.parts) or any(part not in self.parts for part in parts):
            return None
        caches = [session() for session in self.sessions]
        present = {self.parts[part]: cache for part, (_, cache, _) in zip(parts, steps, strict=True)}
        newest = recent.get("pass", 0)
        for index, (cache, part) in enumerate(zip(caches, self.parts, strict=True)):
            if cache is None:
                return None
            if index in present:
                if present[index] is not cache:
                    return None
                continue
            seen = recent.get(id(cache))
            if seen is None or seen[0]() is not cache or newest - seen[2] >= RECENT_PASSES:
                return None
            if _part(cache, self.first, self.end) != part:
                return None
        return caches

    def __call__(
        self, caches: list[SpanCache], inputs: list[torch.Tensor | None], positions: list[int]
    ) -> list[torch.Tensor | None]:
        """Each session's output for its `inputs` (rows, 1, hidden) at `positions` (its cache's length, below its
        capacity); each cache then holds position + 1 tokens. A session whose input is None is absent from the pass
        (module docstring): its row runs at `position`, its cache's length, which stays; its output is None. A
        capture that fails raises, no length moved."""
        per_row = [position for position, count in zip(positions, self.rows, strict=True) for _ in range(count)]
        with _LOCK if self.capture_stream is not None else contextlib.nullcontext():
            given = [step for step in inputs if step is not None]
            if len({(step.device, step.dtype) for step in given}) != 1:
                for start, stop, step in zip(self.bounds, self.bounds[1:], inputs, strict=False):
                    if step is not None:
                        self.hidden[start:stop].copy_(step)
            elif len(given) == len(inputs):  # the usual case: one copy to the device
                self.hidden.copy_(torch.cat(inputs))
            else:  # an absent session's row keeps the input its last step left
                rows = [row for start, stop, step in zip(self.bounds, self.bounds[1:], inputs, strict=False)
                        if step is not None for row in range(start, stop)]  # fmt: skip
                index = torch.tensor(rows).to(self.hidden.device, non_blocking=True)
                self.hidden.index_copy_(0, index, torch.cat(given).to(self.hidden.device, self.hidden.dtype))
            self.positions.copy_(torch.tensor(per_row), non_blocking=True)
            if self.capture_stream is None:
                output = self._run(caches)
            else:
                if self.graph is None:
                    self._capture(caches)
                self.graph.replay()
                output = self.output.clone()  # the next replay overwrites it
        for cache, position, step in zip(caches, positions, inputs, strict=True):
            if step is not None:
                for layer in cache.layers[self.first : self.end]:
                    layer._view(position + 1)
        return [part if step is not None else None for part, step in zip(output.split(self.rows), inputs, strict=True)]


def release(span) -> None:
    """Drop the span's batches and their graphs' memory (its node has no session left: none of them comes again)."""
    span._fixed_batch = None
    span.__dict__.pop("_batch_recent", None)


def counts(span) -> dict[str, int]:
    """The span's fixed-batch counters: passes run as a fixed batch, rows run there for absent sessions, batches
    built (a capture each on CUDA); and sessions' own one-token steps captured (`step_built`: BlockSpan.step)."""
    return span.__dict__.setdefault("_batch_counts", {"passes": 0, "absent_rows": 0, "built": 0, "step_built": 0})


def _note(span, steps: list, first: int, end: int) -> dict:
    """Note the sessions of `steps` as seen in the span's newest pass, through [first, end); returns the span's
    notes: id of cache -> (weak reference, blocks, number of the pass it was last seen in), and "pass": the newest
    pass's number."""
    recent = span.__dict__.setdefault("_batch_recent", OrderedDict())
    number = recent["pass"] = recent.get("pass", 0) + 1
    for _, cache, _ in steps:
        recent.pop(id(cache), None)
        recent[id(cache)] = (weakref.ref(cache), (first, end), number)
    return recent


def _recent(recent: dict, steps: list, first: int, end: int) -> list[tuple[SpanCache, tuple]]:
    """(cache, part) of the sessions of the span's last RECENT_PASSES passes through [first, end) (`_note`) that
    are not in `steps`, are alive and can run fixed, the most recently seen first, as long as their rows stay within
    COVER_ROWS."""
    number = recent["pass"]
    present = {id(cache) for _, cache, _ in steps}
    others, rows = [], 0
    for key, value in reversed(list(recent.items())):
        if key == "pass":
            continue
        session, blocks, seen = value
        cache = session()
        if cache is None or number - seen >= RECENT_PASSES:
            del recent[key]
            continue
        if key in present or blocks != (first, end) or (part := _part(cache, first, end)) is None:
            continue
        if rows + part[0] <= COVER_ROWS:
            rows += part[0]
            others.append((cache, part))
    return others


def run(span, steps: list, first: int, end: int) -> list[torch.Tensor] | None:
    """`steps` ((hidden, cache, position) each) through span layers [first, end) as one of the span's fixed batches,
    or None where this pass runs eagerly: LoRA rows, a step that cannot run fixed, or no batch held that covers the
    pass (module docstring): the pass's sessions and the span's recent ones then make a batch, built if it was seen
    before; a pass of one step makes none (sessions taking turns alone would cycle more batches than a span holds,
    each pushing out a graph before its own comes round again). The outputs come back in the steps' order. A capture
    that fails turns the span's batch graphs off (logged; one out of device memory only that batch's, while it is
    held) and this pass runs eagerly; a replay that fails raises (its batch dropped)."""
    if not span.batch_graphs or rows_active(span) or not torch.is_inference_mode_enabled():
        return None  # LoRA rows: a graph replays the base weights only; the batches held stay for later passes
    key = signature(steps, first, end)
    if key is None:
        return None
    held = span._fixed_batch = span._fixed_batch if span._fixed_batch is not None else OrderedDict()
    recent = _note(span, steps, first, end)
    fixed = caches = batch_key = None
    for candidate_key in reversed(held):  # the most recently run first
        candidate = held[candidate_key]
        if isinstance(candidate, FixedBatch) and (found := candidate.covering(steps, list(key[2:]), recent)):
            fixed, caches, batch_key = candidate, found, candidate_key
            held.move_to_end(batch_key)
            break
    if fixed is None and len(steps) == 1:
        return None  # a pass of one (a node's step given alone) replays a batch or runs eagerly, never builds one
    if fixed is None:  # the pass's sessions and the recent others, in an order of their caches'
        members = sorted(
            [(cache, part) for (_, cache, _), part in zip(steps, key[2:], strict=True)]
            + _recent(recent, steps, first, end),
            key=lambda member: id(member[0]),
        )
        batch_key = (first, end, *[part for _, part in members])
        seen = held.pop(batch_key, None)
        held[batch_key] = False if seen is None else seen  # the most recent; False: seen once
        while len(held) > HELD:
            held.popitem(last=False)  # its graph and memory go with it
        if seen is not False:
            return None  # seen once: built if it comes again; or no device memory for its graph (until dropped)
        caches = [cache for cache, _ in members]
    place = {id(cache): index for index, cache in enumerate(caches)}
    inputs: list[torch.Tensor | None] = [None] * len(caches)
    positions = [cache.layers[first].length for cache in caches]  # an absent session's row: its next slot
    for hidden, cache, position in steps:
        inputs[place[id(cache)]], positions[place[id(cache)]] = hidden, position
    tally, built = counts(span), fixed is None
    try:
        if fixed is None:
            rows = [part[0] for _, part in members]
            fixed = held[batch_key] = FixedBatch(
                span, caches, first, end, rows, batch_key, capture_stream=span._capture_stream()
            )
        outputs = fixed(caches, inputs, positions)
    except ValueError:
        held.pop(batch_key, None)  # a rotary type without a table
        return None
    except RuntimeError as exc:
        if fixed is not None and fixed.graph is not None:
            held.pop(batch_key, None)  # a replay that failed: not a capture matter; not replayed again
            raise
        if isinstance(exc, torch.OutOfMemoryError):  # memory may be short for a moment: this batch runs eagerly
            held[batch_key] = NO_MEMORY
            logger.info("blocks %d:%d: no device memory for a batched pass's CUDA graph", span.start, span.end)
            return None
        held.clear()
        logger.warning("blocks %d:%d: batched pass capture failed (%s): batches run eagerly", span.start, span.end, exc)
        span.batch_graphs = False
        return None
    tally["built"] += built  # once its capture, if any, went through
    tally["passes"] += 1
    tally["absent_rows"] += sum(rows for rows, step in zip(fixed.rows, inputs, strict=True) if step is None)
    return [outputs[place[id(cache)]] for _, cache, _ in steps]


__all__ = ["COVER_ROWS", "HELD", "NO_MEMORY", "RECENT_PASSES", "FixedBatch", "counts", "release", "run", "signature"]
