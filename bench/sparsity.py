"""Activation-sparsity benchmark: low-rank predictors of the zero FFN neurons of a tiny ReLU model, against dense.

The model: the trained tiny Llama (`nesa-node model train-tiny`, cached) switched from SiLU to ReLU and fine-tuned
`--relu-steps` steps on its training split (the "ReLUfication" of Comet, seed 002, appendix C; the loaders serve no
OPT, the paper's ReLU model), optionally with an L1 penalty on the ReLU outputs (`--activation-l1`) that makes more
neurons 0.
One `LowRankPredictor` of rank `--rank` per block is trained on the MLP inputs of `--train-windows` training windows
(labels: gate > 0) with its threshold set for `--recall` on them (sharding/sparsity.py). Reported:

- per block and overall, on held-out windows (the dense model's MLP inputs): recall (of the truly active neurons, the
  share predicted active), precision, predicted density and true density per token;
- logit error of the predicted masks applied per token ("masked": what per-token skipping computes) against dense on
  the held-out windows: max and mean |logit difference|, top-1 agreement, held-out NLL of both;
- greedy generation (`--prompts` held-out 16-token prompts, `--new-tokens` tokens) through the "gather" path a node
  runs (prefill: the union of the prompt's tokens' predictions; decode: each token's own): share of tokens equal to
  dense's and of prompts whose whole continuation is;
- the density "gather" computes for a step of 1, 16 and 128 tokens (the union of their predicted sets);
- the oracle mask: "masked" logits bitwise equal to dense (true/false), and the "gather" path's max |logit difference|
  from dense over 64 one-token decode steps;
- step time sparse ("gather", predictor included) / dense, median over interleaved repeats: the 4-block span's
  one-token decode step at position `--context` (its cache cropped back after each step) and 1 x `--context` prefill,
  the same for block 0's MLP alone, and one decode token of a random ReLU MLP of a 7B-class-like width
  (`--wide-hidden`, 2.75x intermediate, predictor rank scaled alike) at the measured density and at 10%; plus the
  multiply-adds sparse/dense per decode token implied by the measured density (what an MPC protocol's cost follows).

One JSON line. On a shared CPU, --threads 1 (the default) keeps torch's thread pool from stalling.

    python bench/sparsity.py [--rank 32] [--recall 0.99] [--relu-steps 100] [--repeats 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node.devtools.allocator import steady_allocator  # noqa: E402
from nesa_node.devtools.tiny_train import corpus_split, heldout_token_windows, train_tiny_model  # noqa: E402
from nesa_node.sharding import sparsity  # noqa: E402
from nesa_node.sharding.blocks import SpanSpec, load_block_span  # noqa: E402
from nesa_node.sharding.client_edges import load_client_edges  # noqa: E402

WINDOW = 128  # tokens per training / held-out window


def relufied_model(workdir: Path, steps: int, seed: int, activation_l1: float) -> tuple[Path, dict]:
    """The trained tiny Llama with ReLU instead of SiLU, fine-tuned `steps` steps (AdamW 1e-3, 16 x 128 tokens) with
    `activation_l1` times the mean ReLU output of every block added to the loss (0: plain fine-tuning; above, the
    L1 penalty of ProSparse, Song et al. 2024, that pushes neurons to exactly 0); written to `workdir` with its
    tokenizer. Returns the folder and the held-out perplexities along the way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.activations import ACT2FN

    from nesa_node.devtools.tiny_train import evaluate_perplexity

    source = train_tiny_model(progress=False).path
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source)
    heldout = heldout_token_windows(tokenizer, WINDOW)[:16]
    report = {"silu_heldout_ppl": evaluate_perplexity(model, heldout).perplexity}
    model.config.hidden_act = "relu"
    for layer in model.model.layers:
        layer.mlp.act_fn = ACT2FN["relu"]
    report["relu_before_finetune_ppl"] = evaluate_perplexity(model, heldout).perplexity
    stream = train_stream(tokenizer)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    offsets = torch.arange(WINDOW)
    activations: list[torch.Tensor] = []
    hooks = [
        layer.mlp.act_fn.register_forward_hook(lambda m, a, out: activations.append(out))
        for layer in model.model.layers
    ]
    model.train()
    started = time.perf_counter()
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - WINDOW, (16,), generator=generator)
        ids = stream[starts[:, None] + offsets]  # (16, WINDOW)
        activations.clear()
        logits = model(ids).logits[:, :-1]  # (16, WINDOW - 1, vocab)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        if activation_l1:
            loss = loss + activation_l1 * sum(output.mean() for output in activations)  # ReLU outputs are >= 0
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    for hook in hooks:
        hook.remove()
    model.eval()
    report["finetune_s"] = time.perf_counter() - started
    report["relu_heldout_ppl"] = evaluate_perplexity(model, heldout).perplexity
    folder = workdir / "tiny-relu"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, report


def train_stream(tokenizer) -> torch.Tensor:
    """The training split's tokens, each document followed by the end token (as tiny_train builds it)."""
    ids: list[int] = []
    for text in corpus_split().train_texts:
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def logits_of(span, edges, ids: torch.Tensor, cache=None, position: int = 0) -> torch.Tensor:
    with torch.inference_mode():
        return edges.lm_head(edges.norm(span(edges.embed_tokens(ids), cache, position)))  # (batch, seq, vocab)


def stepwise_logits(span, edges, ids: torch.Tensor) -> torch.Tensor:
    """Logits (1, seq, vocab) of ids (1, seq) fed one token at a time on the span's cache."""
    cache = span.new_cache()
    return torch.cat(
        [logits_of(span, edges, ids[:, index : index + 1], cache, index) for index in range(ids.shape[1])], 1
    )


def greedy(span, edges, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy continuation of prompt (1, seq): a prefill, then one-token steps on the span's cache."""
    cache = span.new_cache()
    logits = logits_of(span, edges, prompt, cache, 0)
    tokens = [int(logits[0, -1].argmax())]
    for step in range(new_tokens - 1):
        logits = logits_of(span, edges, torch.tensor([[tokens[-1]]]), cache, prompt.shape[1] + step)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


def interleaved_ratio(dense: Callable[[], object], sparse: Callable[[], object], repeats: int) -> dict:
    """Median seconds of each and the median over repeats of that repeat's sparse / dense (each repeat times both,
    so a drift of the shared machine hits both alike)."""
    dense_s, sparse_s = [], []
    with torch.inference_mode():
        dense(), sparse()  # warm-up
        for _ in range(repeats):
            for run, into in ((dense, dense_s), (sparse, sparse_s)):
                started = time.perf_counter()
                run()
                into.append(time.perf_counter() - started)
    return {
        "dense_ms": 1000 * statistics.median(dense_s),
        "sparse_ms": 1000 * statistics.median(sparse_s),
        "ratio": statistics.median(s / d for s, d in zip(sparse_s, dense_s, strict=True)),
    }


def metrics_dict(metrics: sparsity.PredictionMetrics) -> dict:
    return {
        "recall": metrics.recall,
        "precision": metrics.precision,
        "predicted_density": metrics.predicted_density,
        "true_density": metrics.true_density,
    }


def wide_mlp_timing(hidden: int, density: float, rank: int, repeats: int) -> dict:
    """A random ReLU Llama MLP (hidden, 2.75 hidden), one decode token: dense against a rank-`rank` predictor plus the
    gathered MLP over a random `density` share of the neurons (the predictor's output is replaced by that set)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    generator = torch.Generator().manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(2.75 * hidden), hidden_act="relu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mlp = LlamaMLP(config).eval().requires_grad_(False)
    predictor = sparsity.LowRankPredictor(hidden, config.intermediate_size, rank, generator=generator)
    keep = max(1, round(density * config.intermediate_size))
    neurons = torch.randperm(config.intermediate_size, generator=generator)[:keep].sort().values
    x = torch.randn(1, hidden, generator=generator)  # (tokens, hidden)

    down_by_neuron = sparsity.neuron_major_down(mlp)

    def sparse():
        predictor.predict(mlp, x).any(0).nonzero()  # the selection's cost; its result is replaced by `neurons`
        return sparsity.gathered_mlp(mlp, x, neurons, down_by_neuron)

    timing = interleaved_ratio(lambda: mlp(x), sparse, repeats)
    return {"hidden": hidden, "intermediate": config.intermediate_size, "rank": rank,
            "density": keep / config.intermediate_size, **timing}  # fmt: skip


def rounded(value):
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value


def measure(args, folder: Path) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    span = load_block_span(folder, SpanSpec(0, 4))
    edges = load_client_edges(folder)
    generator = torch.Generator().manual_seed(args.seed)
    stream = train_stream(tokenizer)
    starts = torch.randint(0, len(stream) - WINDOW, (args.train_windows,), generator=generator)
    train = stream[starts[:, None] + torch.arange(WINDOW)]  # (train windows, WINDOW)
    heldout = heldout_token_windows(tokenizer, WINDOW, args.heldout_windows)  # (held-out windows, WINDOW)
    with torch.inference_mode():
        train_inputs = sparsity.record_mlp_inputs(span, [edges.embed_tokens(ids) for ids in train.split(8)])
        heldout_inputs = sparsity.record_mlp_inputs(span, [edges.embed_tokens(ids) for ids in heldout.split(8)])
        train_labels = [sparsity.oracle_mask(layer.mlp, x) for layer, x in zip(span.layers, train_inputs, strict=True)]
    config = sparsity.PredictorConfig(rank=args.rank, target_recall=args.recall, seed=args.seed)
    started = time.perf_counter()
    predictors = [
        sparsity.train_predictor(x, labels, config) for x, labels in zip(train_inputs, train_labels, strict=True)
    ]
    train_s = time.perf_counter() - started
    layers, predicted_all, actual_all = [], [], []
    with torch.inference_mode():
        for layer, predictor, x in zip(span.layers, predictors, heldout_inputs, strict=True):
            predicted, actual = predictor.predict(layer.mlp, x), sparsity.oracle_mask(layer.mlp, x)
            layers.append(
                {**metrics_dict(sparsity.prediction_metrics(predicted, actual)), "threshold": predictor.threshold}
            )
            predicted_all.append(predicted)
            actual_all.append(actual)
    overall = sparsity.prediction_metrics(torch.cat(predicted_all), torch.cat(actual_all))

    dense_logits = logits_of(span, edges, heldout)  # (windows, WINDOW, vocab)
    with sparsity.sparse_span(span, predictors, mode="masked"):
        masked_logits = logits_of(span, edges, heldout)
    with sparsity.sparse_span(span, [sparsity.oracle_mask] * 4, mode="masked"):
        oracle_masked = logits_of(span, edges, heldout)
    window = heldout[:1, :64]  # one token at a time: the decode path, where "gather" uses each token's own set
    dense_steps = stepwise_logits(span, edges, window)
    with sparsity.sparse_span(span, [sparsity.oracle_mask] * 4, mode="gather"):
        oracle_steps = stepwise_logits(span, edges, window)
    prefill_union_density = {}
    for length in (1, 16, WINDOW):  # one token: its own set; more: the union of theirs
        with sparsity.sparse_span(span, predictors, mode="gather") as handle:
            logits_of(span, edges, heldout[:1, :length])
            prefill_union_density[str(length)] = statistics.mean(stats.computed_density for stats in handle.stats)

    def nll(logits):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), heldout[:, 1:].flatten()).item()

    difference = (masked_logits - dense_logits).abs()
    logit_error = {
        "max_abs": difference.max().item(),
        "mean_abs": difference.mean().item(),
        "dense_logit_std": dense_logits.std().item(),
        "top1_agreement": (masked_logits.argmax(-1) == dense_logits.argmax(-1)).float().mean().item(),
        "dense_heldout_nll": nll(dense_logits),
        "sparse_heldout_nll": nll(masked_logits),
    }
    prompts = heldout[: args.prompts, :16]
    dense_tokens = [greedy(span, edges, prompt[None], args.new_tokens) for prompt in prompts]
    with sparsity.sparse_span(span, predictors, mode="gather"):
        sparse_tokens = [greedy(span, edges, prompt[None], args.new_tokens) for prompt in prompts]
    same = [
        a == b
        for dense, sparse in zip(dense_tokens, sparse_tokens, strict=True)
        for a, b in zip(dense, sparse, strict=True)
    ]
    greedy_report = {
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "token_agreement": sum(same) / len(same),
        "identical_continuations": sum(d == s for d, s in zip(dense_tokens, sparse_tokens, strict=True)) / args.prompts,
    }

    timing = step_timing(args, folder, heldout, predictors, overall.predicted_density)
    hidden, width = span.hidden_size, span.layers[0].mlp.gate_proj.out_features
    decode_flops = (args.rank * (hidden + width) + 3 * hidden * overall.predicted_density * width) / (
        3 * hidden * width
    )
    return {
        "predictor_train_s": train_s,
        "train_tokens": int(train.numel()),
        "heldout_tokens": int(heldout.numel()),
        "layers": layers,
        "overall": metrics_dict(overall),
        "logit_error": logit_error,
        "greedy": greedy_report,
        "oracle": {
            "masked_bitwise_equal": bool(torch.equal(oracle_masked, dense_logits)),
            "gather_decode_max_abs": (oracle_steps - dense_steps).abs().max().item(),
        },
        "union_density_by_tokens": prefill_union_density,
        "decode_multiply_adds_ratio": decode_flops,
        "timing": timing,
    }


def step_timing(args, folder: Path, heldout: torch.Tensor, predictors, density: float) -> dict:
    """Dense against sparse ("gather", predictors installed) on two copies of the span, so that the timed calls
    alternate without installing anything in between."""
    dense_span, sparse_span = load_block_span(folder, SpanSpec(0, 4)), load_block_span(folder, SpanSpec(0, 4))
    sparsity.install_sparsity(sparse_span, predictors, mode="gather")
    edges = load_client_edges(folder)
    context = args.context
    with torch.inference_mode():
        prefill_hidden = edges.embed_tokens(heldout[:1, :context])  # (1, context, hidden)
        step_hidden = edges.embed_tokens(heldout[:1, context : context + 1])  # (1, 1, hidden)
        caches = {id(span): span.new_cache() for span in (dense_span, sparse_span)}
        for span in (dense_span, sparse_span):
            span(prefill_hidden, caches[id(span)], 0)
        mlp_inputs = sparsity.record_mlp_inputs(dense_span, [prefill_hidden])[0]  # (context, hidden), block 0

    def decode(span):
        def run():
            span(step_hidden, caches[id(span)], context)
            caches[id(span)].crop(-1)  # drop the step again: the next repeat decodes the same position

        return run

    mlp = dense_span.layers[0].mlp
    down_by_neuron = sparsity.neuron_major_down(mlp)

    def mlp_step(x, sparse: bool):
        if not sparse:
            return lambda: mlp(x)
        return lambda: sparsity.gathered_mlp(
            mlp, x, predictors[0].predict(mlp, x).any(0).nonzero().squeeze(1), down_by_neuron
        )

    prefill_repeats = max(3, args.repeats // 5)
    timing = {
        "context": context,
        "threads": torch.get_num_threads(),
        "span_decode": interleaved_ratio(decode(dense_span), decode(sparse_span), args.repeats),
        "span_prefill": interleaved_ratio(
            lambda: dense_span(prefill_hidden), lambda: sparse_span(prefill_hidden), prefill_repeats
        ),
        "mlp_decode": interleaved_ratio(
            mlp_step(mlp_inputs[-1:], False), mlp_step(mlp_inputs[-1:], True), args.repeats
        ),
        "mlp_prefill": interleaved_ratio(mlp_step(mlp_inputs, False), mlp_step(mlp_inputs, True), args.repeats),
    }
    if args.wide_hidden:  # at the density measured here, and at OPT-6.7B's 10% (Comet, table 5: 90.1% sparse)
        rank = args.rank * args.wide_hidden // dense_span.hidden_size  # the same share of the hidden size as here
        timing["wide_mlp_decode"] = [
            wide_mlp_timing(args.wide_hidden, share, rank, args.repeats) for share in (density, 0.1)
        ]
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=32, help="predictor rank")
    parser.add_argument("--recall", type=float, default=0.99, help="recall target of the threshold, on training tokens")
    parser.add_argument("--relu-steps", type=int, default=100, help="fine-tuning steps after the switch to ReLU")
    parser.add_argument("--activation-l1", type=float, default=0.0, help="L1 penalty on ReLU outputs while fine-tuning")
    parser.add_argument("--train-windows", type=int, default=32, help="128-token windows the predictors learn from")
    parser.add_argument("--heldout-windows", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="decode position and prefill length of the timings")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--wide-hidden", type=int, default=2048, help="hidden size of the wide MLP timing (0: skip)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    allocator = steady_allocator()
    with tempfile.TemporaryDirectory(prefix="nesa-bench-") as workdir:
        folder, model_report = relufied_model(Path(workdir), args.relu_steps, args.seed, args.activation_l1)
        figures = measure(args, folder)
    result = {"bench": "sparsity", "rank": args.rank, "recall_target": args.recall, "relu_steps": args.relu_steps,
              "activation_l1": args.activation_l1, "allocator": allocator, "model": model_report,
              **figures}  # fmt: skip
    print(json.dumps(rounded(result)))


if __name__ == "__main__":
    main()
