"""The KV cache of a node's session: keys and values written in place into buffers that grow rarely.

transformers' DynamicCache appends each step's keys and values with `torch.cat`, which copies the whole cache of
every layer on every step: at 2,048 cached tokens that copy is a quarter of a decode step of the bench model on the
CPU. `SpanCache` keeps each full-attention layer's keys and values in a buffer (batch, kv_heads, capacity, head_dim)
and writes a step's new rows in place; the attention reads a view of the filled part. A buffer grows (one copy)
only when a step would pass its capacity: to the capacity reserved for the session when the caller gave one
(`reserve`, the node's cache budget: server/sessions.py reserves in doubling chunks), else to twice its size. So
the memory a node's session holds is the memory the budget counted for it.

Sliding-window layers keep transformers' own layer (they drop old keys, which a fixed buffer would not). Values are
the same as DynamicCache's bit for bit: the same keys and values, in the same order, reach the same attention.
The cache is for inference (`torch.inference_mode`, as every caller runs it): a step writes in place what an earlier
step's autograd graph would have saved. Training passes run without a cache.
"""

from __future__ import annotations

import itertools

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

MIN_CAPACITY = 64  # tokens of a buffer's first allocation when no capacity was reserved


_STAMPS = itertools.count(1)  # stamps of buffers set, never given twice in a process


class _StampedBuffer:
    """A layer's buffer attribute: every assignment gives the layer a new `stamp`."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"{name}_buffer"

    def __get__(self, layer, owner=None):
        return self if layer is None else layer.__dict__[self.slot]

    def __set__(self, layer, buffer: torch.Tensor | None) -> None:
        layer.__dict__[self.slot] = buffer
        layer.stamp = next(_STAMPS)


class ReservedLayer(DynamicLayer):
    """One full-attention layer's keys and values in growable buffers; `keys` and `values` view the filled part.
    `stamp` changes whenever either buffer is set (a number never given before): equal stamps, same buffers.

    The views are made when read, once per change of length or buffers: a batched pass replayed as a CUDA graph
    moves the length of every layer of every session in it (16 sessions x 8 layers) and reads none of the views."""

    _keys = _StampedBuffer()
    _values = _StampedBuffer()

    def __init__(self):
        self._viewed = None  # (stamp, length) of the views made last
        self._loose = (None, None)  # keys and values set from outside while no buffer is held (transformers' own)
        super().__init__()
        self.length = 0  # tokens held
        self.reserved = 0  # capacity the owner reserved (0: none; the buffer doubles)
        self._keys: torch.Tensor | None = None  # (batch, kv_heads, capacity, head_dim)
        self._values: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        return self._filled()[0]

    @keys.setter
    def keys(self, keys: torch.Tensor | None) -> None:
        self._loose = (keys, self._loose[1])

    @property
    def values(self) -> torch.Tensor | None:
        return self._filled()[1]

    @values.setter
    def values(self, values: torch.Tensor | None) -> None:
        self._loose = (self._loose[0], values)

    def _filled(self) -> tuple:
        """(keys, values) of the filled part of the buffers (what transformers set, while there is no buffer)."""
        if self._keys is None:
            return self._loose
        now = (self.stamp, self.length)
        if self._viewed != now:
            self._viewed = now
            self._views = (self._keys[..., : self.length, :], self._values[..., : self.length, :])
        return self._views

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new keys and values (batch, kv_heads, seq, head_dim) after the held ones; views of all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity or self._keys.shape[:-2] != key_states.shape[:-2]:
            self._grow(key_states, value_states, end)
        self._keys[..., self.length : end, :].copy_(key_states)
        self._values[..., self.length : end, :].copy_(value_states)
        self._view(end)
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        """New buffers holding at least `end` tokens, the held ones copied in."""
        if self._keys is not None and self._keys.shape[:-2] != key_states.shape[:-2]:
            raise ValueError(
                f"keys of shape {tuple(key_states.shape)} do not match the cache's {tuple(self._keys.shape)}"
            )
        capacity = self.reserved if self.reserved >= end else max(end, 2 * self.capacity, MIN_CAPACITY)
        shape = (*key_states.shape[:-2], capacity, key_states.shape[-1])
        # zeros, not empty: a fixed-shape step (sharding/decode_graph.py) attends over the whole buffer, the rows
        # after the held ones masked, and uninitialized memory may hold NaN, which a mask does not cancel
        keys = key_states.new_zeros(shape)
        values = value_states.new_zeros((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if self.length:
            keys[..., : self.length, :].copy_(self.keys)
            values[..., : self.length, :].copy_(self.values)
        self._keys, self._values = keys, values

    def _view(self, length: int) -> None:
        self.length = length  # `keys` and `values` view the new filled part when next read

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self._keys = self._values = None
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` tokens (transformers' convention: a negative count); the buffer stays."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized or self._keys is None:
            return
        self._view(max(0, self.length + tokens_to_remove))

    # the batch operations copy the held tokens only (the next step's growth makes room again)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            self._keys = self.keys.repeat_interleave(repeats, dim=0)
            self._values = self.values.repeat_interleave(repeats, dim=0)
            self._view(self.length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self._keys, self._values = self.keys[indices, ...], self.values[indices, ...]
            self._view(self.length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.length:
            self.batch_select_indices(beam_idx.to(self._keys.device))


class SpanCache(DynamicCache):
    """A DynamicCache for a span's config whose full-attention layers are `ReservedLayer`s."""

    def __init__(self, config):
        super().__init__(config=config)
        self.layers = [ReservedLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
        # its one-token step of fixed shape (sharding/decode_graph.py), once it has one; False: none for this session
        self.fixed_step = None
        self.batch_memo = None  # what sharding/batch_graph.py found of its buffers, by their stamps

    def reserve(self, tokens: int) -> None:
        """Let buffers that must grow grow to `tokens` (the capacity the owner has reserved) rather than by doubling;
        buffers already allocated keep their size until a step needs more."""
        for layer in self.layers:
            if isinstance(layer, ReservedLayer):
                layer.reserved = tokens

    def held_bytes(self) -> int:
        """Bytes of the layers' buffers (keys and values), allocated capacity included."""
        return sum(
            buffer.numel() * buffer.element_size()
            for layer in self.layers
            if isinstance(layer, ReservedLayer) and layer._keys is not None
            for buffer in (layer._keys, layer._values)
        )
