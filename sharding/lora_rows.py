"""LoRA adapters applied per row: several adapter slices (sharding/lora.py) in one step of a node's span.

Each targeted projection computes what peft's `lora.Linear` computes (plain LoRA, no variant), Nesa paper eq. 6:

    y = base(x) + scale * B (A x)      A (r, in_features), B (out_features, r)

The low-rank term runs in float32 and is added to the base output in float32, then cast back to the span's dtype, as
peft does with its default `autocast_adapter_dtype=True`. The base projection is never touched, so a quantized one
(bitsandbytes int8 or nf4, sharding/blocks.py `--quant`) keeps running its own kernel and the term is added to its
output (QLoRA's arrangement).

- `with adapters_for_rows(span, rows, blocks=(first, end)):` around `span(hidden, ...)` or
  `span.decode_batch(...)`: `rows` holds one AdapterSlice or None per row of the hidden states the span runs, in
  order (for decode_batch, the rows of its steps concatenated). Rows with an adapter get it; rows with None run the
  base weights, bit for bit. Several adapters live at once (nothing global is switched, unlike peft's
  `set_adapter`); the rows of one adapter are grouped, so each targeted projection adds one low-rank product per
  adapter present in the batch (Punica's and S-LoRA's arrangement, without their fused kernels). The setting is a
  contextvars.ContextVar: enter the `with` in the thread that runs the span (inside the function handed to the
  compute executor, which does not copy the caller's context). When every row is None nothing is set and the span
  runs as it does without LoRA.
- `enable_lora(span)` installs one forward hook on each q/k/v/o/gate/up/down projection of the span (done on first
  use by adapters_for_rows); with no adapter set a hook returns at once and leaves the output as it is.
  `disable_lora(span)` removes them.

sharding/lora.py re-exports these three names. This module imports sharding/lora.py only inside functions: lora.py
imports this one at its top, so either may be imported first.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import nn

from nesa_node.errors import AdapterError

if TYPE_CHECKING:
    from nesa_node.sharding.lora import AdapterSlice, Target


class _SpanHooks:
    """The hooks installed on one span's projections, and the slices already checked against its shapes."""

    def __init__(self) -> None:
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.checked: weakref.WeakSet[AdapterSlice] = weakref.WeakSet()


class _RowPlan:
    """Which rows get which adapter in one `adapters_for_rows`: groups of (factors on the span's device, row index
    (None: every row)); `rows` None: any number of rows (trainable_adapter)."""

    def __init__(self, rows: int | None, groups: list[tuple[dict, torch.Tensor | None]]):
        self.rows = rows
        self.groups = groups

    def apply(self, target: Target, inputs: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """output (rows, seq, out) of the base projection on inputs (rows, seq, in), plus each row's update."""
        if self.rows is not None and inputs.shape[0] != self.rows:
            raise ValueError(f"adapters_for_rows was given {self.rows} rows but the span runs {inputs.shape[0]}")
        result = output
        for factors, index in self.groups:
            factor = factors.get(target)
            if factor is None:
                continue
            lora_a, lora_b, scale = factor
            rows = inputs if index is None else inputs.index_select(0, index)  # (group rows, seq, in)
            # peft's order: lora_B(lora_A(x)) * scaling, then added to the base output, in float32
            update = nn.functional.linear(nn.functional.linear(rows.to(lora_a.dtype), lora_a), lora_b) * scale
            if index is None:
                result = (result.to(update.dtype) + update).to(output.dtype)
            else:
                updated = (result.index_select(0, index).to(update.dtype) + update).to(output.dtype)
                result = result.index_copy(0, index, updated)  # out of place: autograd and other rows untouched
        return result


_HOOKED: weakref.WeakKeyDictionary[nn.Module, _SpanHooks] = weakref.WeakKeyDictionary()
_HOOKED_LOCK = threading.Lock()
# {_SpanHooks: _RowPlan} of the adapters_for_rows blocks entered in this context (each thread has its own)
_ACTIVE: contextvars.ContextVar[Mapping[_SpanHooks, _RowPlan]] = contextvars.ContextVar(
    "nesa_lora_rows", default=MappingProxyType({})
)


def _add_lora(hooks: _SpanHooks, target: Target, module: nn.Module, args: tuple, output: torch.Tensor):
    plan = _ACTIVE.get().get(hooks)
    if plan is None:
        return None  # no adapter on this span here: the base output as it is
    return plan.apply(target, args[0], output)


def rows_active(span) -> bool:
    """Whether an `adapters_for_rows` block for `span` is entered in this context (its passes add LoRA updates)."""
    hooks = _HOOKED.get(span)
    return hooks is not None and hooks in _ACTIVE.get()


def enable_lora(span) -> None:
    """Hook the q/k/v/o/gate/up/down projections of every block of `span` (a BlockSpan) once; idempotent."""
    from nesa_node.sharding.lora import PROJECTIONS  # not at the top: lora.py imports this module (docstring)

    with _HOOKED_LOCK:
        if span in _HOOKED:
            return
        hooks = _SpanHooks()
        for local, layer in enumerate(span.layers):
            for projection in PROJECTIONS:
                module = layer.get_submodule(projection)
                hook = functools.partial(_add_lora, hooks, (span.start + local, projection))
                hooks.handles.append(module.register_forward_hook(hook))
        _HOOKED[span] = hooks


def disable_lora(span) -> None:
    """Remove the hooks `enable_lora` installed on `span` (nothing when it has none)."""
    with _HOOKED_LOCK:
        hooks = _HOOKED.pop(span, None)
    for handle in hooks.handles if hooks is not None else ():
        handle.remove()


@contextlib.contextmanager
def adapters_for_rows(
    span, rows: Sequence[AdapterSlice | None], *, blocks: tuple[int, int] | None = None
) -> Iterator[None]:
    """Within the block, row i of what `span` runs gets adapter rows[i] (None: the base weights), in this thread.

    `blocks` (first, end) are the blocks the step runs (default the whole span); every adapter must cover them.
    Raises AdapterError for a slice that does not cover them or does not fit the span's projections; the span
    raises ValueError when it runs a number of rows other than len(rows)."""
    if all(row is None for row in rows):
        yield  # nothing to add: the base path, untouched
        return
    enable_lora(span)
    hooks = _HOOKED[span]
    first, end = blocks if blocks is not None else (span.start, span.end)
    device = torch.device(span.spec.device)
    by_slice: dict[AdapterSlice, list[int]] = {}
    for index, row in enumerate(rows):
        if row is not None:
            by_slice.setdefault(row, []).append(index)
    groups = []
    for adapter, indices in by_slice.items():
        _check_fits(adapter, span, hooks, first, end)
        index = None if len(indices) == len(rows) else torch.tensor(indices, device=device)
        groups.append((adapter.device_factors(device), index))
    active = dict(_ACTIVE.get())
    active[hooks] = _RowPlan(len(rows), groups)
    token = _ACTIVE.set(MappingProxyType(active))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def trainable_adapter(span, factors: Mapping[Target, tuple[torch.Tensor, torch.Tensor, float]]) -> Iterator[None]:
    """Within the block, every row of what `span` runs gets the LoRA `factors` ({target: (A, B, scale)}, tensors on
    the span's device, float32, typically parameters that require grad): the training path (sharding/lora_train.py).
    The update is the same as `adapters_for_rows` adds, so autograd reaches A and B through it. The caller checks the
    shapes (TrainableSlice does, once) and enters this in the thread that runs the span."""
    enable_lora(span)
    hooks = _HOOKED[span]
    active = dict(_ACTIVE.get())
    active[hooks] = _RowPlan(None, [(dict(factors), None)])  # every row, whatever their number
    token = _ACTIVE.set(MappingProxyType(active))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _check_fits(adapter: AdapterSlice, span, hooks: _SpanHooks, first: int, end: int) -> None:
    if not adapter.start <= first < end <= adapter.end:
        raise AdapterError(
            f"adapter slice {adapter.sha256[:16]} holds blocks {adapter.start}:{adapter.end}, not the {first}:{end} "
            "this step runs; load the slice of this node's span"
        )
    if adapter in hooks.checked:
        return
    for (block, projection), factor in adapter.factors.items():
        if not span.start <= block < span.end:
            continue
        module = span.layers[block - span.start].get_submodule(projection)
        if factor.lora_a.shape[1] != module.in_features or factor.lora_b.shape[0] != module.out_features:
            raise AdapterError(
                f"adapter slice {adapter.sha256[:16]} does not fit this model: block {block} {projection} is "
                f"{module.in_features} -> {module.out_features} features, its factors are A {tuple(factor.lora_a.shape)}"
                f" and B {tuple(factor.lora_b.shape)}"
            )
    hooks.checked.add(adapter)


__all__ = ["adapters_for_rows", "disable_lora", "enable_lora", "rows_active", "trainable_adapter"]
