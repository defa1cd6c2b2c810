"""Batched-pass benchmark: what one pass of N sessions through a node's span costs against one session's step.

Prints one JSON line. In one process, on the span's device (no network, no scheduling): for each cache length and each
session count N, the median time of one session's one-token step (`BlockSpan.forward`), of one pass of N sessions'
one-token steps (`decode_batch`; and `--grow` passes one after the other, each a token further, as in a swarm where
every pass attends over new lengths), and of N 16-token prompts in one pass (`run_batch`, what `--batch-prompts` runs)
against the same prompts one at a time. Caches are cropped back after every timed call, so every repeat sees the same
lengths. `pass_N_vs_single` is a pass of N against one step: under N means batching gains (N sessions for less than N
steps' time).

    python bench/batch_pass.py                                   # the bench shape on the CPU
    python bench/batch_pass.py --shape 1.1b --device cuda --dtype bfloat16 [--profile]

`--shape 1.1b` serves 8 blocks of the random 1.1B Llama (half of it: one of 2 nodes). `--profile` adds, on stderr,
torch's profiler table of one N-session pass at the longest cache (the largest N). `--cudnn-attention` leaves
cuDNN's attention on (a CUDA span turns it off): compare `pass_N_growing_ms` with and without it. `--cuda-graphs`
runs one session's steps as its fixed step and the passes as fixed batches, captured as CUDA graphs on a GPU
(sharding/decode_graph.py, batch_graph.py; the growing passes replay too: the same caches, a token further).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model  # noqa: E402
from nesa_node.sharding.blocks import SpanSpec, load_block_span  # noqa: E402

SHAPES = {
    "bench": {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 8, "intermediate": 1408},
    "1.1b": {"layers": 8, "hidden": 2048, "heads": 32, "kv_heads": 8, "intermediate": 5632},
}


def timed(call, device: str, repeats: int) -> float:
    """Median milliseconds of `call()` over `repeats`, after two warm-up calls, the device synchronized."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for index in range(repeats + 2):
        sync()
        start = time.perf_counter()
        call()
        sync()
        if index >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def measure(span, caches: list, cached: int, step: torch.Tensor, prompt: torch.Tensor, args) -> dict:
    """The figures of one cache length: `caches` each hold `cached` tokens and are cropped back after every call."""
    blocks, seen = (span.start, span.end), len(prompt[0])

    single = span.step if span.decode_graphs else span  # with --cuda-graphs: the session's fixed step

    def one_step():
        single(step, caches[0], cached)
        caches[0].crop(-1)

    def one_pass(chosen):
        span.decode_batch([(step, cache, cached) for cache in chosen], blocks)
        for cache in chosen:
            cache.crop(-1)

    def prompts_apart(chosen):
        for cache in chosen:
            span(prompt, cache, cached)
            cache.crop(-seen)

    def prompts_together(chosen):
        span.run_batch([(prompt, cache, cached) for cache in chosen], blocks)
        for cache in chosen:
            cache.crop(-seen)

    def growing(chosen, alone: bool = False) -> float:
        """Median ms of `args.grow` passes one after the other, each a token further (a new attention length each,
        as in a swarm), then cropped back; `alone`: one session's own steps (`forward`) instead."""
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        times = []
        for index in range(args.grow):
            sync()
            started = time.perf_counter()
            if alone:
                single(step, chosen[0], cached + index)
            else:
                span.decode_batch([(step, cache, cached + index) for cache in chosen], blocks)
            sync()
            times.append((time.perf_counter() - started) * 1e3)
        for cache in chosen:
            cache.crop(-args.grow)
        return round(statistics.median(times), 3)

    row = {"single_step_ms": timed(one_step, args.device, args.repeats)}
    if args.grow:
        row["single_step_growing_ms"] = growing(caches[:1], alone=True)
    few = max(3, args.repeats // 4)
    for count in args.sessions:
        chosen = caches[:count]
        pass_ms = timed(lambda chosen=chosen: one_pass(chosen), args.device, args.repeats)
        row[f"pass_{count}_ms"] = pass_ms
        row[f"pass_{count}_vs_single"] = round(pass_ms / row["single_step_ms"], 3)
        if args.grow:
            row[f"pass_{count}_growing_ms"] = growing(chosen)
        if span.batches_prompts:
            row[f"prompts_{count}_apart_ms"] = timed(lambda chosen=chosen: prompts_apart(chosen), args.device, few)
            row[f"prompts_{count}_together_ms"] = timed(
                lambda chosen=chosen: prompts_together(chosen), args.device, few
            )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--cache-tokens", type=int, nargs="+", default=[16, 144, 512])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--grow", type=int, default=16, help="passes timed one after the other at new lengths (0: none)"
    )
    parser.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="leave cuDNN's attention on (a CUDA span turns it off: it plans every new length anew)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="steps and passes as fixed-shape CUDA graphs (a node's --cuda-graphs; eager off CUDA)",
    )
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory(prefix="nesa-batch-pass-") as workdir:
        spec = TinyModelSpec(
            layers=shape["layers"],
            hidden=shape["hidden"],
            heads=shape["heads"],
            kv_heads=shape["kv_heads"],
            intermediate=shape["intermediate"],
            vocab=1000,
            seed=0,
        )
        path = init_tiny_model(Path(workdir) / "model", spec)
        span_spec = SpanSpec(0, shape["layers"], dtype=args.dtype, device=args.device, decode_graphs=args.cuda_graphs)
        span = load_block_span(str(path), span_spec)
    if args.cudnn_attention and args.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)
    generator = torch.Generator().manual_seed(0)
    most = max(args.sessions)
    figures: dict[str, dict] = {}
    with torch.inference_mode():
        for cached in args.cache_tokens:
            caches = [span.new_cache() for _ in range(most)]
            for cache in caches:
                cache.reserve(cached + args.prompt_tokens + args.grow + 8)
                span(torch.randn(1, cached, span.hidden_size, generator=generator), cache, 0)
            step = torch.randn(1, 1, span.hidden_size, generator=generator)
            prompt = torch.randn(1, args.prompt_tokens, span.hidden_size, generator=generator)
            row = measure(span, caches, cached, step, prompt, args)
            figures[str(cached)] = row
            if args.profile and cached == max(args.cache_tokens):
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
                chosen = caches[:most]
                with profile(activities=activities) as prof:
                    span.decode_batch([(step, cache, cached) for cache in chosen], (span.start, span.end))
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), file=sys.stderr)
    result = {
        "bench": "batch_pass",
        "shape": args.shape,
        "blocks": shape["layers"],
        "device": args.device,
        "dtype": args.dtype,
        "per_session_attention": span._rotate is not None and args.device == "cpu",
        "cudnn_attention": args.device == "cuda" and torch.backends.cuda.cudnn_sdp_enabled(),
        "cuda_graphs": span.decode_graphs and args.device == "cuda",
        "batch_graphs": span.batch_graphs and args.device == "cuda",
        "batches_prompts": span.batches_prompts,
        "prompt_tokens": args.prompt_tokens,
        "by_cache_tokens": figures,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
