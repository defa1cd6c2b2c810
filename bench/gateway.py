"""Gateway benchmark: what the OpenAI-compatible gateway adds over the SDK, and concurrent streams.

A bootstrap, `--nodes` nodes and a gateway run as processes on this machine; the same requests go once through the
async SDK in this process and once through the gateway with the official `openai` client (streaming, temperature 0,
lossless wire). Reports time to first token and time per token (p50) for both and their differences, then
`--concurrent` streaming requests at once through the gateway, each checked against its own SDK tokens. One JSON
line.

    python bench/gateway.py [--nodes 2] [--requests 20] [--new-tokens 32] [--concurrent 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node.client.async_model import AsyncDistributedModel  # noqa: E402
from nesa_node.devtools.launcher import ProcessGroup, split_blocks  # noqa: E402
from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model  # noqa: E402

PROMPTS = ["import os", "def main(", "Beautiful is better", "class Node:", "for item in", "return the"]


async def sdk_run(model, tokenizer, prompt: str, new_tokens: int) -> tuple[float, float, list[int]]:
    """(seconds to the first token, seconds per later token, the tokens) through the SDK."""
    import torch

    ids = torch.tensor([tokenizer(prompt).input_ids])
    started = time.perf_counter()
    times, tokens = [], []
    async for column in model.stream(ids, max_new_tokens=new_tokens, eos_token_id=None):
        times.append(time.perf_counter())
        tokens.append(int(column[0]))
    return times[0] - started, (times[-1] - times[0]) / max(len(times) - 1, 1), tokens


async def gateway_run(client, name: str, prompt: str, new_tokens: int) -> tuple[float, float, str]:
    """(seconds to the first text, seconds per later token, the text) through the gateway, streamed. A token whose
    bytes end inside a character sends no text of its own, so chunks are fewer than tokens: the time per token is
    (last token's chunk - first text) / (tokens after the first), the token count from the usage chunk."""
    started = time.perf_counter()
    first = last = None
    pieces, tokens = [], 0
    stream = await client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=new_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].text)
        if chunk.choices and chunk.choices[0].finish_reason:  # sent right after the last token
            last = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first - started, (last - first) / max(tokens - 1, 1), "".join(pieces)


async def measure(args, path: str, peers: list[str], url: str) -> dict:
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = await AsyncDistributedModel.from_pretrained(
        path, initial_peers=peers, dht_prefix="bench-gateway", compression="none"
    )
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    name = Path(path).name
    try:
        await sdk_run(model, tokenizer, PROMPTS[0], 4)  # warm-up: connections, first-call costs
        await gateway_run(client, name, PROMPTS[0], 4)
        # timed prompts: those whose first new token is text of its own (a token ending inside a character sends no
        # text until the next one, which would shift the gateway's first-text time by a token)
        timed = []
        for prompt in PROMPTS:
            _, _, tokens = await sdk_run(model, tokenizer, prompt, 1)
            if tokenizer.decode(tokens[:1]).strip("\ufffd"):
                timed.append(prompt)
        sdk, gateway, expected = [], [], {}
        for index in range(args.requests):  # alternating, so drift in the machine's speed hits both alike
            prompt = timed[index % len(timed)]
            ttft, per_token, tokens = await sdk_run(model, tokenizer, prompt, args.new_tokens)
            sdk.append((ttft, per_token))
            expected[prompt] = tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            ttft, per_token, _ = await gateway_run(client, name, prompt, args.new_tokens)
            gateway.append((ttft, per_token))
        prompts = [timed[index % len(timed)] for index in range(args.concurrent)]
        started = time.perf_counter()
        results = await asyncio.gather(*(gateway_run(client, name, prompt, args.new_tokens) for prompt in prompts))
        concurrent_s = time.perf_counter() - started
    finally:
        await client.close()
        await model.close()

    def p50_ms(values):
        return round(1000 * statistics.median(values), 3)

    figures = {
        "timed_prompts": len(timed),
        "sdk_ttft_ms_p50": p50_ms([ttft for ttft, _ in sdk]),
        "gateway_ttft_ms_p50": p50_ms([ttft for ttft, _ in gateway]),
        "sdk_per_token_ms_p50": p50_ms([per for _, per in sdk]),
        "gateway_per_token_ms_p50": p50_ms([per for _, per in gateway]),
    }
    figures["ttft_added_ms"] = round(figures["gateway_ttft_ms_p50"] - figures["sdk_ttft_ms_p50"], 3)
    figures["per_token_added_ms"] = round(figures["gateway_per_token_ms_p50"] - figures["sdk_per_token_ms_p50"], 3)
    figures["concurrent"] = {
        "streams": args.concurrent,
        "all_match_sdk_tokens": all(
            text == expected[prompt] for prompt, (_, _, text) in zip(prompts, results, strict=True)
        ),
        "aggregate_tokens_per_s": round(args.concurrent * args.new_tokens / concurrent_s, 1),
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--concurrent", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nesa-bench-") as workdir, ProcessGroup(workdir) as group:
        spec = TinyModelSpec(layers=args.layers, hidden=args.hidden, heads=8, kv_heads=8,
                             intermediate=int(args.hidden * 2.75), seed=0)  # fmt: skip
        path = str(init_tiny_model(Path(workdir) / "bench-llama", spec))
        bootstrap, address_file = group.start("dht", ["dht"])
        peers = group.wait_address(bootstrap, address_file)
        launched = []
        for index, (start, end) in enumerate(split_blocks(args.layers, args.nodes)):
            node_args = ["run", "--model", path, "--blocks", f"{start}:{end}", "--initial-peers", *peers]
            node_args += ["--dht-prefix", "bench-gateway", "--no-measure", "--rebalance", "off"]
            launched.append(group.start(f"node-{index}", node_args))
        for process, node_address in launched:
            group.wait_address(process, node_address, timeout_s=300)
        gateway_args = ["gateway", "--model", path, "--initial-peers", *peers, "--dht-prefix", "bench-gateway"]
        gateway_args += ["--port", "0", "--compression", "none"]
        gateway, gateway_file = group.start("gateway", gateway_args)
        (url,) = group.wait_address(gateway, gateway_file, timeout_s=300)
        figures = asyncio.run(measure(args, path, peers, url))
    print(json.dumps({"bench": "gateway", "nodes": args.nodes, "new_tokens": args.new_tokens, **figures}))


if __name__ == "__main__":
    main()
