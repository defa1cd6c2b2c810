"""LoRA serving benchmark: what adapters cost the swarm, against the base model in the same run.

A bootstrap and `--nodes` nodes run as processes on this machine, each preloading `--adapters` random rank-`--rank`
adapters on every projection (made with peft, saved with save_pretrained). One async client (one P2P host, as a
gateway) measures, alternating so that drift in the machine's speed hits both sides alike:

- decode tokens/s of one session with an adapter against one without (target >= 0.85x);
- aggregate decode tokens/s of `--sessions` concurrent sessions each with a different adapter against the same
  sessions all on one adapter (target >= 0.8x): nodes batch their decode steps whatever the adapters;
- time to first token with an adapter no node holds (the client sends each node its blocks, in parallel) against
  one the nodes preloaded (target: at most 0.5 s more).

One JSON line. A GPU machine: --device cuda --dtype bfloat16 (nodes and client).

    python bench/lora.py [--nodes 2] [--layers 8] [--hidden 512] [--rank 16] [--adapters 8] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node.devtools.launcher import ProcessGroup, split_blocks  # noqa: E402
from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model  # noqa: E402
from nesa_node.errors import NoRouteError  # noqa: E402

PREFIX = "bench-lora"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_path: str, root: Path, count: int, rank: int) -> list[Path]:
    import peft
    from transformers import AutoModelForCausalLM

    folders = []
    for index in range(count):
        base = AutoModelForCausalLM.from_pretrained(model_path)
        torch.manual_seed(100 + index)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        folder = root / f"adapter-{index}"
        peft.get_peft_model(base, config).save_pretrained(folder)
        folders.append(folder)
    return folders


async def decode_tps(model, prompt: torch.Tensor, new_tokens: int, adapter: str | None) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s after it) of one generation."""
    started = time.perf_counter()
    times = []
    async for _ in model.stream(prompt, max_new_tokens=new_tokens, adapter=adapter):
        times.append(time.perf_counter())
    return times[0] - started, (len(times) - 1) / (times[-1] - times[0])


async def aggregate_tps(model, prompts: list[torch.Tensor], new_tokens: int, adapters: list[str | None]) -> float:
    started = time.perf_counter()
    await asyncio.gather(
        *(model.generate(prompt, max_new_tokens=new_tokens, adapter=adapter) for prompt, adapter in zip(prompts, adapters, strict=True))
    )  # fmt: skip
    return len(prompts) * new_tokens / (time.perf_counter() - started)


async def measure(args, path: str, peers: list[str], names: list[str], cold: list[Path]) -> dict:
    from nesa_node.client.async_model import AsyncDistributedModel

    model = await AsyncDistributedModel.from_pretrained(
        path, initial_peers=peers, dht_prefix=PREFIX, compression="none", dtype=args.dtype, device=args.device
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # every node up, each adapter announced
            with contextlib.suppress(NoRouteError):
                chain = await model.choose_chain(max_length=128, adapter=await model.adapter_by_name(names[-1]))
                if len(chain.hops) == args.nodes:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the swarm did not come up with its adapters")
            await asyncio.sleep(0.5)
        ids = [await model.adapter_by_name(name) for name in names]
        prompt = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
        prompts = [(prompt + index) % 1000 + 3 for index in range(args.sessions)]
        await decode_tps(model, prompt, 8, None)  # warm-up, each path once
        await decode_tps(model, prompt, 8, ids[0])
        base, adapted = [], []
        for _ in range(args.repeats):
            base.append(await decode_tps(model, prompt, args.new_tokens, None))
            adapted.append(await decode_tps(model, prompt, args.new_tokens, ids[0]))
        one_adapter, many_adapters = [], []
        for _ in range(args.repeats):
            one_adapter.append(await aggregate_tps(model, prompts, args.new_tokens, [ids[0]] * args.sessions))
            mixed = [ids[index % len(ids)] for index in range(args.sessions)]
            many_adapters.append(await aggregate_tps(model, prompts, args.new_tokens, mixed))
        cold_ttft, warm_ttft = [], []
        for folder in cold:  # each adapter sent once: a second session would find it gone again (client-private)
            warm_ttft.append((await decode_tps(model, prompt, 4, ids[0]))[0])
            cold_ttft.append((await decode_tps(model, prompt, 4, str(folder)))[0])
    finally:
        await model.close()
    base_tps = statistics.median(tps for _, tps in base)
    adapter_tps = statistics.median(tps for _, tps in adapted)
    one, many = statistics.median(one_adapter), statistics.median(many_adapters)
    return {
        "base_decode_tps": round(base_tps, 2),
        "adapter_decode_tps": round(adapter_tps, 2),
        "adapter_vs_base": round(adapter_tps / base_tps, 3),
        "sessions": args.sessions,
        "one_adapter_aggregate_tps": round(one, 2),
        "many_adapters_aggregate_tps": round(many, 2),
        "many_vs_one_adapter": round(many / one, 3),
        "preloaded_ttft_ms_p50": round(1000 * statistics.median(warm_ttft), 2),
        "cold_ttft_ms_p50": round(1000 * statistics.median(cold_ttft), 2),
        "cold_fetch_added_ms": round(1000 * (statistics.median(cold_ttft) - statistics.median(warm_ttft)), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8, help="adapters every node preloads")
    parser.add_argument("--sessions", type=int, default=8, help="concurrent sessions of the aggregate figures")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", type=int, default=3, help="adapters no node holds, sent by the client")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nesa-bench-") as workdir, ProcessGroup(workdir) as group:
        spec = TinyModelSpec(layers=args.layers, hidden=args.hidden, heads=8, kv_heads=8,
                             intermediate=int(args.hidden * 2.75), seed=0)  # fmt: skip
        path = str(init_tiny_model(Path(workdir) / "bench-llama", spec))
        folders = make_adapters(path, Path(workdir), args.adapters + args.cold, args.rank)
        preloaded, cold = folders[: args.adapters], folders[args.adapters :]
        bootstrap, address_file = group.start("dht", ["dht"])
        peers = group.wait_address(bootstrap, address_file)
        launched = []
        for index, (start, end) in enumerate(split_blocks(args.layers, args.nodes)):
            node_args = ["run", "--model", path, "--blocks", f"{start}:{end}", "--initial-peers", *peers]
            node_args += ["--dht-prefix", PREFIX, "--no-measure", "--rebalance", "off", "--device", args.device]
            node_args += ["--dtype", args.dtype, "--announce-period", "2", "--adapters", *map(str, preloaded)]
            launched.append(group.start(f"node-{index}", node_args))
        for process, node_address in launched:
            group.wait_address(process, node_address, timeout_s=300)
        names = [folder.name for folder in preloaded]
        figures = asyncio.run(measure(args, path, peers, names, cold))
    print(json.dumps({"bench": "lora", "nodes": args.nodes, "rank": args.rank, "new_tokens": args.new_tokens,
                      "device": args.device, "dtype": args.dtype, **figures}))  # fmt: skip


if __name__ == "__main__":
    main()
