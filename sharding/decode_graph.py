"""One-token decode steps of fixed shape, replayed as CUDA graphs.

A one-token step of a short span launches a dozen and more kernels per block; on a GPU the host's work to launch
them, not the device, sets the step's pace. A CUDA graph replays a captured step with one launch, but a capture
fixes every tensor's shape and address. `FixedStep` is a step written that way, for one session's cache:

- the attention reads the session's `SpanCache` buffers whole (their capacity of keys), the keys after the step's
  position masked out; the step writes its keys and values at that position with `index_copy_`, the position held
  in a device tensor;
- the rotary rows come from the span's table (sharding/blocks.py), indexed on the device;
- the input and the output live in tensors of the step's own, filled and read around each replay.

On CUDA the step is captured at the session's first eligible step and replayed after; a buffer that grows (a new
address) gets a new capture. Eagerly, on any device, it computes what `BlockSpan.forward` does (up to the rounding
of attention over the masked keys), which is how it is tested without a GPU.

Capture and replay rules kept here:
- the warm-up run capture needs, and the capture, use the step's real input at its real position (the warm-up
  really writes that slot of the cache: the replay then writes the same);
- every capture of a span runs on one stream of its own, whose first (warm-up) run allocates cuBLAS's workspace
  for that stream outside any graph: graphs never own, and never free, a workspace another graph uses;
- each graph has its own memory pool (no graph's replay can overwrite another's output); a capture cannot take the
  blocks torch's allocator caches (nor does the allocator give them back to the device on a failed allocation while
  a capture is underway, as it does otherwise), so a capture that runs out of memory is tried once more after
  `torch.cuda.empty_cache()` (which also frees the pools of graphs dropped since);
- captures and replays hold one lock: a node runs steps on its event loop and on its compute thread, and only
  one capture may be underway in a process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from nesa_node.sharding.span_cache import ReservedLayer, SpanCache

T = TypeVar("T")
_LOCK = threading.Lock()  # captures and replays of every span of the process (see the module docstring)


class _SlotCache:
    """What the layers of a fixed step see as their cache: keys and values written at the device position `slot`,
    the whole buffers read back."""

    def __init__(self, layers: list, slot: torch.Tensor):
        self.layers = layers
        self.slot = slot

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        layer._keys.index_copy_(2, self.slot, keys)
        layer._values.index_copy_(2, self.slot, values)
        return layer._keys, layer._values


def _stamps(layers: list, first: int, end: int) -> tuple:
    """The stamps of the buffers of layers first..end-1 (None for a layer without)."""
    return tuple([getattr(layer, "stamp", None) for layer in layers[first:end]])


def _buffers(layers: list, first: int, end: int) -> tuple | None:
    """The addresses and shapes of the buffers of layers first..end-1, or None unless each is an allocated
    ReservedLayer of one capacity."""
    run = layers[first:end]
    if not run or not all(isinstance(layer, ReservedLayer) and layer._keys is not None for layer in run):
        return None
    if len({layer.capacity for layer in run}) != 1:
        return None
    return tuple(
        (buffer.data_ptr(), tuple(buffer.shape)) for layer in run for buffer in (layer._keys, layer._values)
    )  # fmt: skip


def with_room(attempt: Callable[[], T], free: Callable[[], None]) -> T:
    """`attempt()`; if it runs out of device memory, `free()` and `attempt()` once more (its error then raises)."""
    try:
        return attempt()
    except torch.OutOfMemoryError:
        free()
    return attempt()


def capture(stream, run) -> tuple:
    """`run()` warmed up, then captured as a CUDA graph, on `stream` (the span's capture stream; the module's rules):
    (the graph, the output tensor its replays write). Out of device memory, tried again once the allocator's cached
    blocks are given back (module docstring)."""
    return with_room(lambda: _capture_once(stream, run), torch.cuda.empty_cache)


def _capture_once(stream, run) -> tuple:
    """One capture (see `capture`). The calling stream waits for `stream` afterwards, also after a failed capture: the
    warm-up's kernels may still read tensors the caller frees next."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            run()  # warm-up: kernels chosen, cuBLAS's workspace for this stream allocated outside any graph
            # thread_local: the node's other threads may use the device meanwhile; a pool of its own (see module)
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                output = run()
            finally:
                graph.capture_end()
    finally:
        torch.cuda.current_stream(stream.device).wait_stream(stream)
    return graph, output


class NoMemory:
    """What a session's cache holds in place of its fixed step after a capture ran out of device memory: its steps run
    as usual while its buffers are the ones of `stamps`; once they grow (new buffers) a capture is tried again."""

    def __init__(self, stamps: tuple):
        self.stamps = stamps

    def holds(self, layers: list, first: int, end: int) -> bool:
        """Whether layers first..end-1 still have the buffers the capture ran out of memory with."""
        return _stamps(layers, first, end) == self.stamps


class FixedStep:
    """A one-token step of `rows` rows through blocks [first, end) of `span` (span-relative), over `cache`'s buffers
    as they are now (see the module docstring). `__call__(hidden, position)` runs it and moves the cache's length;
    with `capture_stream` (CUDA) its first call captures it as a graph, later calls replay that."""

    def __init__(self, span, cache: SpanCache, first: int, end: int, rows: int, capture_stream=None):
        self.span = span
        self.layers = cache.layers  # not the cache: the cache holds this step (no reference cycle)
        self.first, self.end, self.rows = first, end, rows
        self.stamps = _stamps(self.layers, first, end)  # the same buffers while these stay (span_cache.py)
        if _buffers(self.layers, first, end) is None:
            raise ValueError("a fixed step needs the run layers' cache buffers allocated, of one capacity")
        layer = self.layers[first]
        self.capacity = layer.capacity
        device, dtype = layer._keys.device, span.dtype_
        table = span._table(self.capacity)
        if table is None:
            raise ValueError("a fixed step needs the span's rotary table (this rotary type is not tabulated)")
        self.cos, self.sin = table[0][0], table[1][0]  # (positions, head_dim): held, so a regrown table leaves them
        self.hidden = torch.zeros(rows, 1, span.hidden_size, device=device, dtype=dtype)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.key_positions = torch.arange(self.capacity, device=device)
        self.open_mask = torch.zeros(self.capacity, device=device, dtype=dtype)
        self.slot_cache = _SlotCache(self.layers, self.slot)
        self.capture_stream = capture_stream
        self.graph = None
        self.output: torch.Tensor | None = None

    def fits(self, cache: SpanCache, first: int, end: int, rows: int) -> bool:
        """Whether this step still runs `cache`'s blocks [first, end) for `rows` rows (same buffers: not grown)."""
        same = cache.layers is self.layers and (first, end, rows) == (self.first, self.end, self.rows)
        return same and _stamps(self.layers, first, end) == self.stamps

    def _run(self) -> torch.Tensor:
        slot = self.slot
        cos = self.cos.index_select(0, slot).unsqueeze(0)  # (1, 1, head_dim)
        sin = self.sin.index_select(0, slot).unsqueeze(0)
        mask = self.open_mask.masked_fill(self.key_positions > slot, torch.finfo(self.open_mask.dtype).min)
        mask = mask.view(1, 1, 1, self.capacity)
        position_ids = slot.view(1, 1)
        hidden = self.hidden
        for layer in self.span.layers[self.first : self.end]:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=self.slot_cache,
                use_cache=True,
                position_embeddings=(cos, sin),
            )
        return hidden

    def _capture(self) -> None:
        """Warm up, then capture, with the input and slot already set."""
        self.graph, self.output = capture(self.capture_stream, self._run)

    def __call__(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """The blocks' output for `hidden` (rows, 1, hidden) at `position` (the cache's length, below its
        capacity); the cache then holds position + 1 tokens. A capture that fails raises, the cache's length
        unchanged (its slot at `position` is written again by whatever step comes next)."""
        if not 0 <= position < self.capacity:
            raise ValueError(f"position {position} is outside the cache's capacity {self.capacity}")
        with _LOCK if self.capture_stream is not None else contextlib.nullcontext():
            self.hidden.copy_(hidden)
            self.slot.fill_(position)
            if self.capture_stream is None:
                output = self._run()
            else:
                if self.graph is None:
                    self._capture()
                self.graph.replay()
                output = self.output.clone()  # the next replay overwrites it
        for layer in self.layers[self.first : self.end]:
            layer._view(position + 1)
        return output


__all__ = ["FixedStep", "NoMemory", "capture", "with_room"]
