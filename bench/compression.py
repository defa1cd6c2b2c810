"""Codec benchmark: speed, bytes on the wire and error of each hidden-state codec.

Prints one JSON line. For each tensor shape and codec: encode and decode throughput (GB/s of input), median times,
(encode + decode) time as a ratio to `torch.clone` of the same tensor measured in the same run, payload bytes, and the
max / mean absolute error on a seeded randn tensor and on a heavy-tailed one (randn with a few outliers x20, as in LLM
activations). Absolute timings on a shared machine drift, so every repeat times the clone and each codec's encode and
decode in turn, and the ratio is the median over repeats of that repeat's round trip over its clone. On a GPU every
codec computes on the device and its payload bytes go to the host (the wire) and back, so the table also gives each
codec's round trip against that copy of its payload alone ("roundtrip_vs_host_copy"): what the codec costs beyond
the transfer any codec pays (a 16 MiB copy over PCIe alone is some twenty device clones of it). On every device the
codec's own round trip, its payload kept on the device (`encode_on_device`, then `decode` of that payload: no way
out, as between two spans in one process), is timed in the same repeats: "device_roundtrip_ms" and
"device_roundtrip_vs_clone". Beside them, "blockwise8_kernels": that round trip's kernels called directly, fused
(the default on a GPU: compression/quantize.py) and not, each against the clone of the same repeats, with the aten
operations each dispatches (about one kernel launch each on a GPU).

Every operation timed allocates its result, so the allocator's state decides much of a 16 MB clone's time: glibc
serves a fresh block from new pages (a page fault each 4 KiB: about 4 ms here) or reuses freed memory (about 1 ms),
and which one depends on its adaptive mmap threshold and heap trimming, so the clone's time, and with it every ratio,
jumped between runs by up to 4x. The codec table therefore sets the mmap threshold to 32 MiB (glibc's maximum) and
turns off trimming: memory is reused, as in a long-running node past its first steps, for the baseline and the
codecs alike. The JSON says whether that was applied ("allocator").

Then, unless --no-swarm, the swarm section: the trained tiny model (`nesa-node model train-tiny`, cached) served by
3 node processes on loopback; per codec, decode tokens/s of a 64-token greedy generation (median of --swarm-repeats),
bytes per decoded token over all 4 transfers of a direct chain, the transfer time those bytes cost on a 100 Mbit/s
link (and saved against "none"), the same for a 4096-wide model, and the accuracy table (top-1 agreement, held-out
perplexity) of nesa_node.devtools.evaluation.

    python bench/compression.py [--repeats 20] [--seed 0] [--device cpu] [--threads N] [--no-swarm]

On a CPU shared with other work, --threads 1 avoids stalls of torch's thread pool that swamp the kernels' cost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node.compression.codec import (  # noqa: E402
    CODECS,
    _extremes,
    decode,
    encode,
    encode_on_device,
    wire_bytes,
)
from nesa_node.compression.quantize import dequantize_linear_into, quantize_linear_into  # noqa: E402
from nesa_node.devtools.allocator import steady_allocator  # noqa: E402

LINK_BITS_PER_S = 100e6  # the simulated 100 Mbit/s link
WIDE_HIDDEN = 4096  # hidden size of a 7B-class model, for the computed transfer times

SHAPES = {"8x128x4096": (8, 128, 4096), "1x1x4096": (1, 1, 4096)}  # a prefill chunk and one decode step of a 7B
OUTLIER_FRACTION = 1e-3  # share of elements scaled x20: a few outlier features per token (guess)
OUTLIER_FACTOR = 20.0


def _seconds(run: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _interleaved_seconds(runs: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict:
    """Per name, the list of its `repeats` timings; within each repeat every run goes once, in turn, so a drift of
    the machine (another process, a frequency change) hits the baseline and the codecs alike."""
    for run in runs.values():
        run()  # warm-up: lookup tables, allocator
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            seconds[name].append(_seconds(run, device))
    return seconds


def _host_round_trip(wire: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The payload's bytes to the host and back: what any codec's round trip through the wire pays at least."""
    return wire.cpu().to(device)


def _device_round_trip(tensor: torch.Tensor, codec: str, device: torch.device) -> torch.Tensor:
    """Encode with the payload kept on the tensor's device, and decode it there."""
    return decode(encode_on_device(tensor, codec), device=device)


def _linear_kernels(tensor: torch.Tensor, fused: bool) -> torch.Tensor:
    """The blockwise8 device round trip's work (encode into scales and codes, the decoder's checks of them, decode),
    with the codec's kernels `fused` or not: the two ways compared in one run (`blockwise8_kernels`)."""
    blocks = tensor.reshape(-1, 64)  # (blocks, 64): every shape here is whole blocks of the default size
    scales = torch.empty(blocks.shape[0], dtype=torch.float32, device=tensor.device)
    codes = torch.empty(blocks.shape, dtype=torch.int8, device=tensor.device)
    quantize_linear_into(blocks, scales, codes, fused=fused)
    _extremes(scales, codes, fused=fused)
    return dequantize_linear_into(codes, scales, torch.empty(blocks.shape, device=tensor.device), fused=fused)


# operations that only allocate or view memory: no kernel runs for them
_NO_KERNEL = {"empty", "empty_strided", "view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "alias"}
_NO_KERNEL |= {"detach", "reshape", "_reshape_alias", "as_strided", "expand", "t", "transpose", "split", "lift_fresh"}


def _dispatched_ops(run: Callable[[], object]) -> int:
    """How many aten operations `run` dispatches that compute (not those that only allocate or view memory): on a
    GPU one kernel launch each; reads of a value back to the host (`.item()`, `.tolist()`) are not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _NO_KERNEL | {"_local_scalar_dense"}:
                Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return Count.ops


def _inputs(shape: tuple[int, ...], seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(shape, generator=generator)  # (*shape,)
    heavy = gaussian.clone().view(-1)
    count = max(1, int(heavy.numel() * OUTLIER_FRACTION))
    heavy[torch.randperm(heavy.numel(), generator=generator)[:count]] *= OUTLIER_FACTOR
    return {"randn": gaussian.to(device), "outliers": heavy.view(shape).to(device)}


def _errors(tensor: torch.Tensor, codec: str, device: torch.device) -> dict[str, float]:
    decoded = decode(encode(tensor, codec), device=device).to(torch.float32)
    error = (decoded - tensor.to(torch.float32)).abs()
    return {
        "max_abs_error": float(error.max()),
        "mean_abs_error": float(error.mean()),
        "relative_rms_error": float(error.norm() / tensor.to(torch.float32).norm()),
    }


def codec_table(seed: int = 0, repeats: int = 20, device: str = "cpu") -> dict:
    """Per shape and codec: throughput, times, ratio to clone, bytes on the wire and errors (see module docstring)."""
    target = torch.device(device)
    table: dict = {
        "allocator": steady_allocator(),
        "device": str(target),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seed": seed,
        "repeats": repeats,
        "outliers": {"fraction": OUTLIER_FRACTION, "factor": OUTLIER_FACTOR},
        "shapes": {},
    }
    for label, shape in SHAPES.items():
        inputs = _inputs(shape, seed, target)
        tensor = inputs["randn"]
        input_bytes = tensor.numel() * tensor.element_size()
        encoded = {codec: encode(tensor, codec) for codec in CODECS}
        runs: dict[str, Callable[[], object]] = {"clone": tensor.clone}
        for codec in CODECS:
            runs[f"encode {codec}"] = partial(encode, tensor, codec)
            runs[f"decode {codec}"] = partial(decode, encoded[codec], device=target)
            runs[f"device {codec}"] = partial(_device_round_trip, tensor, codec, target)
        for fused in (True, False):
            runs[f"kernels fused={fused}"] = partial(_linear_kernels, tensor, fused)
        if target.type != "cpu":  # the floor of any codec whose bytes leave the device: their way out and back
            for codec in CODECS:
                wire = torch.empty(len(encoded[codec].payload), dtype=torch.uint8, device=target)
                runs[f"host copy {codec}"] = partial(_host_round_trip, wire, target)
        seconds = _interleaved_seconds(runs, repeats, target)
        clone_s = statistics.median(seconds["clone"])
        row: dict = {"input_bytes": input_bytes, "clone_ms": clone_s * 1e3, "codecs": {}}
        for codec in CODECS:
            encode_s = statistics.median(seconds[f"encode {codec}"])
            decode_s = statistics.median(seconds[f"decode {codec}"])
            # the ratio of each repeat's round trip to that repeat's clone, then the median of those ratios
            paired = [
                (encode_time + decode_time) / clone_time
                for encode_time, decode_time, clone_time in zip(
                    seconds[f"encode {codec}"], seconds[f"decode {codec}"], seconds["clone"], strict=True
                )
            ]
            device_s = statistics.median(seconds[f"device {codec}"])
            device_paired = [
                round_trip / clone_time
                for round_trip, clone_time in zip(seconds[f"device {codec}"], seconds["clone"], strict=True)
            ]
            row["codecs"][codec] = {
                "encode_gbps": input_bytes / encode_s / 1e9,
                "decode_gbps": input_bytes / decode_s / 1e9,
                "encode_ms": encode_s * 1e3,
                "decode_ms": decode_s * 1e3,
                "roundtrip_ms": (encode_s + decode_s) * 1e3,
                "roundtrip_vs_clone": statistics.median(paired),
                "device_roundtrip_ms": device_s * 1e3,
                "device_roundtrip_vs_clone": statistics.median(device_paired),
                "wire_bytes": len(encoded[codec].payload),
                "compression": input_bytes / len(encoded[codec].payload),
                **{kind: _errors(values, codec, target) for kind, values in inputs.items()},
            }
            if f"host copy {codec}" in seconds:
                copy_s = statistics.median(seconds[f"host copy {codec}"])
                row["codecs"][codec]["host_copy_ms"] = copy_s * 1e3
                row["codecs"][codec]["roundtrip_vs_host_copy"] = (encode_s + decode_s) / copy_s
        row["blockwise8_kernels"] = {
            f"{'fused' if fused else 'unfused'}_{what}": value
            for fused in (True, False)
            for what, value in (
                (
                    "vs_clone",
                    statistics.median(
                        run / clone_time
                        for run, clone_time in zip(seconds[f"kernels fused={fused}"], seconds["clone"], strict=True)
                    ),
                ),
                ("ops", _dispatched_ops(partial(_linear_kernels, tensor, fused))),
            )
        }
        table["shapes"][label] = row
    return table


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value


def swarm_table(*, nodes: int = 3, new_tokens: int = 64, repeats: int = 5) -> dict:
    """Decode speed, bytes and accuracy per codec through `nodes` node processes serving the trained tiny model."""
    from transformers import AutoTokenizer

    from nesa_node.client.model import DistributedModelForCausalLM
    from nesa_node.devtools.evaluation import accuracy_row, greedy_continuations
    from nesa_node.devtools.launcher import ProcessGroup, split_blocks
    from nesa_node.devtools.tiny_train import heldout_token_windows, train_tiny_model
    from nesa_node.errors import NoRouteError

    path = str(train_tiny_model(progress=False).path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = heldout_token_windows(tokenizer, 24, 20)
    windows = heldout_token_windows(tokenizer, 128, 32)
    layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
    hidden = json.loads((Path(path) / "config.json").read_text())["hidden_size"]
    transfers = nodes + 1  # client -> first node -> ... -> last node -> client
    table: dict = {"model": {"layers": layers, "hidden": hidden}, "nodes": nodes, "new_tokens": new_tokens}
    with ProcessGroup() as group:
        bootstrap, address_file = group.start("dht", ["dht"])
        peers = group.wait_address(bootstrap, address_file)
        launched = []
        for index, (start, end) in enumerate(split_blocks(layers, nodes)):
            node_args = ["run", "--model", path, "--blocks", f"{start}:{end}", "--initial-peers", *peers]
            launched.append(group.start(f"node{index}", node_args + ["--no-measure", "--dht-prefix", "bench-codec"]))
        for process, node_address in launched:
            group.wait_address(process, node_address, timeout_s=300)
        with contextlib.ExitStack() as stack:
            models = {
                codec: stack.enter_context(
                    DistributedModelForCausalLM.from_pretrained(
                        path, initial_peers=peers, dht_prefix="bench-codec", compression=codec
                    )
                )
                for codec in CODECS
            }
            deadline = time.monotonic() + 120
            while True:
                try:
                    if len(models["none"].choose_chain(max_length=256).hops) == nodes:
                        break
                except NoRouteError:
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.5)
            continuations = greedy_continuations(models["none"], prompts, 32)
            accuracy, reference = {}, None
            for codec, model in models.items():  # "none" first: the reference
                accuracy[codec] = accuracy_row(codec, model, prompts, continuations, windows, reference)
                reference = reference if reference is not None else accuracy[codec].perplexity
            # codecs take turns within each repeat, so drifts of a shared machine hit them alike
            speeds: dict[str, list[float]] = {codec: [] for codec in CODECS}
            for repeat in range(repeats + 1):  # the first round warms up
                for codec, model in models.items():
                    with torch.inference_mode(), model.inference_session(max_length=24 + new_tokens) as session:
                        started = time.perf_counter()
                        model.generate(
                            prompts[repeat % len(prompts)][None],
                            max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens,
                            do_sample=False,
                        )
                        # decode time: the whole generation less its first (prompt) step
                        decode_s = time.perf_counter() - started - session.timings[0].wall_s
                    if repeat:
                        speeds[codec].append((len(session.timings) - 1) / decode_s)
        rows = {}
        for codec in CODECS:
            client_bytes = accuracy[codec].bytes_per_token  # client -> first node, and last node -> client
            total_bytes = client_bytes * transfers / 2  # every transfer carries one token's hidden states
            wide_bytes = transfers * (wire_bytes(codec, (1, 1, WIDE_HIDDEN)) + 80)  # + ids and metadata
            rows[codec] = {
                **accuracy[codec].as_dict(),
                "decode_tps": statistics.median(speeds[codec]),
                "bytes_per_token_all_hops": total_bytes,
                "link_ms_per_token_100mbit": total_bytes * 8 / LINK_BITS_PER_S * 1000,
                "hidden4096_link_ms_per_token_100mbit": wide_bytes * 8 / LINK_BITS_PER_S * 1000,
            }
    for row in rows.values():
        row["link_ms_saved_100mbit"] = rows["none"]["link_ms_per_token_100mbit"] - row["link_ms_per_token_100mbit"]
        row["hidden4096_link_ms_saved_100mbit"] = (
            rows["none"]["hidden4096_link_ms_per_token_100mbit"] - row["hidden4096_link_ms_per_token_100mbit"]
        )
        row["decode_vs_none"] = row["decode_tps"] / rows["none"]["decode_tps"]
    table["codecs"] = rows
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--no-swarm", action="store_true", help="codec kernels only, no swarm section")
    parser.add_argument("--swarm-repeats", type=int, default=5, help="generations timed per codec")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = {"bench": "compression", "codecs": codec_table(seed=args.seed, repeats=args.repeats, device=args.device)}
    if not args.no_swarm:
        result["swarm"] = swarm_table(repeats=args.swarm_repeats)
    print(json.dumps(_rounded(result)))


if __name__ == "__main__":
    main()
