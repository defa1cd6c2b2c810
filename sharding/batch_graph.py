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
arrived in. `run` captures a batch the second time it meets it (a batch seen once, as sessions join or leave, runs as
the eager pass does) and replays it while it repeats; a span keeps its HELD most recent batches (a batch dropped frees
its graph's memory), so that passes alternating between a few batches (a straggler's step left for the next pass)
replay each. Passes with LoRA rows run eagerly (a graph replays the base weights). Eagerly, on any device, a fixed
batch computes what the eager pass does, up to the rounding of attention over masked keys: how
it is tested without a GPU. Captures follow decode_graph.py's rules (one stream per span, a pool per graph, the
process-wide lock, the warm-up run with the real input at the real positions).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict

import torch
from torch import nn

from nesa_node.sharding.decode_graph import _LOCK, _buffers, _stamps, capture
from nesa_node.sharding.lora_rows import rows_active
from nesa_node.sharding.span_cache import SpanCache

logger = logging.getLogger(__name__)

NO_MEMORY = "no memory"  # held for a batch whose capture ran out of device memory: eager while it is held
HELD = 4  # batches a span keeps (graphs, and batches seen once), the least recently run dropped first (guess)


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
        if hidden.shape[1] != 1 or not isinstance(cache, SpanCache):
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
        if rows != hidden.shape[0] or position != run[0].length or position >= capacity:
            return None
        parts.append((rows, id(cache.layers), stamps))  # the identity too: a copied layer would carry its stamp
    return (first, end, *parts)


class FixedBatch:
    """A batched one-token pass of sessions of `rows` rows each through span layers [first, end), over the buffers
    of `caches` as they are now (module docstring). `__call__(caches, inputs, positions)` runs it for caches of the
    batch's `key` and moves each cache's length; with `capture_stream` (CUDA) its first call captures it as a graph,
    later calls replay that. It holds no cache: a closed session's buffers are freed as usual, and a batch whose key
    matches again has, by its stamps, the very buffers the graph writes and reads."""

    def __init__(self, span, caches: list[SpanCache], first: int, end: int, rows: list[int], key: tuple,
                 capture_stream=None):  # fmt: skip
        self.span, self.key = span, key
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

    def __call__(self, caches: list[SpanCache], inputs: list[torch.Tensor], positions: list[int]) -> list[torch.Tensor]:
        """Each session's output for its `inputs` (rows, 1, hidden) at `positions` (its cache's length, below its
        capacity); each cache then holds position + 1 tokens. A capture that fails raises, no length moved."""
        per_row = [position for position, count in zip(positions, self.rows, strict=True) for _ in range(count)]
        with _LOCK if self.capture_stream is not None else contextlib.nullcontext():
            if len({(step.device, step.dtype) for step in inputs}) == 1:  # the usual case: one copy to the device
                self.hidden.copy_(torch.cat(inputs))
            else:
                for start, stop, step in zip(self.bounds, self.bounds[1:], inputs, strict=False):
                    self.hidden[start:stop].copy_(step)
            self.positions.copy_(torch.tensor(per_row), non_blocking=True)
            if self.capture_stream is None:
                output = self._run(caches)
            else:
                if self.graph is None:
                    self._capture(caches)
                self.graph.replay()
                output = self.output.clone()  # the next replay overwrites it
        for cache, position in zip(caches, positions, strict=True):
            for layer in cache.layers[self.first : self.end]:
                layer._view(position + 1)
        return list(output.split(self.rows))


def release(span) -> None:
    """Drop the span's batches and their graphs' memory (its node has no session left: none of them comes again)."""
    span._fixed_batch = None


def run(span, steps: list, first: int, end: int) -> list[torch.Tensor] | None:
    """`steps` ((hidden, cache, position) each) through span layers [first, end) as one of the span's fixed batches,
    or None where this pass runs eagerly: LoRA rows, a batch that cannot run fixed, or one not among the span's
    HELD recent batches (module docstring). The steps are taken in an order of their caches', so that the same
    sessions arriving in another order are the same batch; the outputs come back in the steps' order. A capture
    that fails turns the span's batch graphs off (logged; one out of device memory only that batch's, while it is
    held) and this pass runs eagerly; a replay that fails raises (its batch dropped)."""
    if not span.batch_graphs or rows_active(span) or not torch.is_inference_mode_enabled():
        return None  # LoRA rows: a graph replays the base weights only; the batches held stay for later passes
    order = sorted(range(len(steps)), key=lambda index: id(steps[index][1]))
    steps = [steps[index] for index in order]
    key = signature(steps, first, end)
    if key is None:
        return None
    held = span._fixed_batch = span._fixed_batch if span._fixed_batch is not None else OrderedDict()
    fixed = held.pop(key, None)
    held[key] = False if fixed is None else fixed  # the most recent; False: seen once
    while len(held) > HELD:
        held.popitem(last=False)  # its graph and memory go with it
    if fixed is None or fixed is NO_MEMORY:
        return None  # seen once: captured if it comes again; or no device memory for its graph (until dropped)
    caches = [cache for _, cache, _ in steps]
    try:
        if fixed is False:
            rows = [hidden.shape[0] for hidden, _, _ in steps]
            fixed = held[key] = FixedBatch(span, caches, first, end, rows, key, capture_stream=span._capture_stream())
        outputs = fixed(caches, [hidden for hidden, _, _ in steps], [position for _, _, position in steps])
    except ValueError:
        held.pop(key, None)  # a rotary type without a table
        return None
    except RuntimeError as exc:
        if fixed is not False and fixed.graph is not None:
            held.pop(key, None)  # a replay that failed: not a capture matter; not replayed again
            raise
        if isinstance(exc, torch.OutOfMemoryError):  # memory may be short for a moment: this batch runs eagerly
            held[key] = NO_MEMORY
            logger.info("blocks %d:%d: no device memory for a batched pass's CUDA graph", span.start, span.end)
            return None
        held.clear()
        logger.warning("blocks %d:%d: batched pass capture failed (%s): batches run eagerly", span.start, span.end, exc)
        span.batch_graphs = False
        return None
    result: list[torch.Tensor] = [outputs[0]] * len(outputs)
    for position, index in enumerate(order):
        result[index] = outputs[position]
    return result


__all__ = ["HELD", "NO_MEMORY", "FixedBatch", "release", "run", "signature"]
