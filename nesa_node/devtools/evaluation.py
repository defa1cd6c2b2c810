"""Accuracy of the swarm under lossy settings: hidden-state codecs and weight quantization, measured.

Used by the compression tests and `bench/compression.py`. Two measures, both against a reference run:
- greedy top-1 agreement: the reference's greedy continuation of each prompt is fed back token by token through an
  inference session (the decode path, one token per step); a position agrees when the argmax of the logits equals
  the reference's next token. Teacher forcing keeps every position comparable after a first disagreement.
- held-out perplexity: cacheless forward passes over held-out windows, relative to the reference's.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AccuracyRow:
    label: str  # codec or quantization compared with the reference
    agreement: float  # fraction of teacher-forced decode positions whose top-1 token equals the reference's
    perplexity: float  # held-out perplexity through the swarm
    perplexity_ratio: float  # perplexity / the reference's perplexity
    bytes_per_token: float  # serialized bytes the client sent and received per decode step of one token

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "agreement": round(self.agreement, 4),
            "perplexity": round(self.perplexity, 3),
            "perplexity_ratio": round(self.perplexity_ratio, 4),
            "bytes_per_token": round(self.bytes_per_token, 1),
        }


@torch.inference_mode()
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int) -> list[torch.Tensor]:
    """Greedy continuation (new_tokens,) of each prompt row of `prompts` (count, length)."""
    continuations = []
    for row in prompts:
        output = model.generate(row[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        continuations.append(output[0, row.shape[0] :].clone())
    return continuations


@torch.inference_mode()
def teacher_forced_agreement(model, prompts: torch.Tensor, continuations: list[torch.Tensor]) -> tuple[float, float]:
    """(top-1 agreement with `continuations`, median bytes per decode step) through inference sessions."""
    agree = total = 0
    step_bytes: list[int] = []
    for row, continuation in zip(prompts, continuations, strict=True):
        ids = row[None]  # (1, length)
        with model.inference_session(max_length=ids.shape[1] + continuation.shape[0]) as session:
            for index in range(continuation.shape[0]):
                logits = model(ids).logits[0, -1]  # (vocab,)
                agree += int(int(logits.argmax()) == int(continuation[index]))
                total += 1
                ids = torch.cat([ids, continuation[index].view(1, 1)], dim=1)
            step_bytes += [timing.bytes_sent + timing.bytes_received for timing in session.timings[1:]]
    return agree / max(total, 1), float(statistics.median(step_bytes)) if step_bytes else 0.0


def accuracy_row(
    label: str,
    model,
    prompts: torch.Tensor,
    continuations: list[torch.Tensor],
    windows: torch.Tensor,
    reference_perplexity: float | None,
) -> AccuracyRow:
    """Measure `model` (a DistributedModelForCausalLM) against reference continuations and perplexity."""
    from nesa_node.devtools.tiny_train import evaluate_perplexity

    agreement, bytes_per_token = teacher_forced_agreement(model, prompts, continuations)
    perplexity = evaluate_perplexity(model, windows).perplexity
    reference = reference_perplexity if reference_perplexity is not None else perplexity
    row = AccuracyRow(label, agreement, perplexity, perplexity / reference, bytes_per_token)
    logger.info("%s", row)
    return row


def accuracy_table(
    configurations: Iterable[tuple[str, Callable[[], AbstractContextManager]]],
    prompts: torch.Tensor,
    windows: torch.Tensor,
    new_tokens: int,
    *,
    ready: Callable[[object], None] = lambda model: None,
) -> list[AccuracyRow]:
    """One row per (label, open_model) configuration; the first is the reference (its greedy continuations and
    perplexity). `open_model()` gives a context manager of a DistributedModelForCausalLM; `ready(model)` waits
    until the model's swarm can serve it."""
    rows: list[AccuracyRow] = []
    continuations, reference = None, None
    for label, open_model in configurations:
        with open_model() as model:
            ready(model)
            if continuations is None:
                continuations = greedy_continuations(model, prompts, new_tokens)
            row = accuracy_row(label, model, prompts, continuations, windows, reference)
        reference = reference if reference is not None else row.perplexity
        rows.append(row)
    return rows


def format_table(rows: list[AccuracyRow], first_column: str = "codec") -> str:
    """The rows as a plain-text table (like Table 1 of the Nesa paper, measured)."""
    lines = [f"{first_column:<12} {'agreement':>10} {'perplexity':>11} {'vs ref':>8} {'bytes/token':>12}"]
    for row in rows:
        lines.append(
            f"{row.label:<12} {row.agreement:>10.2%} {row.perplexity:>11.3f} {row.perplexity_ratio:>8.4f} "
            f"{row.bytes_per_token:>12.0f}"
        )
    return "\n".join(lines)
