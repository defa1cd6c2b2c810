"""Measured forward and inference throughput of a node's span, cached per model, span, device and dtype."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FORWARD_SHAPE = (1, 128)  # (batch, tokens) of the forward measurement
INFERENCE_STEPS = 16  # one-token steps timed for the inference measurement


def default_cache_path() -> Path:
    return Path.home() / ".cache" / "nesa-node" / "throughput.json"


@torch.inference_mode()
def measure(span) -> dict[str, float]:
    """Tokens/s of the span: forward (a 128-token chunk) and inference (one token at a time, with cache)."""
    hidden = torch.randn(*FORWARD_SHAPE, span.hidden_size, generator=torch.Generator().manual_seed(0))
    span(hidden)  # warm-up
    started = time.perf_counter()
    span(hidden)
    forward_tps = FORWARD_SHAPE[0] * FORWARD_SHAPE[1] / (time.perf_counter() - started)
    cache = span.new_cache()
    span(hidden[:, :1], cache, 0)
    started = time.perf_counter()
    for position in range(1, INFERENCE_STEPS + 1):
        span(hidden[:, :1], cache, position)
    inference_tps = INFERENCE_STEPS / (time.perf_counter() - started)
    return {"forward_tps": forward_tps, "inference_tps": inference_tps}


def cached_measure(span, cache_path: Path | None = None) -> dict[str, float]:
    """Measure once per (weights, span, device, dtype); later starts read the cached figures."""
    path = cache_path or default_cache_path()
    key = f"{span.weights_hash}:{span.start}:{span.end}:{span.spec.device}:{span.spec.dtype}"
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
