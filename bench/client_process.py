"""Concurrent sessions from separate client processes, for `bench/inference.py --client-processes`.

`--clients N` alone runs N sessions in the benchmark's own process, as one gateway serves its users: that process's
per-session work (embeddings, LM head, sampling, its side of every step) is then one stage of every round. Here each
session has a client process of its own, as N users on N machines: `processes_decode` starts N of this file's
workers, waits until each is connected and warm, starts them together and times them to the last token.

A worker (`python bench/client_process.py MODEL_FOLDER`, its settings as JSON on stdin) joins the swarm, waits for a
chain of the given number of nodes, generates a few tokens to warm its connections, prints `ready`, waits for a line
on stdin, generates, and prints one JSON line: its tokens and when its first and last token came (perf_counter, a
clock every process on the machine shares).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

WARM_TOKENS = 4  # tokens a worker generates before it says it is ready


async def _work(folder: str, settings: dict) -> dict:
    import torch

    from nesa_node.client.async_model import AsyncDistributedModel
    from nesa_node.errors import NoRouteError

    model = await AsyncDistributedModel.from_pretrained(
        folder,
        initial_peers=settings["peers"],
        dht_prefix=settings["prefix"],
        compression="none",
        device=settings["device"],
        dtype=settings["dtype"],
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(NoRouteError):
                if len((await model.choose_chain(max_length=128)).hops) == settings["hops"]:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"swarm {settings['prefix']} did not come up")
            await asyncio.sleep(0.5)
        prompt = torch.tensor([settings["prompt"]])
        new_tokens = settings["new_tokens"]
        await model.generate(prompt, max_new_tokens=WARM_TOKENS)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        started = time.perf_counter()
        columns, first_token = [], None
        session = await model.open_session(max_length=prompt.shape[1] + new_tokens, prompt_tokens=prompt.shape[1])
        try:
            stream = model.stream(prompt, max_new_tokens=new_tokens, session=session, send_ahead=True)
            async with contextlib.aclosing(stream):
                async for column in stream:
                    first_token = first_token or time.perf_counter()
                    columns.append(column)
        finally:
            await session.close()
        return {
            "started": started,
            "first_token": first_token,
            "finished": time.perf_counter(),
            "tokens": torch.stack(columns, dim=1).cpu().flatten().tolist(),
        }
    finally:
        await model.close()


def worker() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nesa_node import event_loop, openmp_wait

    openmp_wait.short_spin()
    settings = json.loads(sys.stdin.readline())
    print(json.dumps(event_loop.run(_work(sys.argv[1], settings))), flush=True)


def processes_decode(folder: str, prompts: list[list[int]], settings: dict, log_dir: Path) -> dict:
    """Aggregate decode of one session per client process, `len(prompts)` processes started together: tokens/s from
    the first process's start to the last one's last token, and each session's generated tokens (a list per prompt).
    `settings`: peers, prefix, hops, new_tokens, device, dtype. Every worker is stopped on the way out; their stderr
    goes to `log_dir`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = []
    try:
        for index, prompt in enumerate(prompts):
            log = open(log_dir / f"client-{index}.log", "w")  # noqa: SIM115 (closed with its worker, below)
            process = subprocess.Popen(
                [sys.executable, __file__, folder],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            workers.append((process, log))
            process.stdin.write(json.dumps({**settings, "prompt": prompt}) + "\n")
            process.stdin.flush()
        for index, (process, _) in enumerate(workers):
            line = process.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"client process {index} did not get ready ({line!r}; see {log_dir})")
        for process, _ in workers:  # all at once: each waits on its stdin
            process.stdin.write("go\n")
            process.stdin.flush()
        results = []
        for index, (process, _) in enumerate(workers):
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"client process {index} ended without its figures (see {log_dir})")
            results.append(json.loads(line))
    finally:
        for process, log in workers:
            with contextlib.suppress(OSError):
                process.stdin.close()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
    first_start = min(result["started"] for result in results)
    last_end = max(result["finished"] for result in results)
    tokens = sum(len(result["tokens"]) for result in results)
    first_tokens = sorted(result["first_token"] - result["started"] for result in results)
    return {
        "processes": len(prompts),
        "aggregate_tps": round(tokens / (last_end - first_start), 2),
        "first_token_ms_median": round(1000 * first_tokens[len(first_tokens) // 2], 1),
        "tokens": [result["tokens"] for result in results],
    }


if __name__ == "__main__":
    worker()
