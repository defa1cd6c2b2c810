"""Small random models in Hugging Face format, for demos and tests (no hub downloads).

The tokenizer is a byte-level BPE trained offline with the `tokenizers` library on text that ships with
Python (the standard library's own sources), so it is reproducible on any machine with Python 3.11.
"""

from __future__ import annotations

import logging
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SUPPORTED_ARCHES = ("llama", "mistral", "qwen2")

# Standard-library modules whose sources train the tokenizer; stable across CPython 3.11 patch releases.
_CORPUS_MODULES = ("this.py", "textwrap.py", "argparse.py", "json/__init__.py", "logging/__init__.py", "string.py")


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "llama"
    layers: int = 4  # transformer blocks
    hidden: int = 64  # hidden size, elements
    heads: int = 4  # attention heads
    kv_heads: int = 2  # key/value heads (grouped-query attention when < heads)
    intermediate: int = 128  # MLP width, elements
    vocab: int = 1024  # tokenizer and embedding rows
    max_positions: int = 2048  # max_position_embeddings, tokens
    seed: int = 0
    initializer_range: float = 0.02  # transformers' default


def _corpus_lines() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in _CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            lines.extend(path.read_text(encoding="utf-8", errors="replace").splitlines())
    if not lines:  # a stripped Python without sources still gets a usable tokenizer
        lines = [f"token {i} of the fallback corpus" for i in range(1000)]
    return lines


def build_tokenizer(vocab_size: int, corpus_lines: Iterable[str] | None = None):
    """Train a byte-level BPE tokenizer of at most `vocab_size` tokens; returns a transformers tokenizer.

    `corpus_lines` is the training text (default: a few standard-library sources, see `_CORPUS_MODULES`).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _corpus_lines() if corpus_lines is None else list(corpus_lines)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def build_config(spec: TinyModelSpec, *, vocab_size: int):
    from transformers import AutoConfig

    if spec.arch not in SUPPORTED_ARCHES:
        raise ValueError(f"unknown arch {spec.arch!r}; choose one of {', '.join(SUPPORTED_ARCHES)}")
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError("hidden must divide by heads, and heads by kv_heads")
    return AutoConfig.for_model(
        spec.arch,
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def init_tiny_model(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a random model (config, safetensors, generation config) and its tokenizer to `path`.

    The same seed and spec always give the same weights, so tests can rebuild references.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab)
    config = build_config(spec, vocab_size=max(spec.vocab, len(tokenizer)))
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    logger.info("wrote %s model with %d blocks to %s", spec.arch, spec.layers, path)
    return path
