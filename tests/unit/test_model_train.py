"""The trained tiny model: held-out split, determinism, learning, Hugging Face loading, cache reuse, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nesa_node.cli import build_parser, main
from nesa_node.devtools.tiny_model import TinyModelSpec
from nesa_node.devtools.tiny_train import (
    TrainConfig,
    corpus_split,
    evaluate_perplexity,
    heldout_texts,
    heldout_token_windows,
    learning_rate_factor,
    train_tiny_model,
)

# Small enough to train 60 steps in under a second on one core.
SPEC = TinyModelSpec(layers=2, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=512)
CONFIG = TrainConfig(steps=60, batch=8, seq_len=64)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    return train_tiny_model(root / "model", spec=SPEC, config=CONFIG, cache_dir=root / "cache", progress=False)


def test_split_is_disjoint_and_complete():
    from pydoc_data.topics import topics

    split = corpus_split()
    assert not set(split.train_topics) & set(split.heldout_topics)
    assert sorted(split.train_topics + split.heldout_topics) == sorted(topics)
    assert heldout_texts() == list(split.heldout_texts)
    train_text = "\n\n".join(split.train_texts)
    # `if` and `else` share their text and `compound` contains most statements: shared text must leave train.
    long_lines = [line.strip() for text in split.heldout_texts for line in text.splitlines() if len(line.strip()) > 40]
    assert len(long_lines) > 100
    assert not [line for line in long_lines if line in train_text]


def test_training_is_deterministic_and_leaves_global_rng_alone(trained, tmp_path):
    rng_state = torch.random.get_rng_state()
    again = train_tiny_model(spec=SPEC, config=CONFIG, cache_dir=tmp_path, progress=False)
    assert torch.equal(rng_state, torch.random.get_rng_state())
    assert not again.from_cache and again.cache_path.name == trained.cache_path.name
    weights = (trained.path / "model.safetensors").read_bytes()
    assert weights == (again.path / "model.safetensors").read_bytes()
    different = train_tiny_model(spec=SPEC, config=CONFIG, seed=1, cache_dir=tmp_path, progress=False)
    assert weights != (different.path / "model.safetensors").read_bytes()


def test_saved_folder_loads_and_training_lowers_heldout_loss(trained):
    tokenizer = AutoTokenizer.from_pretrained(trained.path)
    model = AutoModelForCausalLM.from_pretrained(trained.path)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == SPEC.layers
    assert tokenizer.decode(tokenizer("hello swarm").input_ids) == "hello swarm"
    windows = heldout_token_windows(tokenizer, CONFIG.seq_len)
    after = evaluate_perplexity(model, windows)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SPEC.seed)
        untrained = AutoModelForCausalLM.from_config(model.config)
    before = evaluate_perplexity(untrained, windows)
    assert after.nll < before.nll - 0.5
    assert after.perplexity < trained.report["unigram_heldout_perplexity"]  # 157 vs 179 (measured)
    assert after.tokens == windows.numel() - len(windows)
    report = json.loads((trained.path / "nesa_train.json").read_text())
    assert report["heldout_loss"] == pytest.approx(after.nll, abs=1e-4)
    assert report["heldout"]["topics"] == list(corpus_split().heldout_topics)
    assert report["steps"] == CONFIG.steps and report["final_train_loss"] < report["initial_heldout_loss"]


def test_heldout_windows_are_consecutive_and_bounded(trained):
    tokenizer = AutoTokenizer.from_pretrained(trained.path)
    everything = heldout_token_windows(tokenizer, 32)
    assert torch.equal(heldout_token_windows(tokenizer, 32, count=3), everything[:3])
    assert torch.equal(heldout_token_windows(tokenizer, 64, count=2).flatten(), everything[:4].flatten())
    with pytest.raises(ValueError, match="windows"):
        heldout_token_windows(tokenizer, 32, count=len(everything) + 1)


def test_cache_is_reused(trained, tmp_path):
    mtime = (trained.cache_path / "model.safetensors").stat().st_mtime_ns
    again = train_tiny_model(tmp_path / "copy", spec=SPEC, config=CONFIG, cache_dir=trained.cache_path.parent)
    assert again.from_cache and again.cache_path == trained.cache_path
    assert (trained.cache_path / "model.safetensors").stat().st_mtime_ns == mtime
    assert (again.path / "model.safetensors").read_bytes() == (trained.path / "model.safetensors").read_bytes()
    assert not [p for p in trained.cache_path.parent.iterdir() if p.name.endswith(".tmp")]


def test_learning_rate_schedule():
    factors = [learning_rate_factor(step, 100, 0.1, 0.1) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:], strict=False))
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)


def test_cli_help_and_a_short_run(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["model", "train-tiny", "--help"])
    assert exit_.value.code == 0 and "held-out" in capsys.readouterr().out
    monkeypatch.setenv("NESA_NODE_CACHE", str(tmp_path / "cache"))
    argv = ["model", "train-tiny", str(tmp_path / "m"), "--steps", "2", "--layers", "1", "--hidden", "32"]
    assert main([*argv, "--no-progress"]) == 0
    assert "held-out perplexity" in capsys.readouterr().out
    assert (tmp_path / "cache" / "trained").is_dir() and (tmp_path / "m" / "nesa_train.json").is_file()
