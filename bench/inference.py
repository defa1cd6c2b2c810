"""Inference benchmark: single-process transformers vs the swarm with 1, 2 and 3 nodes (direct and relayed).

Prints one JSON line. Speeds are also given as ratios to the single-process baseline measured in the same run,
since absolute timings on a shared machine are noisy: the single process is measured before the first swarm and again
after each one, and each swarm's ratios use the two measurements around it. Where the machine's speed drifts within
seconds (a shared VM: 25% between runs of a few seconds), the `paired_*` figures are the steadier ones: each timed
generation through the swarm follows one of the single process (the nodes idle meanwhile), and they are the medians
of the pairs' decode ratios and first-token differences.

    python bench/inference.py [--layers 8] [--hidden 512] [--new-tokens 64] [--repeats 3] [--forward-repeats 5]
                              [--clients 8] [--nodes 1 2 3] [--client-threads 1]
    python bench/inference.py --shape 1.1b --device cuda --dtype bfloat16 --nodes 2 4 --clients 16 [--cuda-graphs]

`--shape 1.1b` is a random Llama of 1.1B parameters (16 blocks, hidden 2048, 32 heads, 8 KV heads, MLP 5632) with a
16-token prompt and 128 new tokens; `--device cuda --dtype bfloat16` puts the single-process baseline, every node and
the client's layers on the GPU in that dtype (all nodes on the same GPU); `--cuda-graphs` starts the nodes with
`--cuda-graphs` (a session's one-token steps replayed as CUDA graphs). Each chain figure also gives the first
generation through the fresh nodes against the later ones (`first_vs_later`).

`--clients N` adds the many-clients figure: aggregate decode tokens/s of N concurrent sessions (one client process,
one P2P host, as a gateway runs them) against one session, through nodes that batch concurrent decode steps and
through nodes started with --no-batch-decode. `--client-processes` adds the same N sessions from N client processes
(bench/client_process.py), one session each, as N users with clients of their own. `--clients-only` measures the
batching nodes' concurrent figures alone (no chain figures, no --no-batch-decode twin): a short run to compare
settings of the nodes (`--node-arg`).

The single-process baseline, every node and the swarm's client run on torch's default threads (all cores): a chain
computes one part at a time (the client, then each node in turn), and each process's idle OpenMP threads spin only
about 0.1 ms before they sleep (nesa_node/openmp_wait.py, set here and by `nesa-node run`), so the part computing has
the cores. `--node-threads N` gives each node N threads instead (`--node-threads share`: the cores over the nodes of
the swarm, as for nodes computing at once), `--client-threads N` the client. Each swarm (one per --nodes count, and
its --no-batch-decode twin with --clients) runs alone: it is started, measured and stopped before the next starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node import event_loop, openmp_wait, step_trace  # noqa: E402

openmp_wait.short_spin()  # before torch loads: the baseline and the client as the nodes (see the docstring)

import torch  # noqa: E402
from client_process import processes_decode  # noqa: E402  (bench/client_process.py, beside this file)
from spy import Spies  # noqa: E402  (bench/spy.py, beside this file)
from trace_summary import summarize as summarize_trace  # noqa: E402  (bench/trace_summary.py)

from nesa_node.client.model import DistributedModelForCausalLM  # noqa: E402
from nesa_node.devtools.launcher import ProcessGroup, split_blocks  # noqa: E402
from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model  # noqa: E402
from nesa_node.errors import NoRouteError  # noqa: E402

# model shapes: the CPU bench model, and the 1.1B Llama of GPU nodes (TinyLlama's shape, random weights)
SHAPES = {
    "bench": {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 8, "intermediate": 1408, "new_tokens": 64},
    "1.1b": {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "intermediate": 5632, "new_tokens": 128},
}


class TokenClock:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def timed_generate(model, input_ids, new_tokens: int) -> dict:
    clock = TokenClock()
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock
        )
    return {
        "ttft_s": clock.times[0] - started,
        "decode_tps": (len(clock.times) - 1) / (clock.times[-1] - clock.times[0]),
        "tokens": output,
    }


def timed_forward(model, input_ids, repeats: int) -> float | None:
    """Tokens/s of a cacheless forward of `input_ids` (median of `repeats`); None with `--forward-repeats 0`."""
    if repeats <= 0:
        return None
    with torch.inference_mode():
        model(input_ids)  # warm-up
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            model(input_ids)
            seconds.append(time.perf_counter() - started)
    return input_ids.numel() / statistics.median(seconds)


def node_counters(url: str) -> dict[str, float]:
    """A node's compute counters from its /metrics (nesa_node/metrics.py `_ComputeCollector`), and on CUDA the device
    memory its process holds (`device_memory_<state>`)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    figures = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total") and not sample.labels:
                figures[sample.name.removeprefix("nesa_node_").removesuffix("_total")] = sample.value
            elif sample.name == "nesa_node_device_memory_bytes":
                figures[f"device_memory_{sample.labels['state']}"] = sample.value
    return figures


def node_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """What a node did between two scrapes: its batched passes, how full they were, how long they waited to gather,
    and where its steps ran; on CUDA, the sessions' steps it captured as graphs and the device memory its process held
    after (reserved, and the peak since start: compare runs with and without --cuda-graphs for what graphs take)."""
    moved = {name: after.get(name, 0.0) - value for name, value in before.items()}
    memory = {
        f"device_{state}_mb": round(after[f"device_memory_{state}"] / 2**20, 1)
        for state in ("reserved", "peak")
        if f"device_memory_{state}" in after
    }
    passes = moved.get("decode_passes", 0.0)
    return {
        "passes": int(passes),
        "steps_a_pass": round(moved.get("decode_pass_steps", 0.0) / passes, 2) if passes else None,
        "gather_waits": int(moved.get("decode_gather_waits", 0.0)),
        "gather_wait_s": round(moved.get("decode_gather_wait_seconds", 0.0), 3),
        "compute_s": round(moved.get("compute_seconds", 0.0), 3),
        "lone_steps": int(moved.get("decode_lone_steps", 0.0)),  # of the inline runs
        "split_passes": int(moved.get("split_passes", 0.0)),
        "single_passes": int(moved.get("single_passes", 0.0)),  # steps given alone, run as passes of one
        "fixed_passes": int(moved.get("fixed_passes", 0.0)),  # of the passes and passes of one: replayed graphs
        "fixed_absent_rows": int(moved.get("fixed_absent_rows", 0.0)),
        "fixed_built": int(moved.get("fixed_batches_built", 0.0)),
        "inline_runs": int(moved.get("inline_steps", 0.0)),
        "thread_runs": int(moved.get("thread_steps", 0.0)),
        "step_graphs_built": int(moved.get("step_graphs_built", 0.0)),
        **memory,
    }


async def aggregate_decode(
    path: str,
    peers: list[str],
    prefix: str,
    hops: int,
    clients: int,
    input_ids,
    new_tokens: int,
    args,
    metrics_urls: list[str] = (),
    node_pids: dict[str, int] | None = None,
) -> dict:
    """Decode tokens/s of one session, then the aggregate of `clients` concurrent ones (prompts of the same length,
    each its own tokens), with one async client; whether every session's tokens match its own run alone. With the
    nodes' `metrics_urls`, what each node did during the concurrent run (`node_figures`). With `--spy DIR` and the
    nodes' `node_pids` (name: pid, in chain order), py-spy's profile of each node and of this client during the
    concurrent run (bench/spy.py; `profile`)."""
    from nesa_node.client.async_model import AsyncDistributedModel

    model = await AsyncDistributedModel.from_pretrained(
        path,
        initial_peers=peers,
        dht_prefix=prefix,
        device=args.device,
        dtype=args.dtype,
        compression="none",
        **dict(args.client_arg),
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(NoRouteError):
                if len((await model.choose_chain(max_length=128)).hops) == hops:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"swarm {prefix} did not come up")
            await asyncio.sleep(0.5)
        top = min(1000, args.vocab - 3)  # prompt ids stay below the vocabulary (3..1002 for the default one)
        prompts = [(input_ids + index) % top + 3 for index in range(clients)]
        # warm-up of the whole length: a --no-batch-decode twin comes here fresh (no chain figures before it), and
        # on a GPU a fresh node's first step at each cache length is slow
        await model.generate(prompts[0], max_new_tokens=new_tokens)
        started = time.perf_counter()
        alone = [await model.generate(prompt, max_new_tokens=new_tokens) for prompt in prompts[:2]]
        one_tps = 2 * new_tokens / (time.perf_counter() - started)
        first_token_s: list[float] = []
        steps: list = []  # every session's one-token steps (StepTiming): where a round's time goes

        async def generate_timed(prompt: torch.Tensor) -> torch.Tensor:
            """`model.generate` on a session of its own (opened and sent ahead as generate does), noting when its
            first token came and keeping the session's step timings."""
            columns = []
            session = await model.open_session(max_length=prompt.shape[1] + new_tokens, prompt_tokens=prompt.shape[1])
            try:
                stream = model.stream(prompt, max_new_tokens=new_tokens, session=session, send_ahead=True)
                async with contextlib.aclosing(stream):
                    async for column in stream:
                        if not columns:
                            first_token_s.append(time.perf_counter() - started)
                        columns.append(column)
                steps.extend(session.timings[1:])
            finally:
                await session.close()
            return torch.cat([prompt, torch.stack(columns, dim=1).to(prompt.dtype)], dim=1)

        before = [await asyncio.to_thread(node_counters, url) for url in metrics_urls]
        spies = Spies(Path(args.spy) / prefix, {**(node_pids or {}), "client": os.getpid()}) if args.spy else None
        with spies or contextlib.nullcontext():
            started = time.perf_counter()
            together = await asyncio.gather(*(generate_timed(prompt) for prompt in prompts))
            aggregate_tps = clients * new_tokens / (time.perf_counter() - started)
        after = [await asyncio.to_thread(node_counters, url) for url in metrics_urls]
        processes = None
        if args.client_processes:
            settings = {
                "peers": peers, "prefix": prefix, "hops": hops, "new_tokens": new_tokens,
                "device": args.device, "dtype": args.dtype,
            }  # fmt: skip
            processes = await asyncio.to_thread(
                processes_decode,
                path,
                [prompt[0].tolist() for prompt in prompts],
                settings,
                Path(args.keep_logs or tempfile.gettempdir()) / f"{prefix}-clients",
            )
    finally:
        await model.close()
    return {
        "nodes": hops,
        "clients": clients,
        "one_session_tps": round(one_tps, 2),
        "aggregate_tps": round(aggregate_tps, 2),
        "aggregate_vs_one": round(aggregate_tps / one_tps, 3),
        # first tokens of the sessions started together, from their start: the prompts' passes at the nodes
        "first_token_ms_median": round(1000 * statistics.median(first_token_s), 1),
        "first_token_ms_last": round(1000 * max(first_token_s), 1),
        # where a session's round goes (a token every clients / aggregate_tps seconds): its step through the nodes
        # (wall, as the client saw it), of which the nodes' compute (all hops: each node's figure is the time of
        # the pass its step ran in), the rest being transfers and waits at the nodes (for a pass, a gathering);
        # what is left of the round is mostly the client's (LM head, its own wait for a shared head pass; the round
        # also spreads each session's opening and prompt over its tokens)
        "round_ms": round(1000 * clients / aggregate_tps, 2),
        "step_wall_ms_p50": round(1000 * percentile([t.wall_s for t in steps], 0.5), 2),
        "step_wall_ms_p90": round(1000 * percentile([t.wall_s for t in steps], 0.9), 2),
        "step_compute_ms_p50": round(1000 * percentile([t.compute_s for t in steps], 0.5), 2),
        "step_compute_ms_p90": round(1000 * percentile([t.compute_s for t in steps], 0.9), 2),
        "tokens_match": all(
            torch.equal(first.cpu(), second.cpu()) for first, second in zip(alone, together[:2], strict=True)
        ),
        # each node in chain order, during the concurrent run (empty where prometheus-client is not installed)
        "nodes_during": [node_figures(b, a) for b, a in zip(before, after, strict=True)],
        **({"profile": spies.summary()} if spies else {}),
        # one client process per session (--client-processes): each its own peer, the sessions' client work on
        # separate cores; tokens_match: every session's tokens equal those of its session in the run above
        **(
            {
                "processes": {
                    **{key: value for key, value in processes.items() if key != "tokens"},
                    "processes_vs_one": round(processes["aggregate_tps"] / one_tps, 3),
                    "tokens_match": all(
                        tokens == session[0, input_ids.shape[1] :].tolist()
                        for tokens, session in zip(processes["tokens"], together, strict=True)
                    ),
                }
            }
            if processes
            else {}
        ),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values) or [float("nan")]
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def client_setting(text: str) -> tuple[str, object]:
    """NAME=VALUE of --client-arg: (name, the value read as JSON, else the text)."""
    from nesa_node.client.config import CONFIG_FIELDS

    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    if name not in CONFIG_FIELDS or name == "compression":  # the --clients run is lossless: tokens are compared
        raise argparse.ArgumentTypeError(f"{name!r} is not a ClientConfig field this run leaves open")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def node_threads(args, count: int) -> int:
    """Torch threads of each of `count` nodes: --node-threads (0: torch's default, all cores; "share": their share of
    this machine's cores)."""
    if args.node_threads == "share":
        return max(1, (os.cpu_count() or 1) // count)
    return int(args.node_threads)


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now (held together while chosen, so none is given twice)."""
    import socket

    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


def start_swarm(group: ProcessGroup, path: str, peers: list[str], prefix: str, count: int, extra: list[str], args):
    """`count` node processes serving the model's blocks in equal spans under `prefix`; (their processes, the URLs
    of their metrics in chain order: none where prometheus-client is not installed)."""
    launched, urls = [], []
    ports = free_ports(count) if importlib.util.find_spec("prometheus_client") is not None else []
    for index, (start, end) in enumerate(split_blocks(args.layers, count)):
        node_args = ["run", "--model", path, "--blocks", f"{start}:{end}", "--initial-peers", *peers]
        if ports:
            node_args += ["--metrics-port", str(ports[index])]
            urls.append(f"http://127.0.0.1:{ports[index]}/metrics")
        node_args += ["--dht-prefix", prefix, "--announce-period", "5", "--no-measure", "--rebalance", "off", *extra]
        node_args += ["--device", args.device, "--dtype", args.dtype]
        node_args += ["--cuda-graphs"] if args.cuda_graphs else []
        node_args += [word for setting in args.node_arg for word in setting.split()]
        node_args += ["--torch-threads", str(node_threads(args, count))] if node_threads(args, count) else []
        launched.append(group.start(f"{prefix}-{index}", node_args))
    for process, node_address in launched:
        group.wait_address(process, node_address, timeout_s=300)
    return [process for process, _ in launched], urls


# chain modes: (client mode, data lanes). direct: hidden states on data lanes (nesa_node.protocol.lane);
# direct-libp2p: the same chain with every message on libp2p (lanes off, as against nodes without them); relay: the
# client forwards between nodes
MODES = {"direct": ("direct", True), "direct-libp2p": ("direct", False), "relay": ("relay", True)}


def chain_figures(
    path, peers, prefix, count, input_ids, batch_ids, reference_tokens, args, metrics_urls=(), single=None, pids=None
) -> dict:
    """Decode, time to first token and forward figures through the swarm `prefix` of `count` nodes, per mode (the
    ratios to the baseline are added by `against`); with the nodes' `metrics_urls`, what each did in the timed
    generations (`node_figures`). With `single` (a timed generation of the single process), each timed generation
    through the swarm follows one of the single process, and the `paired_*` figures are the medians of the pairs'
    ratios and differences: a machine whose speed drifts within seconds moves both sides of a pair alike. With
    `--spy` and the nodes' `pids` (name: pid), each mode's `profile`: py-spy's of two more generations."""
    figures = {}
    for label in args.modes:
        mode, lanes = MODES[label]
        with DistributedModelForCausalLM.from_pretrained(
            path,
            initial_peers=peers,
            dht_prefix=prefix,
            mode=mode,
            compression=args.compression,
            lanes=lanes,
            device=args.device,
            dtype=args.dtype,
        ) as model:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if len(model.choose_chain(max_length=128).hops) == count:
                        break
                except NoRouteError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"swarm of {count} nodes did not come up")
                time.sleep(0.5)
            # the first generation through these nodes (fresh, for the first mode): connections, first-call costs,
            # and on a GPU every cache length seen for the first time
            first = timed_generate(model, input_ids, args.new_tokens)
            runs, overheads, computes, prefills, singles = [], [], [], [], []
            before = [node_counters(url) for url in metrics_urls]
            for _ in range(args.repeats):
                if single is not None:
                    singles.append(single())
                with model.inference_session(max_length=args.prompt_tokens + args.new_tokens) as session:
                    runs.append(timed_generate(model, input_ids, args.new_tokens))
                    overheads += [(t.wall_s - t.compute_s) * 1000 for t in session.timings[1:]]
                    computes += [t.compute_s * 1000 for t in session.timings[1:]]
                    prefills.append(session.timings[0])
            after = [node_counters(url) for url in metrics_urls]
            hops = count + 1 if mode == "direct" else 2 * count  # network transfers per step
            decode = statistics.median(run["decode_tps"] for run in runs)
            forward_tps = timed_forward(model, batch_ids, args.forward_repeats)
            figures[f"{label}_{count}"] = {
                "nodes": count,
                "mode": label,
                "tokens_match": all(torch.equal(run["tokens"].cpu(), reference_tokens) for run in runs),
                "decode_tps": round(decode, 2),
                "first_decode_tps": round(first["decode_tps"], 2),
                "first_vs_later": round(first["decode_tps"] / decode, 3),
                "ttft_ms": round(1000 * statistics.median(run["ttft_s"] for run in runs), 2),
                "forward_8x128_tps": None if forward_tps is None else round(forward_tps, 1),
                # the nodes' own compute time of a decode step, all hops together (its spread shows steps run
                # cold or slowed, apart from the network)
                "step_compute_ms_p50": round(percentile(computes, 0.5), 3),
                "step_compute_ms_p90": round(percentile(computes, 0.9), 3),
                # the prompt's step: its wall time in the session and the nodes' compute in it (the rest of the first
                # token's time is the client's embedding and LM head)
                "prefill_wall_ms": round(1000 * statistics.median(t.wall_s for t in prefills), 2),
                "prefill_compute_ms": round(1000 * statistics.median(t.compute_s for t in prefills), 2),
                "step_overhead_ms_p50": round(percentile(overheads, 0.5), 3),
                "step_overhead_ms_p95": round(percentile(overheads, 0.95), 3),
                "per_hop_overhead_ms_p50": round(percentile(overheads, 0.5) / hops, 3),
                "per_hop_overhead_ms_p95": round(percentile(overheads, 0.95) / hops, 3),
                "nodes_during": [node_figures(b, a) for b, a in zip(before, after, strict=True)],
            }
            if singles:
                pairs = list(zip(singles, runs, strict=True))
                figures[f"{label}_{count}"].update(
                    paired_decode_vs_baseline=round(
                        statistics.median(run["decode_tps"] / alone["decode_tps"] for alone, run in pairs), 3
                    ),
                    paired_ttft_over_baseline_ms=round(
                        1000 * statistics.median(run["ttft_s"] - alone["ttft_s"] for alone, run in pairs), 2
                    ),
                )
            if args.trace:
                figures[f"{label}_{count}"]["trace"] = traced(model, input_ids, args, pids)
            if args.spy:
                spies = Spies(Path(args.spy) / f"{prefix}-{label}", {**(pids or {}), "client": os.getpid()})
                with spies:
                    for _ in range(2):
                        timed_generate(model, input_ids, args.new_tokens)
                figures[f"{label}_{count}"]["profile"] = spies.summary()
    return figures


def traced(model, input_ids, args, pids) -> dict:
    """Where a decode step's time went (bench/trace_summary.py) in two generations, this process marking them."""
    step_trace.start(args.trace)
    since = time.monotonic_ns()
    try:
        for _ in range(2):
            timed_generate(model, input_ids, args.new_tokens)
    finally:
        until = time.monotonic_ns()
        step_trace.stop()
    return summarize_trace(args.trace, {**(pids or {}), "client": os.getpid()}, since, until)


def on_threads(threads: int, function, *args):
    """`function(*args)` on `threads` torch threads (the caller's count restored afterwards)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return function(*args)
    finally:
        torch.set_num_threads(previous)


def measure_baseline(model, on_device, batch_ids, threads: int, args) -> dict:
    """Single-process decode tokens/s, time to first token and forward tokens/s on `threads` torch threads (the
    caller's thread count is restored afterwards)."""
    return on_threads(threads, _baseline, model, on_device, batch_ids, args)


def _baseline(model, on_device, batch_ids, args) -> dict:
    timed_generate(model, on_device, 8)  # warm-up: the swarm's figures are taken warm too
    runs = [timed_generate(model, on_device, args.new_tokens) for _ in range(args.repeats)]
    return {
        "decode_tps": statistics.median(run["decode_tps"] for run in runs),
        "ttft_ms": 1000 * statistics.median(run["ttft_s"] for run in runs),
        "forward_8x128_tps": timed_forward(model, batch_ids.to(args.device), args.forward_repeats),
        "tokens": runs[0]["tokens"].cpu(),
    }


def against(figures: dict, before: dict, after: dict) -> dict:
    """`figures` of one swarm with their ratios to the single process measured just before and just after it (the
    mean of the two), so a machine that speeds up or slows down during the run moves both sides alike."""
    decode = (before["decode_tps"] + after["decode_tps"]) / 2
    forwards = (before["forward_8x128_tps"], after["forward_8x128_tps"], figures["forward_8x128_tps"])
    forward = None if None in forwards else figures["forward_8x128_tps"] / ((forwards[0] + forwards[1]) / 2)
    ttft = (before["ttft_ms"] + after["ttft_ms"]) / 2
    return {
        **figures,
        "decode_vs_baseline": round(figures["decode_tps"] / decode, 3),
        "forward_vs_baseline": None if forward is None else round(forward, 3),  # None: --forward-repeats 0
        "ttft_over_baseline_ms": round(figures["ttft_ms"] - ttft, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench", help="model shape (default: bench)")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: the shape's)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: the shape's)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: the shape's (64, 128 for 1.1b)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where everything computes")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="nodes replay one-token steps as CUDA graphs (--device cuda)"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=tuple(MODES),
        default=list(MODES),
        help="chain modes to measure, in this order (the first runs through fresh nodes): direct (data lanes), "
        "direct-libp2p (every message on libp2p), relay (the client forwards between nodes); default all three",
    )
    parser.add_argument(
        "--node-arg",
        action="append",
        default=[],
        metavar="SETTING",
        help="more `nesa-node run` arguments for every node, e.g. --node-arg='--inline-compute-ms 0' (repeatable)",
    )
    parser.add_argument(
        "--client-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        type=client_setting,
        help="a ClientConfig field of the --clients run's client (one process), e.g. --client-arg head_waves=3 "
        "(repeatable; the value is read as JSON, else as text)",
    )
    parser.add_argument(
        "--spy",
        metavar="DIR",
        default=None,
        help="py-spy profiles of every node and the client, raw into DIR/PREFIX[-MODE]/ and summed up in the JSON's "
        "`profile`: of each chain mode's two generations after its timed ones, and with --clients of the concurrent "
        "run (needs py-spy)",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="step marks of every node and the client (nesa_node/step_trace.py) into DIR, and in the JSON's `trace`, "
        "per chain mode, the medians of where a decode step's time went (bench/trace_summary.py) over two generations "
        "after its timed ones; the nodes mark from their start (a few microseconds a mark)",
    )
    parser.add_argument(
        "--keep-logs", metavar="DIR", default=None, help="copy every node's log to DIR (kept after the run)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    # a forward of 8 x 128 tokens takes about 0.5 s of compute: its median needs more samples on a noisy machine
    parser.add_argument("--forward-repeats", type=int, default=5)
    parser.add_argument(
        "--no-paired",
        action="store_true",
        help="no single-process generation before each timed one through the swarm (no `paired_*` figures; "
        "shorter, where the machine's speed holds steady)",
    )
    parser.add_argument("--compression", default="none", help="hidden-state codec (default none: a lossless wire)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--node-threads",
        type=lambda text: text if text == "share" else int(text),
        default=0,
        help="torch threads per node process (default 0: torch's default, all cores; share: the cores over the nodes)",
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=0,
        help="concurrent sessions for the aggregate figure (0: none); they are one peer to the nodes, which lend it "
        "cache past its share while nobody else needs it: clients x (prompt + new tokens) must fit a node's cache "
        "(8192 tokens by default; more with --node-arg=--max-cache-tokens=N)",
    )
    parser.add_argument(
        "--client-processes",
        action="store_true",
        help="with --clients N: also N client processes, one session each, started together (N users each with "
        "their own client, against the one process of a gateway); their figure is under `processes`",
    )
    parser.add_argument(
        "--clients-only",
        action="store_true",
        help="with --clients: only the concurrent figures through batching nodes (no chain figures, no "
        "--no-batch-decode twin; a short run to compare node settings)",
    )
    parser.add_argument(
        "--client-threads",
        type=int,
        default=0,
        help="torch threads of this process once the single-process baseline is measured: the swarm's client "
        "(embeddings, LM head) shares the cores with the nodes (default 0: leave torch's default, all cores)",
    )
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    args.layers = args.layers or shape["layers"]
    args.hidden = args.hidden or shape["hidden"]
    args.new_tokens = args.new_tokens or shape["new_tokens"]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.vocab < 16:
        parser.error("--vocab must be at least 16")
    if args.cuda_graphs and args.device != "cuda":
        parser.error("--cuda-graphs needs --device cuda")
    # a SIGTERM (a step's `timeout` in bench/gpu.sh) unwinds like Ctrl-C: the nodes this run started are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory(prefix="nesa-bench-") as workdir, ProcessGroup(workdir) as group:
        heads = shape["heads"]
        spec = TinyModelSpec(
            layers=args.layers,
            hidden=args.hidden,
            heads=heads,
            kv_heads=shape["kv_heads"],
            intermediate=shape["intermediate"] if args.hidden == shape["hidden"] else int(args.hidden * 2.75),
            vocab=args.vocab,
            seed=0,
        )
        path = str(init_tiny_model(Path(workdir) / "bench-llama", spec))
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, args.dtype)
        # kept for the measurements after each swarm (on a GPU it holds its weights there meanwhile: 2.2 GB of the
        # 1.1B shape in bfloat16)
        baseline_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device)
        baseline_model.eval()
        top = min(1000, args.vocab)  # token ids 3..top-1: inside a small --vocab too
        input_ids = torch.randint(3, top, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
        batch_ids = torch.randint(3, top, (8, 128), generator=torch.Generator().manual_seed(1))

        on_device = input_ids.to(args.device)
        baseline_threads = torch.get_num_threads()
        baselines = [measure_baseline(baseline_model, on_device, batch_ids, baseline_threads, args)]
        reference_tokens = baselines[0]["tokens"]
        if args.client_threads:
            torch.set_num_threads(args.client_threads)

        if args.trace:  # the nodes started from here on mark from their start
            os.environ[step_trace.ENV] = str(Path(args.trace).resolve())
        bootstrap, address_file = group.start("dht", ["dht"])
        peers = group.wait_address(bootstrap, address_file)
        swarms = [(count, f"bench-{count}", []) for count in args.nodes]
        if args.clients and not args.clients_only:
            swarms += [(count, f"bench-{count}-nobatch", ["--no-batch-decode"]) for count in args.nodes]
        swarm_results, clients_results = {}, {}
        for count, prefix, extra in swarms:  # one swarm at a time: no idle node shares the cores with the measured
            nodes, metrics_urls = start_swarm(group, path, peers, prefix, count, extra, args)
            figures = {}
            try:
                if not extra and not (args.clients and args.clients_only):
                    single = (
                        None
                        if args.no_paired
                        else functools.partial(
                            on_threads, baseline_threads, timed_generate, baseline_model, on_device, args.new_tokens
                        )
                    )
                    pids = {f"node{index}": process.pid for index, process in enumerate(nodes)}
                    inputs = (input_ids, batch_ids, reference_tokens)
                    figures = chain_figures(path, peers, prefix, count, *inputs, args, metrics_urls, single, pids)
                if args.clients:
                    # on the event loop a gateway runs (uvloop where installed)
                    clients_results[f"{'no_batch' if extra else 'batch'}_{count}"] = event_loop.run(
                        aggregate_decode(
                            path,
                            peers,
                            prefix,
                            count,
                            args.clients,
                            input_ids,
                            args.new_tokens,
                            args,
                            metrics_urls,
                            {f"node{index}": process.pid for index, process in enumerate(nodes)},
                        )
                    )
            finally:
                for process in nodes:
                    group.stop(process)
                if args.keep_logs:  # the node logs live in the run's temporary folder, gone at its end
                    Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                    for process in nodes:
                        with contextlib.suppress(OSError):
                            shutil.copy(group.log_path(process), Path(args.keep_logs) / group.log_path(process).name)
            if figures:  # the single process again, now that the nodes are gone, for the ratios of this swarm
                baselines.append(measure_baseline(baseline_model, on_device, batch_ids, baseline_threads, args))
                for key, value in figures.items():
                    swarm_results[key] = against(value, baselines[-2], baselines[-1])
    result = {
        "bench": "inference",
        "model": {
            "arch": "llama",
            "shape": args.shape,
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": spec.heads,
            "kv_heads": spec.kv_heads,
            "vocab": args.vocab,
        },
        "device": args.device,
        "dtype": args.dtype,
        "cuda_graphs": args.cuda_graphs,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "compression": args.compression,
        "node_threads": {count: node_threads(args, count) for count in args.nodes},
        "node_args": args.node_arg,
        "client_args": dict(args.client_arg),
        "baseline_threads": baseline_threads,
        "client_threads": torch.get_num_threads(),
        # the single process, measured before the first swarm and after each one (ratios use the two around a swarm)
        "baseline": {
            key: round(statistics.median(measured[key] for measured in baselines), 2)
            for key in ("decode_tps", "ttft_ms", "forward_8x128_tps")
            if all(measured[key] is not None for measured in baselines)
        },
        "baseline_decode_tps_runs": [round(measured["decode_tps"], 2) for measured in baselines],
        "swarm": swarm_results,
        "clients": clients_results,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
