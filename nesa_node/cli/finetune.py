"""`nesa-node finetune`: train a LoRA adapter on a swarm (nesa_node/client/finetune.py) from a JSON-lines file.

The run: check the options, read and pack the data (cli/finetune_data.py) before joining the swarm, open a
FineTuningSession, take --steps optimizer steps (the batch of each step chosen by the session's step number, so a
failed-over or resumed session replays the same data), measure the held-out loss at the start, every --eval-every
steps and at the end, then write OUT/adapter (a PEFT folder) and OUT/metrics.json and say how to serve the adapter.
OUT/run.json keeps the settings that decide the batches, so that --resume refuses to continue with other ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

from nesa_node.cli.options import PARSERS
from nesa_node.compression.names import CODECS

# 2e-4: the LoRA rate of the QLoRA paper (Dettmers et al. 2023, table 9) for models up to 13B; a guess elsewhere
DEFAULT_LR = 2e-4
DEFAULT_SEQ_LEN = 128  # tokens per window; short, so that a CPU swarm takes a step in seconds (guess)
DEFAULT_BATCH_SIZE = 8  # windows per step (guess)
DEFAULT_EVAL_FRACTION = 0.1  # of the records, held out when no --eval-data is given (common practice)
DEFAULT_EVERY = 10  # steps between held-out evaluations, and between checkpoints (guess)
_RESUME_KEYS = ("data_sha256", "eval", "seq_len", "batch_size", "seed", "lora", "lr", "weight_decay")


def _targets(text: str) -> tuple[str, ...]:
    from nesa_node.sharding.lora_train import SHORT_NAMES

    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in SHORT_NAMES]
    if unknown or not names:
        problem = f"unknown projection {', '.join(map(repr, unknown))}" if unknown else "no projection"
        raise argparse.ArgumentTypeError(f"{problem}: give some of {','.join(SHORT_NAMES)}")
    return names


def _edges(text: str) -> tuple[str, ...]:
    from nesa_node.sharding.lora_edges import EDGE_NAMES, check_edge_names

    try:
        return check_edge_names(name.strip() for name in text.split(",") if name.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(EDGE_NAMES)}, got {text!r}") from None


def _eval_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def add_parser(commands, add_peer_args) -> None:
    finetune = commands.add_parser(
        "finetune",
        help="train a LoRA adapter on the swarm; writes a PEFT adapter folder and metrics",
        description="Train a LoRA adapter of --model on the swarm's nodes: each node trains the adapter's slice of "
        "its blocks (AdamW), the client holds the embeddings and LM head and computes the loss. Data is JSON lines, "
        'one object a line: {"text": ...} learns every token, {"prompt": ..., "completion": ...} only the '
        "completion's. Records are tokenized with the model folder's tokenizer, packed into windows of --seq-len "
        "tokens and shuffled by --seed; each step's batch follows from its number, so a resumed run sees the same "
        "data. Writes OUT/adapter (PEFT: `nesa-node run --adapters`, `nesa-node generate --adapter`, "
        "PeftModel.from_pretrained), OUT/metrics.json (losses, held-out loss and perplexity, tokens/s) and "
        "checkpoints under OUT/checkpoints.",
    )
    add_peer_args(finetune)
    data = finetune.add_argument_group("data")
    data.add_argument("--data", required=True, metavar="FILE", help="training data, JSON lines (see above)")
    held_out = data.add_mutually_exclusive_group()
    held_out.add_argument(
        "--eval-data", default=None, metavar="FILE", help="held-out data, JSON lines (default: part of --data)"
    )
    held_out.add_argument(
        "--eval-fraction",
        type=_eval_fraction,
        default=DEFAULT_EVAL_FRACTION,
        metavar="F",
        help=f"share of --data's records held out for evaluation, chosen by --seed; 0: no held-out evaluation "
        f"(default {DEFAULT_EVAL_FRACTION})",
    )
    data.add_argument(
        "--seq-len",
        type=PARSERS["positive_int"],
        default=DEFAULT_SEQ_LEN,
        metavar="N",
        help=f"tokens per window (default {DEFAULT_SEQ_LEN})",
    )
    data.add_argument(
        "--batch-size",
        type=PARSERS["positive_int"],
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"windows per optimizer step (default {DEFAULT_BATCH_SIZE})",
    )
    adapter = finetune.add_argument_group("adapter (default: rank 8, alpha 16, every attention and MLP projection)")
    adapter.add_argument("--rank", type=PARSERS["positive_int"], default=None, metavar="R", help="LoRA rank r")
    adapter.add_argument(
        "--alpha", type=PARSERS["positive"], default=None, metavar="A", help="LoRA alpha; the update is scaled alpha/r"
    )
    adapter.add_argument(
        "--targets",
        type=_targets,
        default=None,
        metavar="NAMES",
        help="comma-separated projections to adapt, peft's short names (q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj), e.g. q_proj,v_proj",
    )
    adapter.add_argument(
        "--train-edges",
        type=_edges,
        default=None,
        metavar="NAMES",
        help="also train these client layers whole, comma-separated: embed_tokens, norm, lm_head (peft's "
        "modules_to_save; they stay on this machine, and a client serves the adapter by naming its folder)",
    )
    adapter.add_argument(
        "--adapter",
        default=None,
        metavar="DIR",
        help="start from this PEFT LoRA folder (its rank, alpha and targets) instead of a new adapter",
    )
    training = finetune.add_argument_group("training")
    training.add_argument(
        "--steps",
        type=PARSERS["positive_int"],
        required=True,
        metavar="N",
        help="optimizer steps in all (with --resume: counting those already taken)",
    )
    training.add_argument(
        "--lr",
        type=PARSERS["positive"],
        default=DEFAULT_LR,
        metavar="X",
        help=f"AdamW learning rate (default {DEFAULT_LR})",
    )
    training.add_argument(
        "--weight-decay", type=PARSERS["non_negative"], default=0.0, metavar="X", help="AdamW weight decay (default 0)"
    )
    training.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the new adapter's initial factors, the held-out split and the data order (default 0)",
    )
    training.add_argument(
        "--compression",
        choices=CODECS,
        default="none",
        help="codec of activations and gradients between nodes; a lossy one trades accuracy for bytes (default none)",
    )
    training.add_argument(
        "--data-parallel",
        type=PARSERS["positive_int"],
        default=1,
        metavar="N",
        help="chains training at once, each on a part of every batch; the nodes of one span sum their gradients "
        "before each step (other nodes where the swarm has spares; default 1)",
    )
    training.add_argument(
        "--micro-batches",
        type=PARSERS["positive_int"],
        default=1,
        metavar="M",
        help="split each chain's part of a batch into M micro-batches that follow each other down the chain; the "
        "step is the same (at most 8; default 1)",
    )
    training.add_argument(
        "--eval-every",
        type=PARSERS["positive_int"],
        default=DEFAULT_EVERY,
        metavar="K",
        help=f"steps between held-out evaluations, besides the start and the end; each evaluates every held-out "
        f"window (default {DEFAULT_EVERY})",
    )
    output = finetune.add_argument_group("output")
    output.add_argument("--out", required=True, metavar="DIR", help="folder for adapter/, metrics.json, checkpoints/")
    output.add_argument(
        "--checkpoint-every",
        type=PARSERS["non_negative_int"],
        default=DEFAULT_EVERY,
        metavar="N",
        help=f"steps between checkpoints in OUT/checkpoints; 0: none (default {DEFAULT_EVERY})",
    )
    output.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT/checkpoints")
    output.add_argument(
        "--no-progress",
        action="store_true",
        help="a line per step instead of a progress bar (so too when stderr is not a terminal)",
    )


def check_args(args) -> None:
    """ValueError for options that do not go together; before anything is read."""
    if not args.initial_peers:
        raise ValueError("--initial-peers: give the address of at least one peer of the swarm")
    if args.adapter and (args.rank, args.alpha, args.targets, args.train_edges) != (None, None, None, None):
        raise ValueError(
            "--adapter gives the rank, alpha, targets and trained edges: leave out --rank, --alpha, --targets and "
            "--train-edges"
        )
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be 2 or more (a token and the next to predict), got {args.seq_len}")
    if not 1 <= args.micro_batches <= 8:
        raise ValueError(f"--micro-batches must be between 1 and 8, got {args.micro_batches}")
    if args.batch_size < args.data_parallel * args.micro_batches:
        raise ValueError(
            f"--batch-size {args.batch_size} cannot be split into {args.data_parallel} chains of "
            f"{args.micro_batches} micro-batches"
        )
    if args.resume and args.checkpoint_every == 0:
        raise ValueError("--resume continues from a checkpoint: it needs --checkpoint-every above 0")


def run_finetune(args) -> int:
    check_args(args)
    started = time.perf_counter()
    # the data and the options are checked first, with only torch loaded: a mistake is told in a second or two
    from nesa_node.cli.finetune_data import hold_out, read_records
    from nesa_node.sharding.lora_train import LoraSpec

    spec = None
    if not args.adapter:
        defaults = LoraSpec()
        spec = LoraSpec(
            rank=args.rank or defaults.rank,
            alpha=args.alpha or defaults.alpha,
            targets=args.targets or defaults.targets,
            edges=args.train_edges or (),
        )
    records = read_records(args.data)
    held_records = []
    if args.eval_data:
        held_records = read_records(args.eval_data, option="--eval-data")
    elif args.eval_fraction > 0:
        records, held_records = hold_out(records, args.eval_fraction, args.seed)
    from nesa_node.sharding.blocks import load_config  # transformers' config classes: after the data's checks

    config = load_config(args.model)  # a wrong folder is a ModelLoadError, not the Hub's "repo id" error
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq-len {args.seq_len} is over the model's {config.max_position_embeddings} positions")
    out = Path(args.out)
    checkpoints = out / "checkpoints" if args.checkpoint_every else None
    _check_out(out, checkpoints, args.resume)
    settings = _run_settings(args, spec)
    if args.resume:
        _check_resume(out / "run.json", settings)

    train, held_out = _windows(args, records, held_records)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(settings, indent=2) + "\n")

    from nesa_node.client.checkpoints import latest_step
    from nesa_node.client.finetune import FineTuningSession

    session = FineTuningSession.create(
        args.model,
        initial_peers=args.initial_peers,
        dht_prefix=args.dht_prefix,
        adapter=args.adapter,
        spec=spec,
        seed=args.seed,
        lr=args.lr,
        weight_decay=args.weight_decay,
        compression=args.compression,
        checkpoint_dir=checkpoints,
        # without checkpoints on disk the session still keeps one in memory, where a failover goes back to
        checkpoint_every=args.checkpoint_every or DEFAULT_EVERY,
        resume=args.resume,
        data_parallel=args.data_parallel,
        micro_batches=args.micro_batches,
    )
    try:
        hops = ", ".join(f"{hop.peer_id[:12]}… {hop.start_block}:{hop.end_block}" for hop in session.chain)
        print(f"training on {len(session.chain)} nodes ({hops}) from step {session.step}", flush=True)
        run = _train(session, args, train, held_out)
        if checkpoints is not None and latest_step(checkpoints) != session.step:
            session.checkpoint()  # the end as well, so that a --resume with more --steps goes on from here
        adapter_path = session.save_pretrained(out / "adapter")
        spec = session.inner.spec  # a resumed session's is its checkpoint's; an --adapter's is the folder's
        run.update(failovers=session.failovers, replayed_steps=session.replayed_steps)
    finally:
        session.close()

    metrics = _metrics(args, spec, run, train, held_out, adapter_path, time.perf_counter() - started)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    _print_summary(args, spec, metrics, adapter_path)
    return 0


def _windows(args, records, held_records):
    """(training Windows, held-out Windows or None): the records tokenized with the model folder's tokenizer."""
    from transformers import AutoTokenizer

    from nesa_node.cli.finetune_data import pack, tokenize

    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    pad_id = next((token for token in (tokenizer.pad_token_id, tokenizer.eos_token_id) if token is not None), 0)
    train = pack(tokenize(records, tokenizer), args.seq_len, pad_id)
    held_out = pack(tokenize(held_records, tokenizer), args.seq_len, pad_id) if held_records else None
    print(
        f"data: {_count(len(records), 'record')}, {train.tokens} tokens in {_count(len(train), 'window')} of "
        f"{args.seq_len}; held out: "
        + (f"{_count(len(held_records), 'record')}, {_count(len(held_out), 'window')}" if held_out else "none"),
        flush=True,
    )
    return train, held_out


def _check_out(out: Path, checkpoints: Path | None, resume: bool) -> None:
    """Refuse an --out that is a file, a --resume with nothing to resume, and a new run over an earlier one's
    checkpoints (it would mix the two)."""
    from nesa_node.errors import CheckpointError

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder (created if missing)")
    has_checkpoints = checkpoints is not None and (checkpoints / "latest.json").is_file()  # client/checkpoints.py
    if resume and not has_checkpoints:
        raise CheckpointError(f"--resume: no checkpoint in {checkpoints}; start without --resume")
    if not resume and has_checkpoints:
        raise CheckpointError(
            f"{checkpoints} holds the checkpoints of an earlier run: add --resume to continue it, or give another --out"
        )


def _run_settings(args, spec) -> dict:
    """What decides the batches and the adapter's updates: a resumed run must have the same."""
    eval_source = {"file": _sha256(args.eval_data)} if args.eval_data else {"fraction": args.eval_fraction}
    lora = None if spec is None else {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets)}
    if spec is not None and spec.edges:  # a run.json of a run without them reads as before
        lora["edges"] = list(spec.edges)
    return {
        "data_sha256": _sha256(args.data),
        "eval": eval_source,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "lora": lora if args.adapter is None else {"adapter": str(Path(args.adapter).resolve())},
        "lr": args.lr,
        "weight_decay": args.weight_decay,
    }


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _check_resume(path: Path, settings: dict) -> None:
    """CheckpointError when the run being resumed had other settings (its run.json; none: nothing to compare)."""
    from nesa_node.errors import CheckpointError

    if not path.is_file():
        return
    try:
        earlier = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read ({exc}); it records the settings of the run to resume") from None
    changed = [key for key in _RESUME_KEYS if earlier.get(key) != settings[key]]
    if changed:
        raise CheckpointError(
            f"--resume with other settings than the run in {path.parent}: {', '.join(changed)} differ; give the "
            "same data and options (--steps may change)"
        )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # exp overflows a float past ~709


def held_out_loss(session, data, batch_size: int) -> float:
    """Mean loss per predicted token over every window of `data` (a Windows), in batches of `batch_size`."""
    from nesa_node.cli.finetune_data import predicted

    total, count = 0.0, 0
    for first in range(0, len(data), batch_size):
        labels = data.labels[first : first + batch_size]  # (batch, seq_len)
        weight = predicted(labels)
        total += session.evaluate(data.input_ids[first : first + batch_size], labels) * weight
        count += weight
    return total / count


class _Report:
    """A tqdm bar on stderr (step, loss, tokens/s, held-out perplexity), or with `plain` a line on stdout per step
    and per evaluation."""

    def __init__(self, total: int, initial: int, plain: bool):
        self.total = total
        self.shown = {"loss": "", "tps": "", "perplexity": ""}  # the bar's postfix, in this order
        self.bar = None
        if not plain:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stderr, dynamic_ncols=True)

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is None:
            print(f"step {step}/{self.total}: loss {loss:.4f}, {tokens_per_s:.0f} tokens/s", flush=True)
            return
        self.bar.n = step  # may go back: a failed-over session repeats steps
        self.shown.update(loss=f"loss {loss:.3f}", tps=f"{tokens_per_s:.0f} tokens/s")
        self.bar.set_postfix_str(", ".join(filter(None, self.shown.values())), refresh=True)

    def evaluation(self, step: int, loss: float) -> None:
        line = f"held-out at step {step}: loss {loss:.4f}, perplexity {_perplexity(loss):.2f}"
        if self.bar is None:
            print(line, flush=True)
            return
        self.bar.write(line, file=sys.stderr)
        self.shown["perplexity"] = f"held-out ppl {_perplexity(loss):.2f}"
        self.bar.set_postfix_str(", ".join(filter(None, self.shown.values())), refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _train(session, args, train, held_out) -> dict:
    """Steps until the session has taken args.steps; the losses, evaluations and timings."""
    from nesa_node.cli.finetune_data import batch_of, batch_rows

    start = session.step
    losses: dict[
        int, float
    ] = {}  # step -> the loss of its batch before its update (the last one, should the session go back)
    evaluations: dict[int, float] = {}
    tokens, seconds = 0, 0.0
    report = _Report(args.steps, min(start, args.steps), plain=args.no_progress or not sys.stderr.isatty())

    def evaluate() -> None:
        if held_out is not None and session.step not in evaluations:
            evaluations[session.step] = loss = held_out_loss(session, held_out, args.batch_size)
            report.evaluation(session.step, loss)

    try:
        evaluate()
        while session.step < args.steps:
            step = session.step
            input_ids, labels = batch_of(train, batch_rows(len(train), args.batch_size, step, args.seed))
            began = time.perf_counter()
            loss = session.train_step(input_ids, labels)
            seconds += time.perf_counter() - began
            tokens += input_ids.numel()
            if not math.isfinite(loss):
                raise ValueError(f"the loss of step {step} is {loss}: training diverged; try a lower --lr")
            losses[step] = loss
            report.step(session.step, loss, tokens / seconds)
            if session.step % args.eval_every == 0:
                evaluate()
        evaluate()  # the end, unless the last step was an evaluation's
    finally:
        report.close()
    return {
        "start_step": start,
        "end_step": session.step,
        "losses": sorted(losses.items()),
        "evaluations": sorted(evaluations.items()),
        "train_tokens": tokens,
        "train_s": seconds,
    }


def _metrics(args, spec, run: dict, train, held_out, adapter_path: Path, wall_s: float) -> dict:
    evaluations = [{"step": step, "loss": loss, "perplexity": _perplexity(loss)} for step, loss in run["evaluations"]]
    return {
        "model": args.model,
        "adapter": str(adapter_path),
        "lora": {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets), "edges": list(spec.edges)},
        "settings": {
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "seed": args.seed,
            "compression": args.compression,
        },
        "data": {
            "train_windows": len(train),
            "train_tokens": train.tokens,
            "held_out_windows": len(held_out) if held_out is not None else 0,
        },
        "start_step": run["start_step"],
        "steps": run["end_step"],
        "losses": [{"step": step, "loss": loss} for step, loss in run["losses"]],
        "failovers": run["failovers"],
        "replayed_steps": run["replayed_steps"],
        "eval": evaluations,
        "eval_before": evaluations[0] if evaluations else None,
        "eval_after": evaluations[-1] if evaluations else None,
        "train_tokens": run["train_tokens"],
        "tokens_per_s": run["train_tokens"] / run["train_s"] if run["train_s"] > 0 else 0.0,
        "train_s": run["train_s"],
        "wall_s": wall_s,
    }


def _print_summary(args, spec, metrics: dict, adapter_path: Path) -> None:
    losses = metrics["losses"]
    trained = f"loss {losses[0]['loss']:.4f} -> {losses[-1]['loss']:.4f}" if losses else "no step left to take"
    print(
        f"trained steps {metrics['start_step']}..{metrics['steps']} in {metrics['wall_s']:.1f} s "
        f"({metrics['tokens_per_s']:.0f} tokens/s): {trained}"
    )
    before, after = metrics["eval_before"], metrics["eval_after"]
    if before is not None:
        print(
            f"held-out loss {before['loss']:.4f} -> {after['loss']:.4f}, perplexity {before['perplexity']:.2f} -> "
            f"{after['perplexity']:.2f} (steps {before['step']} -> {after['step']})"
        )
    edges = f"; trained whole: {','.join(spec.edges)}" if spec.edges else ""
    print(
        f"adapter: {adapter_path} (PEFT LoRA, rank {spec.rank}, alpha {spec.alpha:g}, {','.join(spec.targets)}{edges})"
    )
    print(f"metrics: {Path(args.out) / 'metrics.json'}")
    per_request = f"nesa-node generate --model {args.model} --initial-peers ... --adapter {adapter_path} --prompt ..."
    if spec.edges:  # the trained edge layers are the client's: nodes get the blocks' slices from it
        print(f"serve it: {per_request}")
    else:
        print(
            f"serve it: nesa-node run --model {args.model} --blocks START:END ... --adapters {adapter_path}\n"
            f"  or per request: {per_request}"
        )


__all__ = ["add_parser", "check_args", "held_out_loss", "run_finetune"]
