"""A small *trained* Llama for honest accuracy numbers (random weights have unrealistic activations).

Corpus: the English help topics that ship with Python (`pydoc_data.topics`, about 465 KB). Topics are taken in
sorted-key order; every `HELDOUT_EVERY`-th one (index 0, 10, 20, ...) is held out. Topics repeat each other's
paragraphs (`if` and `else` are the same text, `compound` contains most statements), so any paragraph of a
held-out topic is also removed from the training topics: no held-out paragraph is ever trained on.

The byte-level BPE tokenizer is trained on the training split only. Training is deterministic for a given spec,
config and seed on one machine (same torch version and thread count): data windows come from an explicit
`torch.Generator`, weights are initialised under a forked global RNG, and deterministic algorithms are on.
Results are cached by a hash of everything that decides the weights, so tests and benchmarks train once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from nesa_node.devtools.tiny_model import TinyModelSpec, build_config, build_tokenizer

logger = logging.getLogger(__name__)

# Bump when the corpus split, tokenizer or training loop changes what a spec, config and seed produce.
TRAIN_CODE_VERSION = 1
HELDOUT_EVERY = 10  # every 10th topic by sorted key is held out: ~7% of the characters (measured, Python 3.11)
_REPORT_FILE = "nesa_train.json"

# Default size, ~1.3M parameters (half of them embeddings). Vocab 2048 over 1024: held-out 2.21 vs 2.27 bits per
# character at 300 steps (measured). Bigger models would not fit the 1-2 minute CPU budget, and the ~120k training
# tokens already overfit this one before 600 steps.
TRAINED_SPEC = TinyModelSpec(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=384, vocab=2048)


@dataclass(frozen=True)
class TrainConfig:
    # 400 steps x 16 x 128 tokens is ~7 passes over the ~120k training tokens; 106 s on one x86 core (measured,
    # 0.26 s/step). Held-out perplexity with the default spec (measured): 108 after 300 steps, 89 after 400, 98 after
    # 600 (train loss 2.4 there: overfitting); the unigram baseline is 477.
    steps: int = 400  # optimizer steps
    batch: int = 16  # sequences per step
    seq_len: int = 128  # tokens per sequence (and per held-out window)
    learning_rate: float = 3e-3  # peak AdamW rate; measured at 300 steps: 1.5e-3 and 6e-3 both did worse
    min_learning_rate_ratio: float = 0.1  # cosine floor as a fraction of the peak (Chinchilla-style)
    warmup_fraction: float = 0.05  # share of steps with linear warmup; guess
    weight_decay: float = 0.1  # on matrices only, not norms or biases (nanoGPT)
    beta2: float = 0.95  # AdamW second-moment decay (nanoGPT, LLaMA paper)
    grad_clip: float = 1.0  # max global gradient L2 norm (LLaMA paper)
    seed: int = 0  # weight init and data sampling


@dataclass(frozen=True)
class CorpusSplit:
    train_topics: tuple[str, ...]
    heldout_topics: tuple[str, ...]
    train_texts: tuple[str, ...]  # one per train topic, held-out paragraphs removed
    heldout_texts: tuple[str, ...]  # one per held-out topic, whole
    sha256: str  # of the raw topics, so a different Python's help text is noticed


@dataclass(frozen=True)
class HeldoutScore:
    nll: float  # mean negative log-likelihood, nats per predicted token
    perplexity: float  # exp(nll)
    tokens: int  # predicted tokens scored


@dataclass(frozen=True)
class TrainedModel:
    path: Path  # where the caller asked for the model, or the cache entry when no path was given
    cache_path: Path  # the cache entry
    report: dict  # contents of nesa_train.json
    from_cache: bool  # True when nothing was trained by this call


def _paragraphs(text: str) -> list[str]:
    return [part.strip() for part in text.split("\n\n") if part.strip()]


def corpus_split() -> CorpusSplit:
    """The train/held-out split of `pydoc_data.topics` described in the module docstring."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    heldout_keys = tuple(key for index, key in enumerate(keys) if index % HELDOUT_EVERY == 0)
    train_keys = tuple(key for key in keys if key not in heldout_keys)
    heldout_paragraphs = {paragraph for key in heldout_keys for paragraph in _paragraphs(topics[key])}
    train_texts = tuple(
        "\n\n".join(p for p in _paragraphs(topics[key]) if p not in heldout_paragraphs) for key in train_keys
    )
    digest = hashlib.sha256(json.dumps([[key, topics[key]] for key in keys]).encode()).hexdigest()
    return CorpusSplit(
        train_topics=train_keys,
        heldout_topics=heldout_keys,
        train_texts=train_texts,
        heldout_texts=tuple(topics[key].strip() for key in heldout_keys),
        sha256=digest,
    )


def heldout_texts() -> list[str]:
    """The held-out documents (whole help topics), in sorted-key order."""
    return list(corpus_split().heldout_texts)


def _token_stream(tokenizer, texts) -> list[int]:
    """Documents' token ids, each followed by the end-of-sequence token; no begin token is added."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        ids.append(tokenizer.eos_token_id)
    return ids


def heldout_token_windows(tokenizer, length: int, count: int | None = None):
    """Consecutive, non-overlapping windows of the held-out token stream: a LongTensor (count, length).

    The stream is the held-out documents in order, each followed by the end-of-sequence token. `count=None`
    gives every whole window. Raises ValueError when fewer than `count` windows fit.
    """
    import torch

    stream = torch.tensor(_token_stream(tokenizer, heldout_texts()), dtype=torch.long)
    available = len(stream) // length
    count = available if count is None else count
    if count > available:
        raise ValueError(f"held-out text has {available} windows of {length} tokens; asked for {count}")
    return stream[: count * length].view(count, length)  # (count, length)


def evaluate_perplexity(model, windows, *, batch: int = 16) -> HeldoutScore:
    """Mean next-token NLL (nats) and perplexity of `model` on `windows` (count, length), without gradients.

    Every window scores its `length - 1` next-token predictions; `model(ids)` may return logits or an object with
    `.logits`. The model is put in eval mode for the call and restored.
    """
    import torch
    import torch.nn.functional as functional

    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    total, tokens = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch):
                ids = windows[start : start + batch]  # (batch, length)
                output = model(ids)
                logits = getattr(output, "logits", output)[:, :-1].float()  # (batch, length - 1, vocab)
                targets = ids[:, 1:]  # (batch, length - 1)
                total += functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
                tokens += targets.numel()
    finally:
        if was_training:
            model.train()
    nll = total / max(tokens, 1)
    return HeldoutScore(nll=nll, perplexity=math.exp(nll), tokens=tokens)


def unigram_perplexity(train_ids: list[int], windows, vocab_size: int) -> HeldoutScore:
    """Baseline: add-one-smoothed unigram frequencies of the training tokens, scored like `evaluate_perplexity`."""
    import torch

    counts = torch.bincount(torch.tensor(train_ids), minlength=vocab_size).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    targets = windows[:, 1:].flatten()
    nll = -log_probs[targets].mean().item()
    return HeldoutScore(nll=nll, perplexity=math.exp(nll), tokens=targets.numel())


def learning_rate_factor(step: int, steps: int, warmup_fraction: float, floor: float) -> float:
    """Multiplier of the peak rate at `step` (0-based): linear warmup, then cosine decay down to `floor`."""
    warmup = max(1, round(steps * warmup_fraction))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def cache_key(spec: TinyModelSpec, config: TrainConfig) -> str:
    """Hash of everything that decides the trained weights (spec, config, corpus, code and torch versions)."""
    import torch

    identity = {
        "spec": dataclasses.asdict(spec),
        "train": dataclasses.asdict(config),
        "code": TRAIN_CODE_VERSION,
        "corpus": corpus_split().sha256,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "nesa-node" / "trained"


def _progress_bar(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tokens_per_second]:,.0f} tokens/s"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


def _train(directory: Path, spec: TinyModelSpec, config: TrainConfig, progress: bool) -> dict:
    """Train and write the model, tokenizer and report into `directory`; returns the report."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    split = corpus_split()
    tokenizer = build_tokenizer(spec.vocab, [line for text in split.train_texts for line in text.splitlines()])
    vocab_size = max(spec.vocab, len(tokenizer))
    train_ids = _token_stream(tokenizer, split.train_texts)
    stream = torch.tensor(train_ids, dtype=torch.long)
    windows = heldout_token_windows(tokenizer, config.seq_len)
    model_config = build_config(spec, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):  # weight init uses the global RNG; keep the caller's state
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=model_config.bos_token_id,
        eos_token_id=model_config.eos_token_id,
        pad_token_id=model_config.pad_token_id,
    )
    initial = evaluate_perplexity(model, windows)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        betas=(0.9, config.beta2),
    )
    generator = torch.Generator().manual_seed(config.seed)
    offsets = torch.arange(config.seq_len)
    losses: list[float] = []
    model.train()
    started = time.perf_counter()
    with _progress_bar(progress) as bar:
        task = bar.add_task("train", total=config.steps, loss=float("nan"), tokens_per_second=0.0)
        for step in range(config.steps):
            for group in optimizer.param_groups:
                group["lr"] = config.learning_rate * learning_rate_factor(
                    step, config.steps, config.warmup_fraction, config.min_learning_rate_ratio
                )
            starts = torch.randint(0, len(stream) - config.seq_len, (config.batch,), generator=generator)
            ids = stream[starts[:, None] + offsets]  # (batch, seq_len)
            logits = model(ids).logits[:, :-1]  # (batch, seq_len - 1, vocab)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            losses.append(loss.item())
            elapsed = time.perf_counter() - started
            rate = (step + 1) * config.batch * config.seq_len / elapsed
            bar.update(task, advance=1, loss=losses[-1], tokens_per_second=rate)
    train_seconds = time.perf_counter() - started
    final = evaluate_perplexity(model, windows)
    tail = losses[-max(1, len(losses) // 20) :]  # last 5% of steps, so one noisy batch does not decide it
    report = {
        "format": 1,
        "code_version": TRAIN_CODE_VERSION,
        "spec": dataclasses.asdict(spec),
        "train": dataclasses.asdict(config),
        "steps": config.steps,
        "seed": config.seed,
        "vocab_size": vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens_in_corpus": len(train_ids),
        "final_train_loss": sum(tail) / len(tail) if tail else float("nan"),
        "heldout_loss": final.nll,
        "heldout_perplexity": final.perplexity,
        "initial_heldout_loss": initial.nll,
        "unigram_heldout_perplexity": unigram_perplexity(train_ids, windows, vocab_size).perplexity,
        "heldout": {
            "source": "pydoc_data.topics",
            "rule": f"topics at index % {HELDOUT_EVERY} == 0 of the sorted keys; their paragraphs removed from train",
            "topics": list(split.heldout_topics),
            "corpus_sha256": split.sha256,
            "python": sys.version.split()[0],
            "window_tokens": config.seq_len,
            "windows": len(windows),
            "tokens": final.tokens,
        },
        "train_seconds": train_seconds,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }
    from transformers.utils import logging as transformers_logging

    bars_were_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # its one-shard bar would only add noise to ours
    try:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    finally:
        if bars_were_enabled:
            transformers_logging.enable_progress_bar()
    (directory / _REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def train_tiny_model(
    path: str | Path | None = None,
    *,
    spec: TinyModelSpec = TRAINED_SPEC,
    config: TrainConfig = TrainConfig(),
    steps: int | None = None,
    seed: int | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> TrainedModel:
    """Train (or reuse from the cache) a small Llama on the training split and write it in Hugging Face format.

    `steps` and `seed` override `config`; the seed also replaces `spec.seed`. The cache entry is
    `cache_dir/<cache_key>` (default `~/.cache/nesa-node/trained`), written to a temporary folder and renamed so a
    concurrent process never sees half a model. When `path` is given the model is copied there too.
    """
    import torch

    config = dataclasses.replace(
        config, steps=config.steps if steps is None else steps, seed=config.seed if seed is None else seed
    )
    if config.steps < 1:
        raise ValueError(f"steps must be at least 1, got {config.steps}")
    spec = dataclasses.replace(spec, seed=config.seed)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = root / cache_key(spec, config)
    from_cache = (entry / _REPORT_FILE).is_file()  # the report is written last, inside the temporary folder
    if from_cache:
        logger.info("reusing trained model %s", entry)
    else:
        root.mkdir(parents=True, exist_ok=True)
        temporary = root / f".{entry.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        temporary.mkdir()
        deterministic = torch.are_deterministic_algorithms_enabled()
        try:
            torch.use_deterministic_algorithms(True, warn_only=True)
            _train(temporary, spec, config, progress)
            try:
                temporary.rename(entry)
            except OSError:  # another process finished the same entry first; its model is identical
                if not (entry / _REPORT_FILE).is_file():
                    raise
        finally:
            torch.use_deterministic_algorithms(deterministic)
            shutil.rmtree(temporary, ignore_errors=True)
        logger.info("trained %d steps into %s", config.steps, entry)
    report = json.loads((entry / _REPORT_FILE).read_text())
    target = entry
    if path is not None:
        target = Path(path)
        shutil.copytree(entry, target, dirs_exist_ok=True)
    return TrainedModel(path=target, cache_path=entry, report=report, from_cache=from_cache)
