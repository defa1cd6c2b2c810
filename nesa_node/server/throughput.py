"""Measured forward and inference throughput of a node's span, cached per model, span, device and dtype."""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FORWARD_SHAPE = (1, 128)  # (batch, tokens) of the forward measurement
WARM_STEPS = 4  # one-token steps run before any timing: the first calls of each shape are slow (allocation, kernels)
ROUNDS = 5  # timed rounds; the median is announced, so one stall (GC, another process) does not set the figure
INFERENCE_STEPS = 8  # one-token steps per timed round
MEASUREMENT_VERSION = 3  # part of the cache key: figures taken by an older method are measured again


def default_cache_path() -> Path:
    return Path.home() / ".cache" / "nesa-node" / "throughput.json"


def synchronize(span) -> None:
    """Wait for the work this thread queued on the device, so a timing covers the computation and not only its
    launch. The calling thread's current stream, not the whole device: a device-wide wait would also wait on (and,
    on CUDA, fail against) a graph capture underway on another stream of the process."""
    if str(span.spec.device).startswith("cuda"):
        torch.cuda.current_stream(span.spec.device).synchronize()


def _timed(span, run) -> float:
    synchronize(span)
    started = time.perf_counter()
    run()
    synchronize(span)
    return time.perf_counter() - started


@torch.inference_mode()
def measure(span) -> dict[str, float]:
    """Tokens/s of the span, warm and synchronized: forward (a 128-token chunk) and inference (one token at a
    time, with cache), each the median of ROUNDS rounds after warm-up; and `block_ms`, the inference step's time
    per block without the per-call part (rotary embedding, mask, hand-offs: the same for any span), which makes
    spans of different lengths comparable (a one-block span cannot tell the two apart: its whole step)."""
    hidden = torch.randn(*FORWARD_SHAPE, span.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(span.spec.device)
    span(hidden)  # warm-up
    forward_s = statistics.median(_timed(span, lambda: span(hidden)) for _ in range(ROUNDS))
    token = hidden[:, :1]
    blocks = span.end - span.start
    step_s = _step_s(span, token, span.new_cache(), (span.start, span.end))
    block_s = step_s
    if blocks > 1:  # the difference to a one-block step is what the other blocks cost, without the per-call part
        one_s = _step_s(span, token, span.new_cache(), (span.start, span.start + 1))
        block_s = max(step_s - one_s, step_s / 10) / (blocks - 1)
    return {
        "forward_tps": FORWARD_SHAPE[0] * FORWARD_SHAPE[1] / forward_s,
        "inference_tps": 1.0 / step_s,
        "block_ms": block_s * 1000.0,
    }


def _step_s(span, token: torch.Tensor, cache, blocks: tuple[int, int]) -> float:
    """Seconds of one one-token step through `blocks` with `cache`: the median of ROUNDS rounds after warm-up."""
    position = 0

    def steps(count: int) -> None:
        nonlocal position
        for _ in range(count):
            span.step(token, cache, position, blocks)
            position += 1

    steps(WARM_STEPS)
    return statistics.median(_timed(span, lambda: steps(INFERENCE_STEPS)) for _ in range(ROUNDS)) / INFERENCE_STEPS


GPU_WARMUP_TOKENS = 512  # ComputeConfig.warmup_tokens on a GPU: a 16-token prompt and 128 new tokens fit many times


def warmup_tokens(configured: int | None, device: str) -> int:
    """Cache lengths a node runs through at start: `configured`, else GPU_WARMUP_TOKENS on a GPU and none on the
    CPU."""
    if configured is not None:
        return configured
    return GPU_WARMUP_TOKENS if str(device).startswith("cuda") else 0


# prompt lengths a node runs once at start after the one-token steps: a prompt's first pass on a GPU loads kernels
# no one-token step uses (matrix products over several rows, attention over a causal block), and each new length
# picks its own; these cover short chat prompts and the bench's 16 tokens (guess), each at most the warm-up length
WARMUP_PROMPTS = (2, 8, 16, 32, 64, 128)


@torch.inference_mode()
def warm_up(span, tokens: int) -> int:
    """Run one-token steps through the whole span from an empty cache until it holds `tokens` tokens (then drop it),
    so that the first session's steps at each cache length run warm; then one prompt of each WARMUP_PROMPTS length up
    to `tokens`, and, where the span batches decode steps, one pass of two sessions' steps (the kernels of several
    rows). The one-token steps run."""
    if tokens <= 0:
        return 0
    token = torch.randn(1, 1, span.hidden_size, generator=torch.Generator().manual_seed(0)).to(span.spec.device)
    cache = span.new_cache()
    for position in range(tokens):
        span.step(token, cache, position)
    for length in (length for length in WARMUP_PROMPTS if length <= tokens):
        span(token.expand(1, length, -1), span.new_cache(), 0)
    if span.batches_decode:
        caches = [span.new_cache() for _ in range(2)]
        for session in caches:
            span(token, session, 0)
        span.decode_batch([(token, session, 1) for session in caches], (span.start, span.end))
    synchronize(span)
    return tokens


def cached_measure(span, cache_path: Path | None = None) -> dict[str, float]:
    """Measure once per (weights, span, device, dtype); later starts read the cached figures."""
    path = cache_path or default_cache_path()
    key = f"v{MEASUREMENT_VERSION}:{span.weights_hash}:{span.start}:{span.end}:{span.spec.device}:{span.spec.dtype}"
    key += ":graphs" if span.decode_graphs else ""
    try:
        table = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        table = {}
    if key in table:
        return table[key]
    figures = measure(span)
    table[key] = figures
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1))
    except OSError as exc:
        logger.warning("could not cache throughput in %s: %s", path, exc)
    logger.info("measured throughput %s", figures)
    return figures
