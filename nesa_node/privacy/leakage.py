"""The leakage meter: what a swarm node can learn from the hidden states a client with private edges sends it.

Setting (client/private_edges.py): the client runs the embeddings, blocks [0, a), blocks [L-b, L), the final norm
and the LM head; the swarm serves blocks [a, L-b). What leaves the client after block a may carry Gaussian noise of
relative `sigma` (privacy/noise.py). The adversary is any node of the chain, and it holds the public weights: the
same checkpoint the client runs, embeddings and edge blocks included. Three measurements, all over one forward pass
of the client's tokens (the prefill, which is what a node sees of a prompt):

- First-node inversion. The first node receives h = blocks[0:a](embed(tokens)) + noise. The adversary decodes it
  left to right: at position i, with its own recovered prefix in a KV cache, it runs every vocabulary token through
  blocks[0:a] and keeps the one whose output at i is nearest to the received vector. With a = 0 this is nearest
  neighbour search over the embedding matrix. Reported: the fraction of tokens recovered exactly. A stronger
  adversary (a language-model prior over the candidates, beam search) can only do better, so the number is a lower
  bound on what leaks.
- Last-node logit lens. The last node sends h' = blocks[a:L-b](h), the state before the client's back blocks. The
  adversary applies the public final norm and LM head to h' and takes the argmax per position. Reported: how often
  that equals the client's own next-token prediction (the output leak) and the actual next token of the text.
- Perplexity cost. The client's perplexity on the text when the noise is added after block a, over its perplexity
  with no noise at the same edges; sigma 0 gives exactly the noiseless pass.

Everything here is a pure function of the weights, the token ids and an explicit seed: rows are deterministic and
each row's noise is drawn from a generator seeded by `seed` alone, so a row does not depend on the grid around it
(and every sigma scales the same standard-normal draw, which keeps a noise curve free of draw-to-draw jitter).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as functional

from nesa_node.privacy.noise import add_boundary_noise, check_sigma
from nesa_node.sharding.blocks import BlockSpan, SpanSpec, load_block_span, load_config
from nesa_node.sharding.client_edges import ClientEdges, load_client_edges

Metric = Literal["l2", "cosine"]
# Squared L2 recovered as many tokens as cosine distance or more in 9 of 12 noisy settings of the trained tiny model
# (edges 0,0 1,0 2,1 x sigma 2 3 5 10, 8 x 32 tokens; e.g. sigma 3, edges 1,0: 24% against 17%; measured with
# `privacy-check --metric`); both recover every token at sigma 0. L2 is the maximum-likelihood match for Gaussian
# noise of one scale per token.
DEFAULT_METRIC: Metric = "l2"
# Candidate tokens run through the front blocks at once: bounds the repeated KV cache (rows x prefix x kv width);
# 512 rows keep it under ~50 MB for the trained tiny model at 64 tokens (guess; speed is flat from 256 to 2048).
CANDIDATE_CHUNK = 512


@dataclass(frozen=True)
class EdgeSetting:
    front: int  # blocks [0, front) run on the client
    back: int  # blocks [L - back, L) run on the client

    def __str__(self) -> str:
        return f"{self.front},{self.back}"


def check_edges(front: int, back: int, num_layers: int) -> EdgeSetting:
    """The setting (front, back); ValueError unless both are >= 0 and front + back < num_layers (the swarm serves at
    least one block, as client/private_edges.py requires)."""
    if front < 0 or back < 0:
        raise ValueError(f"edges must be >= 0, got {front},{back}")
    if front + back >= num_layers:
        raise ValueError(
            f"edges {front},{back} leave none of the model's {num_layers} blocks to the swarm: need a + b < {num_layers}"
        )
    return EdgeSetting(front, back)


class LeakageModel:
    """The whole model as the adversary holds it: every block in one span, the embeddings, final norm and LM head.

    `run(hidden, first, end)` runs blocks [first, end) (hidden itself when first == end)."""

    def __init__(self, span: BlockSpan, edges: ClientEdges):
        self.span = span
        self.edges = edges
        self.num_layers = span.end - span.start
        self.vocab_size = edges.embed_tokens.weight.shape[0]
        self.device = span.spec.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.edges.embed_tokens(ids.to(self.device))  # (batch, seq, hidden)

    def run(self, hidden: torch.Tensor, first: int, end: int, cache=None, position: int = 0) -> torch.Tensor:
        if first == end:
            return hidden
        return self.span(hidden, cache, position, blocks=(first, end))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.edges.lm_head(self.edges.norm(hidden)).float()  # (batch, seq, vocab)


def load_leakage_model(model_path: str | Path, *, device: str = "cpu") -> LeakageModel:
    """Every block of the Hugging Face folder `model_path` in float32, with the client's edges, on `device`.
    Raises ModelLoadError (and its subclasses) for a folder the project's loaders cannot read."""
    config = load_config(model_path)
    span = load_block_span(model_path, SpanSpec(0, config.num_hidden_layers, "float32", device), config=config)
    edges = load_client_edges(model_path, dtype="float32", device=device, config=config)
    return LeakageModel(span, edges)


@dataclass(frozen=True)
class PassStates:
    received: torch.Tensor  # (batch, seq, hidden): what the first node receives (after block a, noise added)
    sent_back: torch.Tensor  # (batch, seq, hidden): what the last node sends (after block L-b)
    logits: torch.Tensor  # (batch, seq, vocab) float32: the client's output


def client_pass(
    model: LeakageModel, ids: torch.Tensor, setting: EdgeSetting, sigma: float, generator: torch.Generator | None
) -> PassStates:
    """One forward pass of `ids` (batch, seq) with the noise added after block `setting.front`, keeping the states
    that cross the client's boundaries."""
    split = model.num_layers - setting.back
    with torch.inference_mode():
        front = model.run(model.embed(ids), 0, setting.front)
        received = add_boundary_noise(front, sigma, generator)
        sent_back = model.run(received, setting.front, split)
        logits = model.logits(model.run(sent_back, split, model.num_layers))
    return PassStates(received=received, sent_back=sent_back, logits=logits)


def _distances(outputs: torch.Tensor, targets: torch.Tensor, metric: Metric) -> torch.Tensor:
    """(..., candidates) distance of each of `outputs` (candidates, hidden) to each of `targets` (..., hidden)."""
    if metric == "cosine":
        return 1.0 - functional.normalize(targets, dim=-1) @ functional.normalize(outputs, dim=-1).T
    if metric == "l2":
        # |t|^2 is the same for every candidate; |o|^2 - 2 t.o ranks them as the squared distance does
        return outputs.pow(2).sum(-1) - 2.0 * targets @ outputs.T
    raise ValueError(f"metric must be l2 or cosine, got {metric!r}")


def invert_first_node(
    model: LeakageModel,
    received: torch.Tensor,
    front: int,
    *,
    metric: Metric = DEFAULT_METRIC,
    chunk: int = CANDIDATE_CHUNK,
) -> torch.Tensor:
    """The adversary's guess (batch, seq) of the tokens behind `received` (batch, seq, hidden), the output of blocks
    [0, front) (plus noise), decoded left to right by nearest match over the whole vocabulary (module docstring)."""
    with torch.inference_mode():
        table = model.edges.embed_tokens.weight  # (vocab, hidden)
        received = received.to(table.device, torch.float32)
        if front == 0:
            return _distances(table, received, metric).argmin(dim=-1)  # (batch, seq)
        return torch.stack([_invert_sequence(model, target, front, metric, chunk) for target in received])


def _invert_sequence(model: LeakageModel, target: torch.Tensor, front: int, metric: Metric, chunk: int):
    """Greedy left-to-right inversion of one sequence `target` (seq, hidden) through blocks [0, front)."""
    table = model.edges.embed_tokens.weight  # (vocab, hidden)
    prefix = model.span.new_cache()  # the recovered prefix's keys and values in blocks [0, front)
    recovered: list[int] = []
    for position in range(target.shape[0]):
        best_distance, best_token = math.inf, 0
        for start in range(0, model.vocab_size, chunk):
            candidates = table[start : start + chunk, None, :]  # (rows, 1, hidden): each token at this position
            cache = None
            if position:
                cache = copy.deepcopy(prefix)
                cache.batch_repeat_interleave(candidates.shape[0])
            outputs = model.run(candidates, 0, front, cache, position)[:, 0].float()  # (rows, hidden)
            distances = _distances(outputs, target[position], metric)  # (rows,)
            index = int(distances.argmin())
            if float(distances[index]) < best_distance:  # strict: ties keep the lowest token id, as argmin does
                best_distance, best_token = float(distances[index]), start + index
        recovered.append(best_token)
        model.run(table[best_token][None, None, :], 0, front, prefix, position)  # the guess joins the prefix
    return torch.tensor(recovered, dtype=torch.long, device=target.device)  # (seq,)


def logit_lens(model: LeakageModel, sent_back: torch.Tensor) -> torch.Tensor:
    """The last node's guess (batch, seq) of the next tokens: the public final norm and LM head over `sent_back`."""
    with torch.inference_mode():
        return model.logits(sent_back).argmax(dim=-1)


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp of the mean next-token negative log-likelihood (nats) of `ids` (batch, seq) under `logits` (batch, seq,
    vocab); seq - 1 predictions per row."""
    targets = ids[:, 1:].to(logits.device)  # (batch, seq - 1)
    nll = functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten())
    return math.exp(float(nll))


@dataclass(frozen=True)
class LeakageRow:
    front: int  # client blocks [0, front)
    back: int  # client blocks [L - back, L)
    sigma: float  # boundary noise, relative to each token's RMS
    tokens: int  # input tokens the first node saw
    recovery: float  # fraction of them the first node recovered exactly, 0..1
    lens_output: float  # fraction of positions where the last node's logit lens equals the client's prediction
    lens_next: float  # fraction of positions (all but the last) where it equals the actual next token
    model_next: float  # the same for the client's own prediction: the lens_next a perfect lens would reach
    perplexity: float  # client's perplexity with the noise, per token
    perplexity_ratio: float  # over the perplexity without noise at the same edges (1.0 at sigma 0)


def measure(
    model: LeakageModel,
    ids: torch.Tensor,
    setting: EdgeSetting,
    sigma: float,
    *,
    seed: int = 0,
    metric: Metric = DEFAULT_METRIC,
    baseline_perplexity: float | None = None,
) -> LeakageRow:
    """One row: the three measurements of the module docstring for `ids` (batch, seq) at `setting` and `sigma`.

    The noise comes from a generator seeded with `seed`. `baseline_perplexity` is the noiseless perplexity at the same
    edges (computed when not given). Raises ValueError for a negative sigma or edges the model cannot split at."""
    sigma = check_sigma(sigma)
    check_edges(setting.front, setting.back, model.num_layers)
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"token ids must be (batch, seq) with seq >= 2, got shape {tuple(ids.shape)}")
    generator = torch.Generator().manual_seed(seed)
    states = client_pass(model, ids, setting, sigma, generator)
    ids = ids.to(states.logits.device)
    guessed = invert_first_node(model, states.received, setting.front, metric=metric)  # (batch, seq)
    lens = logit_lens(model, states.sent_back)  # (batch, seq)
    prediction = states.logits.argmax(dim=-1)  # (batch, seq)
    noisy = perplexity(states.logits, ids)
    if baseline_perplexity is None:
        baseline_perplexity = (
            noisy if sigma == 0 else perplexity(client_pass(model, ids, setting, 0.0, None).logits, ids)
        )
    return LeakageRow(
        front=setting.front,
        back=setting.back,
        sigma=sigma,
        tokens=ids.numel(),
        recovery=_fraction(guessed == ids),
        lens_output=_fraction(lens == prediction),
        lens_next=_fraction(lens[:, :-1] == ids[:, 1:]),
        model_next=_fraction(prediction[:, :-1] == ids[:, 1:]),
        perplexity=noisy,
        perplexity_ratio=noisy / baseline_perplexity,
    )


def _fraction(matches: torch.Tensor) -> float:
    return float(matches.float().mean())


def leakage_grid(
    model: LeakageModel,
    ids: torch.Tensor,
    settings: Iterable[EdgeSetting],
    sigmas: Sequence[float],
    *,
    seed: int = 0,
    metric: Metric = DEFAULT_METRIC,
    progress: Callable[[LeakageRow, int, int], None] | None = None,
) -> list[LeakageRow]:
    """A row per (setting, sigma), settings outermost, each as `measure` computes it alone (same seed, same rows).
    `progress(row, done, total)` is called after each row."""
    settings = [check_edges(setting.front, setting.back, model.num_layers) for setting in settings]
    sigmas = [check_sigma(sigma) for sigma in sigmas]
    total, rows = len(settings) * len(sigmas), []
    for setting in settings:
        baseline = perplexity(client_pass(model, ids, setting, 0.0, None).logits, ids)
        for sigma in sigmas:
            rows.append(measure(model, ids, setting, sigma, seed=seed, metric=metric, baseline_perplexity=baseline))
            if progress is not None:
                progress(rows[-1], len(rows), total)
    return rows


__all__ = [
    "DEFAULT_METRIC",
    "EdgeSetting",
    "LeakageModel",
    "LeakageRow",
    "PassStates",
    "check_edges",
    "client_pass",
    "invert_first_node",
    "leakage_grid",
    "load_leakage_model",
    "logit_lens",
    "measure",
    "perplexity",
]
