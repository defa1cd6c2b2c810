"""`nesa-node model` commands that build or read model folders: a trained tiny model and known-answer canaries."""

from __future__ import annotations

import sys
from pathlib import Path


def add_train_tiny_parser(model) -> None:
    from nesa_node.devtools.tiny_train import TRAINED_SPEC, TrainConfig

    train = model.add_parser(
        "train-tiny",
        help="train a small Llama on Python's help text (CPU, about 2 minutes; cached)",
        description=(
            "Train a small Llama on the English help topics that ship with Python (pydoc_data) and write it in "
            "Hugging Face format with nesa_train.json (losses, held-out perplexity, held-out topics). Trained "
            "models are cached under $NESA_NODE_CACHE/trained (default ~/.cache/nesa-node/trained): the same "
            "spec, steps and seed are trained once."
        ),
    )
    train.add_argument("path", help="folder to write the model to")
    train.add_argument(
        "--steps", type=int, default=TrainConfig.steps, help=f"optimizer steps (default {TrainConfig.steps})"
    )
    train.add_argument("--seed", type=int, default=0, help="weight init and data sampling seed (default 0)")
    train.add_argument(
        "--layers", type=int, default=TRAINED_SPEC.layers, help=f"transformer blocks (default {TRAINED_SPEC.layers})"
    )
    train.add_argument(
        "--hidden", type=int, default=TRAINED_SPEC.hidden, help=f"hidden size, MLP 3x (default {TRAINED_SPEC.hidden})"
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")


def train_tiny(args) -> int:
    import dataclasses
    import os

    from nesa_node.devtools.tiny_train import TRAINED_SPEC, train_tiny_model

    spec = dataclasses.replace(TRAINED_SPEC, layers=args.layers, hidden=args.hidden, intermediate=3 * args.hidden)
    cache = os.environ.get("NESA_NODE_CACHE")
    trained = train_tiny_model(
        args.path,
        spec=spec,
        steps=args.steps,
        seed=args.seed,
        cache_dir=Path(cache) / "trained" if cache else None,
        progress=not args.no_progress,
    )
    report = trained.report
    source = "cached" if trained.from_cache else f"trained in {report['train_seconds']:.0f} s"
    print(
        f"{source}: train loss {report['final_train_loss']:.3f}, held-out perplexity {report['heldout_perplexity']:.1f}"
        f" (unigram {report['unigram_heldout_perplexity']:.1f}); wrote {trained.path}"
    )
    return 0


def write_canaries(args) -> int:
    from nesa_node.sharding.blocks import load_config
    from nesa_node.verification.canaries import FILE_NAME, build_canaries

    blocks = load_config(args.path).num_hidden_layers

    def progress(done: int, total: int) -> None:
        print(f"\rblock {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    texts = None
    if args.text:
        try:
            texts = [Path(name).read_text(errors="replace") for name in args.text]
        except OSError as error:
            raise ValueError(f"--text: {error}") from None
    canaries = build_canaries(args.path, count=args.count, tokens=args.tokens, seed=args.seed, texts=texts,
                              device=args.device, progress=progress)  # fmt: skip
    out = canaries.write(Path(args.out) if args.out else Path(args.path) / FILE_NAME)
    errors = ", ".join(f"{dtype} {max(values):.2g}" for dtype, values in canaries.honest_error.items())
    print(
        f"wrote {out}: {canaries.count} canaries of {canaries.tokens} tokens over {blocks} blocks (owner-only); "
        f"largest honest error of a block: {errors}"
    )
    return 0


__all__ = ["add_train_tiny_parser", "train_tiny", "write_canaries"]
