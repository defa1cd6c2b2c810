"""Gateway benchmark: what the OpenAI-compatible gateway adds over the SDK, and concurrent streams.

A bootstrap, `--nodes` nodes and a gateway run as processes on this machine; the same prompts go through the async
SDK in this process, through the gateway with a plain HTTP client (a socket read as the answer comes, the events
parsed once it is complete: what the gateway itself adds), and through the gateway with the official `openai`
client (what a Python application using it sees: the client library's own parsing included). Streaming,
temperature 0, lossless wire.

The machine's speed drifts by tens of percent from one second to the next (shared cores), so requests run in
rounds of two, the SDK's and one through the gateway (the plain and the openai client in turn), each first in half
of the rounds, `--requests` rounds; what the gateway adds is the median over the rounds of the paired difference
(gateway minus SDK in the same round), with a bootstrap 95% interval. Time to first token, and time per later token.
(One request each per round also keeps the two clients alike in how old their swarm records are when a request
comes: a client reads them at most every `records_fresh_s`, in the background.) Then `--concurrent` streaming
requests at once through the gateway, each checked against its own SDK tokens. One JSON line. Targets: the gateway
adds at most 2 ms to the first token and 0.5 ms per token.

    python bench/gateway.py [--nodes 2] [--requests 200] [--new-tokens 32] [--concurrent 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
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


async def raw_run(url: str, name: str, prompt: str, new_tokens: int) -> tuple[float, float, str]:
    """As gateway_run, with the least client work while the answer comes: one HTTP/1.1 request on a socket of its
    own, each read kept with the time it returned, the events parsed once the answer is complete (a client on
    another machine parses on its own cores; here its parsing would take the cores the nodes and the gateway use).
    An event's time is that of the read holding its last byte."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    reads: list[tuple[float, bytes]] = []
    try:
        writer.write(head + body)
        while data := await reader.read(65536):
            reads.append((time.perf_counter(), data))
    finally:
        writer.close()
    ends, raw = [], b""
    for when, data in reads:
        raw += data
        ends.append((len(raw), when))
    first = last = None
    pieces, tokens = [], 0
    for match in re.finditer(rb"data: (\{.*?\})\n\n", raw):  # one event per chunk of the chunked body
        when = next(when for end, when in ends if end >= match.end())
        chunk = json.loads(match.group(1))
        choices = chunk.get("choices")
        if choices and choices[0]["text"]:
            first = first or when
            pieces.append(choices[0]["text"])
        if choices and choices[0]["finish_reason"]:
            last = when
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return first - started, (last - first) / max(tokens - 1, 1), "".join(pieces)


def paired(added: list[float], seed: int = 0) -> dict:
    """Median of paired differences (ms) and its bootstrap 95% interval."""
    import numpy as np

    values = np.array(added) * 1000.0
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, size=(2000, values.size)), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return {"median": round(float(np.median(values)), 3), "ci95": [round(float(low), 3), round(float(high), 3)]}


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
        await raw_run(url, name, PROMPTS[0], 4)
        # timed prompts: those whose first new token is text of its own (a token ending inside a character sends no
        # text until the next one, which would shift the gateway's first-text time by a token)
        timed = []
        for prompt in PROMPTS:
            _, _, tokens = await sdk_run(model, tokenizer, prompt, 1)
            if tokenizer.decode(tokens[:1]).strip("\ufffd"):
                timed.append(prompt)
        rows: dict[str, list[tuple[float, float]]] = {"sdk": [], "http": [], "openai": []}
        sdk_rows: dict[str, list[tuple[float, float]]] = {"http": [], "openai": []}  # the SDK's, round by round
        expected, mismatches = {}, 0
        for index in range(args.requests):
            prompt = timed[(index // 2) % len(timed)]
            gateway_kind = "http" if index % 2 == 0 else "openai"
            # the SDK and the gateway run alike: one request each per round, first and second in turn, so each
            # client's records (read at most every records_fresh_s) are as old at every request of either
            order = ["sdk", gateway_kind] if (index // 2) % 2 == 0 else [gateway_kind, "sdk"]
            for kind in order:
                if kind == "sdk":
                    ttft, per_token, tokens = await sdk_run(model, tokenizer, prompt, args.new_tokens)
                    text = tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                    expected[prompt] = text
                elif kind == "http":
                    ttft, per_token, text = await raw_run(url, name, prompt, args.new_tokens)
                else:
                    ttft, per_token, text = await gateway_run(client, name, prompt, args.new_tokens)
                (sdk_rows[gateway_kind] if kind == "sdk" else rows[kind]).append((ttft, per_token))
                if kind == "sdk":
                    rows["sdk"].append((ttft, per_token))
                if kind != "sdk" and prompt in expected and text != expected[prompt]:
                    mismatches += 1
        prompts = [timed[index % len(timed)] for index in range(args.concurrent)]
        started = time.perf_counter()
        results = await asyncio.gather(*(gateway_run(client, name, prompt, args.new_tokens) for prompt in prompts))
        concurrent_s = time.perf_counter() - started
    finally:
        await client.close()
        await model.close()

    def p50_ms(values):
        return round(1000 * statistics.median(values), 3)

    figures: dict = {"timed_prompts": len(timed), "rounds": args.requests, "text_mismatches": mismatches}
    for kind, values in rows.items():
        figures[f"{kind}_ttft_ms_p50"] = p50_ms([ttft for ttft, _ in values])
        figures[f"{kind}_per_token_ms_p50"] = p50_ms([per for _, per in values])
    for kind in ("http", "openai"):
        pairs = list(zip(rows[kind], sdk_rows[kind], strict=True))
        figures[f"{kind}_ttft_added_ms"] = paired([ours[0] - sdk[0] for ours, sdk in pairs])
        figures[f"{kind}_per_token_added_ms"] = paired([ours[1] - sdk[1] for ours, sdk in pairs])
    figures["targets"] = {
        "gateway_adds_at_most_2ms_ttft": figures["http_ttft_added_ms"]["median"] <= 2.0,
        "gateway_adds_at_most_0_5ms_per_token": figures["http_per_token_added_ms"]["median"] <= 0.5,
    }
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
    parser.add_argument("--requests", type=int, default=200, help="rounds of one SDK and one gateway request")
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
        # every stream of the concurrent figure comes from this one address: one caller, allowed them all
        gateway_args += ["--max-concurrency", str(max(64, args.concurrent))]
        gateway_args += ["--max-requests-per-caller", str(max(64, args.concurrent))]
        gateway, gateway_file = group.start("gateway", gateway_args)
        (url,) = group.wait_address(gateway, gateway_file, timeout_s=300)
        figures = asyncio.run(measure(args, path, peers, url))
    print(json.dumps({"bench": "gateway", "nodes": args.nodes, "new_tokens": args.new_tokens, **figures}))


if __name__ == "__main__":
    main()
