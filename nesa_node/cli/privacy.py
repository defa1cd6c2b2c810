"""`nesa-node privacy-check`: the leakage meter over a model folder (nesa_node/privacy/leakage.py).

For each private-edges setting A,B (the client keeps blocks [0, A) and [L-B, L)) and each boundary noise SIGMA it
prints what a node holding the public weights recovers: the share of input tokens the first node inverts exactly
from what it receives, the share of positions where the last node's logit lens (public final norm and LM head over
what it sends back) gives the client's own next-token prediction, and what the noise costs in perplexity.

The text is the held-out part of Python's help topics (pydoc_data.topics, as `nesa-node model train-tiny` splits
them), tokenized with the model folder's tokenizer: PROMPTS windows of TOKENS tokens, spread evenly over it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from nesa_node.cli.options import PARSERS, parse_edges
from nesa_node.errors import ModelLoadError, PlotsUnavailableError

# The settings worth comparing on a small model: none, a front block, both edges, two front blocks and one back.
# Those the model's depth does not allow (the swarm must keep a block) are skipped.
DEFAULT_EDGES = ((0, 0), (1, 0), (1, 1), (2, 1))
PLOTS_INSTALL = "pip install 'nesa-node[plots]'"


def add_parser(commands) -> None:
    check = commands.add_parser(
        "privacy-check",
        help="measure what nodes can recover from a client with private edges and boundary noise",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("--model", required=True, help="Hugging Face model folder (config, tokenizer, safetensors)")
    check.add_argument(
        "--edges",
        nargs="+",
        type=parse_edges,
        default=None,
        metavar="A,B",
        help="private-edges settings to measure (default: 0,0 1,0 1,1 2,1, those the model's depth allows)",
    )
    check.add_argument(
        "--noise",
        nargs="+",
        type=PARSERS["non_negative"],
        default=[0.0],
        metavar="SIGMA",
        help="boundary noise levels, relative to each token's RMS (default 0)",
    )
    check.add_argument("--prompts", type=PARSERS["positive_int"], default=4, help="text windows (default 4)")
    check.add_argument(
        "--tokens", type=PARSERS["positive_int"], default=32, help="tokens per window, at least 2 (default 32)"
    )
    check.add_argument("--seed", type=int, default=0, help="seed of the noise (default 0)")
    check.add_argument(
        "--metric",
        choices=("l2", "cosine"),
        default="l2",
        help="the first node's match between received and candidate states (default l2: it recovered more)",
    )
    check.add_argument("--device", default="cpu", help="where the measurement runs: cpu, cuda ... (default cpu)")
    check.add_argument(
        "--png", default=None, metavar="FILE", help=f"also plot the rows to FILE (needs {PLOTS_INSTALL})"
    )
    check.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotsUnavailableError(f"--png needs matplotlib: {PLOTS_INSTALL}") from None


def prompt_ids(model_path: str, prompts: int, tokens: int, vocab_size: int):
    """(prompts, tokens) token ids of held-out help text, windows spread evenly over the held-out stream.
    Raises ModelLoadError when the folder has no usable tokenizer or its ids do not fit the model's vocabulary."""
    import torch
    from transformers import AutoTokenizer

    from nesa_node.devtools.tiny_train import heldout_token_windows

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{model_path}: no tokenizer could be loaded ({error})") from None
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"{model_path}: the tokenizer has no end-of-sequence token to separate documents")
    windows = heldout_token_windows(tokenizer, tokens)  # (available, tokens)
    if len(windows) < prompts:
        raise ValueError(f"the held-out text has {len(windows)} windows of {tokens} tokens; asked for {prompts}")
    ids = windows[torch.linspace(0, len(windows) - 1, prompts).round().long()]  # (prompts, tokens)
    if int(ids.max()) >= vocab_size:
        raise ModelLoadError(f"{model_path}: the tokenizer gives ids beyond the model's {vocab_size} embeddings")
    return ids


def run_privacy_check(args) -> int:
    from nesa_node.privacy.leakage import check_edges, leakage_grid, load_leakage_model
    from nesa_node.sharding.blocks import load_config

    if args.tokens < 2:
        raise ValueError(f"--tokens must be at least 2 (a next token to predict), got {args.tokens}")
    if args.png:
        _require_matplotlib()  # before the work, not after it
    config = load_config(args.model)
    layers = config.num_hidden_layers
    if args.edges is None:
        settings = [check_edges(a, b, layers) for a, b in DEFAULT_EDGES if a + b < layers]
    else:
        settings = [check_edges(a, b, layers) for a, b in dict.fromkeys(args.edges)]
    sigmas = list(dict.fromkeys(args.noise))
    _status(f"loading {args.model} ({layers} blocks)")
    model = load_leakage_model(args.model, device=args.device)
    ids = prompt_ids(args.model, args.prompts, args.tokens, model.vocab_size)
    started = time.perf_counter()

    def progress(row, done: int, total: int) -> None:
        elapsed = time.perf_counter() - started
        _status(f"row {done}/{total}: edges {row.front},{row.back} sigma {row.sigma:g} ({elapsed:.0f} s)")

    rows = leakage_grid(model, ids, settings, sigmas, seed=args.seed, metric=args.metric, progress=progress)
    if args.json:
        header = {"model": str(args.model), "blocks": layers, "vocab": model.vocab_size, "metric": args.metric}
        header |= {"prompts": args.prompts, "tokens": args.tokens, "seed": args.seed}
        print(json.dumps(header | {"rows": [dataclasses.asdict(row) for row in rows]}, indent=2))
    else:
        print(_describe(args, layers, model.vocab_size))
        print(format_table(rows))
    if args.png:
        plot_rows(rows, Path(args.png), title=f"{Path(args.model).name}: {layers} blocks, vocab {model.vocab_size}")
        _status(f"wrote {args.png}")
    return 0


def _status(line: str) -> None:
    print(f"privacy-check: {line}", file=sys.stderr, flush=True)


def _describe(args, layers: int, vocab: int) -> str:
    return (
        f"{args.model}: {layers} blocks, vocabulary {vocab} (chance {100 / vocab:.2f}%); {args.prompts} x "
        f"{args.tokens} tokens of held-out text; adversary: a node holding the public weights ({args.metric} match)"
    )


COLUMNS = (
    ("edges", "{row.front},{row.back}"),
    ("sigma", "{row.sigma:g}"),
    ("first node: tokens recovered", "{row.recovery:.1%}"),
    ("last node: lens = output", "{row.lens_output:.1%}"),
    ("lens = next", "{row.lens_next:.1%}"),
    ("model = next", "{row.model_next:.1%}"),
    ("perplexity", "{row.perplexity:.2f}"),
    ("vs sigma 0", "x{row.perplexity_ratio:.3f}"),
)


def format_table(rows) -> str:
    """The rows as an aligned text table: text columns left, numbers right."""
    cells = [[template.format(row=row) for _, template in COLUMNS] for row in rows]
    widths = [max([len(name)] + [len(line[index]) for line in cells]) for index, (name, _) in enumerate(COLUMNS)]
    lines = ["  ".join(name.ljust(width) for (name, _), width in zip(COLUMNS, widths, strict=True)).rstrip()]
    for line in cells:
        text = [line[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(line[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(text))
    return "\n".join(lines)


def plot_rows(rows, path: Path, *, title: str) -> None:
    """Two panels to `path` (PNG): what the nodes recover, and the perplexity ratio. With several sigmas, curves over
    sigma per edge setting; with one, bars per edge setting."""
    _require_matplotlib()
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    settings = list(dict.fromkeys((row.front, row.back) for row in rows))
    sigmas = sorted({row.sigma for row in rows})
    figure = Figure(figsize=(10, 4), layout="constrained")
    leak, cost = figure.subplots(1, 2)
    if len(sigmas) > 1:
        for front, back in settings:
            mine = sorted((row for row in rows if (row.front, row.back) == (front, back)), key=lambda row: row.sigma)
            x = [row.sigma for row in mine]
            (line,) = leak.plot(
                x, [100 * row.recovery for row in mine], marker="o", label=f"first node, edges {front},{back}"
            )
            leak.plot(x, [100 * row.lens_output for row in mine], linestyle="--", marker="x", color=line.get_color(),
                      label=f"last node lens, edges {front},{back}")  # fmt: skip
            cost.plot(x, [row.perplexity_ratio for row in mine], marker="o", label=f"edges {front},{back}")
        for axes in (leak, cost):
            axes.set_xscale("symlog", linthresh=0.1)  # sigma 0 stays on the axis
            axes.set_xlabel("boundary noise sigma (x each token's RMS)")
        cost.set_yscale("log")  # the cost grows by factors
    else:
        labels = [f"{front},{back}" for front, back in settings]
        positions = range(len(rows))
        leak.bar([p - 0.2 for p in positions], [100 * row.recovery for row in rows], width=0.4, label="first node")
        leak.bar(
            [p + 0.2 for p in positions], [100 * row.lens_output for row in rows], width=0.4, label="last node lens"
        )
        cost.bar(list(positions), [row.perplexity_ratio for row in rows])
        for axes in (leak, cost):
            axes.set_xticks(list(positions), labels)
            axes.set_xlabel(f"private edges A,B (sigma {sigmas[0]:g})")
    leak.set_ylabel("recovered (%): input tokens; lens = client's output")
    leak.set_ylim(0, 105)
    leak.legend(fontsize="small")
    cost.set_ylabel("perplexity / perplexity at sigma 0")
    if len(sigmas) > 1:
        cost.legend(fontsize="small")
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


__all__ = ["add_parser", "format_table", "plot_rows", "prompt_ids", "run_privacy_check"]
