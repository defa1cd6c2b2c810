"""Malicious-node modes for tests and benchmarks: an in-process node that keeps announcing its honest record (same
span, same weights and source hashes) while it computes something else. Verification (sampled audits, majority
votes) is measured against these.

| mode | what the node does |
| --- | --- |
| `perturbed` | the weights of one block's linear layers carry Gaussian noise of 1% of each weight matrix's RMS |
| `nf4_as_announced` | serves its linear layers quantized to nf4 (bitsandbytes) while announcing unquantized weights |
| `skip_block` | one block of its span (not the first) is skipped: its input passes through unchanged |
| `wrong_adapter` | runs another LoRA adapter (or the base weights) than the session asked for |
| `noisy` | adds Gaussian noise (scale times each token's RMS) to its output on a fraction `rate` of its steps |
| `lazy` | returns its input: no block runs (its caches still fill, so it keeps up appearances) |

`make_malicious(node, mode, ...)` changes a started node of this process (tests/support/swarm.py's LocalSwarm)
in place and returns a `Misbehaviour` that counts the steps it tampered with. Nothing here is imported by the node
itself: a node process never runs these modes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import nn

MODES = ("perturbed", "nf4_as_announced", "skip_block", "wrong_adapter", "noisy", "lazy")


@dataclass
class Misbehaviour:
    """What `make_malicious` did to a node: its mode, the block it touched (when one), and the steps it tampered
    with so far (every step for the weight modes; the noisy steps for `noisy`)."""

    mode: str
    block: int | None = None
    tampered_steps: int = 0
    steps: int = 0
    notes: dict = field(default_factory=dict)


class _PassThrough(nn.Module):
    """A decoder block that does nothing: its input is its output."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def make_malicious(
    node,
    mode: str,
    *,
    block: int | None = None,
    rate: float = 0.01,
    scale: float = 0.1,
    seed: int = 0,
    other_adapter=None,
) -> Misbehaviour:
    """Make the started, in-process `node` cheat in `mode` (see the module docstring). `block`: the absolute block a
    weight mode touches (default: the span's last). `rate` and `scale`: the `noisy` mode's fraction of steps and
    noise scale. `other_adapter`: the AdapterSlice the `wrong_adapter` mode runs instead (default: none, the base
    weights). The node's record is not changed: it goes on announcing what an honest node would.
    Raises ValueError for an unknown mode, or a block outside the span (`skip_block` needs a span of two blocks
    or more: the first block's cache decides the attention mask)."""
    if mode not in MODES:
        raise ValueError(f"unknown malicious mode {mode!r}; one of {', '.join(MODES)}")
    span = node.compute.span
    chosen = span.end - 1 if block is None else block
    if not span.start <= chosen < span.end:
        raise ValueError(f"block {chosen} is outside the node's span {span.start}:{span.end}")
    local = chosen - span.start
    misbehaviour = Misbehaviour(mode)
    generator = torch.Generator().manual_seed(seed)
    if mode == "perturbed":
        misbehaviour.block = chosen
        with torch.no_grad():
            for linear in (module for module in span.layers[local].modules() if isinstance(module, nn.Linear)):
                weight = linear.weight
                rms = weight.float().pow(2).mean().sqrt()
                noise = torch.randn(weight.shape, generator=generator).to(weight.device)
                weight.add_((0.01 * rms * noise).to(weight.dtype))
    elif mode == "nf4_as_announced":
        from nesa_node.compression.weights import quantize_linear_layers

        for layer in span.layers:
            quantize_linear_layers(layer, "nf4", device=span.spec.device, dtype=span.dtype_)
    elif mode == "skip_block":
        if local == 0:
            raise ValueError("skip_block skips a block after the span's first (that one's cache sets the mask)")
        misbehaviour.block = chosen
        span.layers[local] = _PassThrough()
    elif mode == "wrong_adapter":
        _swap_adapters(node.compute, other_adapter, misbehaviour)
    else:
        _tamper_outputs(span, mode, misbehaviour, random.Random(seed), rate, scale, generator)
    return misbehaviour


def _swap_adapters(compute, other_adapter, misbehaviour: Misbehaviour) -> None:
    """The node's compute runs `other_adapter` wherever a step asks for an adapter."""
    run, run_decode = compute.run, compute.run_decode

    def swap(adapter):
        if adapter is other_adapter:  # swapped already (a decode step that run_decode hands to run), or base
            return adapter
        misbehaviour.steps += 1
        if adapter is not None:
            misbehaviour.tampered_steps += 1
            return other_adapter
        return None

    async def run_swapped(hidden, cache, position, blocks, adapter=None):
        return await run(hidden, cache, position, blocks, swap(adapter))

    async def run_decode_swapped(hidden, cache, position, blocks, adapter=None, *, member=None):
        return await run_decode(hidden, cache, position, blocks, swap(adapter), member=member)

    compute.run, compute.run_decode = run_swapped, run_decode_swapped


def _tamper_outputs(span, mode, misbehaviour, draw: random.Random, rate, scale, generator) -> None:
    """Wrap the span's one-session and batched passes so their outputs are the input (`lazy`) or carry noise on a
    fraction `rate` of the steps (`noisy`)."""
    forward, run_batch = span.forward, span.run_batch

    def tamper(given: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        misbehaviour.steps += 1
        if mode == "lazy":
            misbehaviour.tampered_steps += 1
            return given.to(output.device, output.dtype)
        if draw.random() >= rate:
            return output
        misbehaviour.tampered_steps += 1
        rms = output.float().pow(2).mean(dim=-1, keepdim=True).sqrt()  # (batch, seq, 1)
        noise = torch.randn(output.shape, generator=generator).to(output.device)
        return (output.float() + scale * rms * noise).to(output.dtype)

    def tampered_forward(hidden, cache=None, position=0, blocks=None):
        return tamper(hidden, forward(hidden, cache, position, blocks))

    def tampered_run_batch(steps, blocks):
        outputs = run_batch(steps, blocks)
        return [tamper(step[0], output) for step, output in zip(steps, outputs, strict=True)]

    span.forward, span.run_batch = tampered_forward, tampered_run_batch


__all__ = ["MODES", "Misbehaviour", "make_malicious"]
