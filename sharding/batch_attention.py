"""Attention of a node's batched passes (sharding/blocks.py `BlockSpan.decode_batch` and `run_batch`): the steps
of several sessions in one pass, each session's keys and values kept in its own cache.

- `RowsCache`: the cache a batched pass of one-token steps hands the layers; `write` appends each session's new
  keys and values to its cache, `update` also returns them padded to the longest (the layers' own forward: a GPU's
  pass).
- `layer_per_session`: one decoder layer run part by part, projections and MLP once over all rows, attention by
  the caller's rule: `attend_steps` (one-token steps, an sdpa call a session over its cache as it lies: the CPU's
  pass) or `attend_prompts` (steps of any length, causal among each step's new tokens: `--batch-prompts`).

- `without_cudnn_attention`: a CUDA span's process keeps torch's attention off cuDNN (below).

A GPU's pass attends in one call for all sessions (one kernel). On the CPU copying every cache into the padded
tensors grows with every token, and a session's own calls cost less than that from short caches on (8 sessions
through 4 blocks of hidden 512 on this project's 2-core CPU: padded 19.2 ms against 19.3 ms at 16 cached tokens,
22.4 against 21.1 at 96, 52.8 against 25.0 at 400; 16 sessions at 64 tokens, 35.4 against 30.0).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def without_cudnn_attention() -> None:
    """Turn cuDNN's backend of `scaled_dot_product_attention` off in this process (called when a CUDA span loads).
    Where it is on, torch picks it for attention with a mask on Hopper GPUs (a padded batched pass, a prompt after
    cached tokens), and cuDNN builds an execution plan for every new shape and stride of its inputs, which takes
    tens to hundreds of milliseconds of host time; a node's attention changes length at every step (each pass
    attends one token further), so every pass would pay a build. Flash and memory-efficient attention, and the math
    fallback, build nothing."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        logger.debug("cuDNN attention turned off: it plans every new sequence length anew")


class RowsCache:
    """The cache of a batched decode step: each row range's keys and values go to that session's own cache (`write`),
    and the attention reads them either a session at a time (`layer_per_session`, the CPU's) or, as the cache the
    layers' own forward is handed (`update`), padded (after their end) to the longest, the padding masked out.

    For sessions whose layer is a `ReservedLayer` with room for the step (the common case), the writes of all of
    them go as one `_foreach_copy_` and the reads take each buffer's first `longest` rows as they are: the rows past
    a session's end hold zeros or keys it no longer holds (cropped), finite either way, and the mask gives them
    weight exactly 0, so the attention is what zero padding gives. Per session and layer that leaves two copies
    issued from one call and no padding, where each session's own `update` and its padding made four operations on
    the host. Other layers (no buffer yet, or a buffer to grow) take their own `update` and are padded with zeros."""

    def __init__(self, caches: list, rows: list[int]):
        self.caches = caches
        self.bounds = [sum(rows[:index]) for index in range(len(rows) + 1)]

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        """keys, values (rows, kv_heads, 1, head_dim) -> every session's, padded: (rows, kv_heads, longest, head_dim)."""
        held = self.write(keys, values, layer_idx)
        longest = max(length for _, _, length in held)
        return _padded([key for key, _, _ in held], longest), _padded([value for _, value, _ in held], longest)

    def write(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> list[tuple[torch.Tensor, ...]]:
        """Append each session's rows of keys, values (rows, kv_heads, 1, head_dim) to its cache; returns, per
        session, (keys, values, tokens it holds): its cache's whole buffers where it has them (the rows past its
        end are not its keys), else the keys and values its cache's `update` returned."""
        from nesa_node.sharding.span_cache import ReservedLayer

        step = keys.shape[-2]
        rows = [end - start for start, end in zip(self.bounds, self.bounds[1:], strict=False)]
        key_rows, value_rows = keys.split(rows), values.split(rows)  # each session's, as views
        layers = [cache.layers[layer_idx] for cache in self.caches]
        in_place = [
            type(layer) is ReservedLayer
            and layer._keys is not None
            and layer.length + step <= layer._keys.shape[-2]
            and layer._keys.shape[:-2] == (count, keys.shape[1])
            for layer, count in zip(layers, rows, strict=True)
        ]
        written = [index for index, fits in enumerate(in_place) if fits]
        if written:
            for sources, name in ((key_rows, "_keys"), (value_rows, "_values")):
                targets = [
                    getattr(layers[i], name)[..., layers[i].length : layers[i].length + step, :] for i in written
                ]
                _copy_all(targets, [sources[i] for i in written])
            for index in written:
                layers[index]._view(layers[index].length + step)
        held = []
        for cache, layer, fits, k, v in zip(self.caches, layers, in_place, key_rows, value_rows, strict=True):
            if fits:
                held.append((layer._keys, layer._values, layer.length))
            else:
                key, value = cache.update(k, v, layer_idx)
                held.append((key, value, key.shape[-2]))
        return held


def layer_per_session(layer, hidden: torch.Tensor, position_embeddings, rotate, attend) -> torch.Tensor:
    """One decoder layer over a batched pass's tokens (tokens, 1, hidden), as the layer's own forward computes it
    (norm, attention, residual, norm, MLP, residual; the projections and MLP once over all tokens, through the
    modules, so LoRA rows' hooks apply), except that attention is `attend(query, keys, values, layer_idx)`: the
    queries (tokens, heads, 1, head_dim) and new keys and values (tokens, kv_heads, 1, head_dim), rotated, in; each
    token's attention output (tokens, 1, heads, head_dim) out, computed a session at a time by the caller's rule."""
    attn = layer.self_attn
    residual = hidden
    normed = layer.input_layernorm(hidden)
    shape = (*normed.shape[:-1], -1, attn.head_dim)
    query = attn.q_proj(normed).view(shape).transpose(1, 2)  # (tokens, heads, 1, head_dim)
    keys = attn.k_proj(normed).view(shape).transpose(1, 2)
    values = attn.v_proj(normed).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, keys = rotate(query, keys, cos, sin)
    attended = attend(attn, query, keys, values).reshape(*normed.shape[:-1], -1)
    hidden = residual + attn.o_proj(attended)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def attend_steps(cache: RowsCache):
    """Attention of one-token steps, one sdpa call a session over its cache as it lies (the call of its own step:
    a one-token step after its cache sees every key, no mask); the new keys and values written by `cache`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(attn, query, keys, values):
        held = cache.write(keys, values, attn.layer_idx)
        bounds = cache.bounds
        return torch.cat(
            [
                sdpa_attention_forward(
                    attn, query[start:stop], key[..., :length, :], value[..., :length, :], None, dropout=0.0,
                    scaling=attn.scaling,
                )[0]
                for (key, value, length), start, stop in zip(held, bounds, bounds[1:], strict=False)
            ]
        )  # fmt: skip

    return attend


def attend_prompts(caches: list, shapes: list[tuple[int, int, int]]):
    """Attention of steps of any length, each (rows, seq, position) in `shapes` with its cache in `caches`, their
    tokens laid one after the other (each step's rows in turn): per step, its keys and values go to its cache
    (`update`), and its queries attend over the whole cache, causally among its new tokens (a mask from the
    position on; none for a one-token step or a first prompt, which sdpa runs causal)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(attn, query, keys, values):
        outputs, start = [], 0
        for cache, (rows, seq, position) in zip(caches, shapes, strict=True):
            stop = start + rows * seq
            query_, keys_, values_ = (_by_step(part[start:stop], rows, seq) for part in (query, keys, values))
            key, value = cache.update(keys_, values_, attn.layer_idx)
            mask = None
            if seq > 1 and position > 0:
                device = query.device
                allowed = torch.arange(position + seq, device=device)[None, :] <= (
                    position + torch.arange(seq, device=device)[:, None]
                )
                mask = allowed[None, None]  # (1, 1, seq, position + seq)
            output = sdpa_attention_forward(
                attn, query_, key, value, mask, dropout=0.0, scaling=attn.scaling, is_causal=seq > 1
            )[0]  # (rows, seq, heads, dim)
            outputs.append(output.reshape(rows * seq, 1, *output.shape[2:]))
            start = stop
        return torch.cat(outputs)

    return attend


def _by_step(part: torch.Tensor, rows: int, seq: int) -> torch.Tensor:
    """A step's tokens (rows * seq, heads, 1, dim), laid row after row, as (rows, heads, seq, dim)."""
    return part.reshape(rows, seq, part.shape[1], part.shape[-1]).transpose(1, 2)


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i].copy_(sources[i]) for every i, as one fused operation where torch has it."""
    if len(targets) > 1 and hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(targets, sources)
    else:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)


def _padded(parts: list[torch.Tensor], longest: int) -> torch.Tensor:
    """Each part's first `longest` rows (dim -2), zero-padded where a part has fewer, concatenated on dim 0."""
    return torch.cat(
        [
            part[..., :longest, :] if part.shape[-2] >= longest
            else nn.functional.pad(part, (0, 0, 0, longest - part.shape[-2]))
            for part in parts
        ]
    )  # fmt: skip


__all__ = ["RowsCache", "attend_prompts", "attend_steps", "layer_per_session", "without_cudnn_attention"]
