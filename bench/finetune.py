"""LoRA fine-tuning benchmark: training through a swarm against peft training the same adapter in one process.

On the trained tiny Llama (`nesa-node model train-tiny`, trained on the Python help topics minus every 10th), the
adapter learns the held-out topics: their token windows are split, four in five to train on, one in five to
evaluate on. A bootstrap and `--nodes` nodes run as processes on this machine, and one client trains through them
(one spare node per span joins for the kills, after the speed is measured). Reported, with their targets:

- held-out perplexity: the base model, the swarm-trained and the peft-trained adapter (target: the swarm's >= 10%
  better than the base's, and within 2% of peft's);
- training tokens/s through the swarm against single-process peft in the same run (target >= 0.5x): peft is timed
  before the swarm's run and again right after it, and the swarm is compared with the mean of the two;
- the 8-bit codec (blockwise8) on activations and gradients: extra held-out perplexity (target <= 1%);
- a node killed (SIGKILL) at a random step `--kills` times, checkpoints every `--checkpoint-every` steps: seconds from
  the kill until training has caught up (replayed the steps since the checkpoint) and taken the next step; the
  killed node is restarted as a spare before the next kill (target: each <= 10 s).

The nodes run as an operator runs several on one machine: each with its share of the cores (`--torch-threads`,
here the cores over --nodes, at least one), and the client's own compute (embeddings, loss, LM head) runs on
--client-threads threads (default 1); peft in one process uses all the cores. Each batch goes down the chain as
--micro-batches micro-batches, one behind the other, so the nodes compute at the same time.

One JSON line. A GPU machine: --device cuda (nodes).

    python bench/finetune.py [--steps 80] [--rank 8] [--lr 3e-3] [--batch 8] [--seq 64] [--kills 10]
                             [--micro-batches 2] [--node-threads N] [--client-threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node.client.finetune import FineTuningSession, causal_lm_loss  # noqa: E402
from nesa_node.devtools.launcher import ProcessGroup, split_blocks  # noqa: E402
from nesa_node.devtools.tiny_train import heldout_token_windows, train_tiny_model  # noqa: E402
from nesa_node.sharding.lora_train import LoraSpec  # noqa: E402

PREFIX = "bench-finetune"


def domain_windows(model_path: str, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) windows of the held-out topics: one window in five is kept for evaluation."""
    from transformers import AutoTokenizer

    windows = heldout_token_windows(AutoTokenizer.from_pretrained(model_path), seq)
    index = torch.arange(len(windows))
    return windows[index % 5 != 0], windows[index % 5 == 0]


def batches(train: torch.Tensor, steps: int, batch: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(train), generator=generator) for _ in range(steps * batch // len(train) + 1)])
    return [train[order[step * batch : (step + 1) * batch]] for step in range(steps)]


def perplexity(loss_of, windows: torch.Tensor, batch: int = 16) -> float:
    """exp of the mean next-token loss over `windows` (equal-length windows: the mean of the batches' means,
    weighted by their sizes)."""
    total = 0.0
    for start in range(0, len(windows), batch):
        part = windows[start : start + batch]
        total += loss_of(part) * len(part)
    return math.exp(total / len(windows))


def local_peft(
    model_path: str, spec, data: list[torch.Tensor], eval_windows: torch.Tensor, initial: Path, args
) -> dict:
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path)
    base.eval()

    def base_loss(ids):
        with torch.no_grad():
            return causal_lm_loss(base(ids).logits, ids).item()

    base_ppl = perplexity(base_loss, eval_windows)
    torch.manual_seed(args.seed)
    model = peft.get_peft_model(base, spec.peft_config(model_path))
    model.save_pretrained(initial)  # the swarm starts from the same adapter
    tps = train_timed(model, data, args.lr)

    def tuned_loss(ids):
        with torch.no_grad():
            return causal_lm_loss(model(ids).logits, ids).item()

    return {"base_ppl": base_ppl, "ppl": perplexity(tuned_loss, eval_windows), "tps": tps}


def train_timed(model, data: list[torch.Tensor], lr: float) -> float:
    """AdamW steps of `model`'s trainable parameters on every batch of `data` after one warm-up pass; tokens/s."""
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    causal_lm_loss(model(data[0]).logits, data[0]).backward()  # warm-up, not a step
    optimizer.zero_grad()
    started = time.perf_counter()
    for input_ids in data:
        causal_lm_loss(model(input_ids).logits, input_ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    return tokens(data) / (time.perf_counter() - started)


def peft_speed(model_path: str, data: list[torch.Tensor], initial: Path, args, *, threads: int) -> float:
    """Training tokens/s of single-process peft on `data` from the `initial` adapter, on `threads` torch threads
    (measured again after the swarm's run, so a machine that slows down or speeds up moves both sides alike)."""
    import peft
    from transformers import AutoModelForCausalLM

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = AutoModelForCausalLM.from_pretrained(model_path)
        return train_timed(peft.PeftModel.from_pretrained(base, initial, is_trainable=True), data, args.lr)
    finally:
        torch.set_num_threads(previous)


def tokens(data: list[torch.Tensor]) -> int:
    return sum(batch.numel() for batch in data)


def session_of(model_path, peers, initial, args, **options) -> FineTuningSession:
    """A session on the bench's swarm starting from the adapter peft started from."""
    return FineTuningSession.create(
        model_path, initial_peers=peers, dht_prefix=PREFIX, adapter=initial, lr=args.lr, **options
    )


def swarm_run(model_path, peers, initial, data, eval_windows, args, *, compression: str) -> dict:
    options = dict(compression=compression, checkpoint_every=10**9, micro_batches=args.micro_batches)
    with session_of(model_path, peers, initial, args, **options) as session:
        session.evaluate(data[0])  # warm-up: streams and first compute, nothing updated
        started = time.perf_counter()
        for input_ids in data:
            session.train_step(input_ids)
        seconds = time.perf_counter() - started
        return {"ppl": perplexity(session.evaluate, eval_windows), "tps": tokens(data) / seconds}


def kill_run(group, model_path, peers, spans, nodes, initial, data, args) -> list[float]:
    """Seconds from each kill until the next step is done (training caught up on a replacement)."""
    rng = random.Random(args.seed)
    recoveries = []
    with session_of(
        model_path, peers, initial, args, compression="none", checkpoint_every=args.checkpoint_every
    ) as session:
        for kill in range(args.kills):
            for _ in range(rng.randint(1, 2 * args.checkpoint_every)):
                session.train_step(data[session.step % len(data)])
            hop = rng.choice(session.chain)
            process = next(process for process, peer in nodes.items() if peer == hop.peer_id)
            span = spans[process]
            killed_at = time.perf_counter()
            group.stop(process, grace_s=0.0, sig=signal.SIGKILL)
            session.train_step(data[session.step % len(data)])
            recoveries.append(time.perf_counter() - killed_at)
            print(f"kill {kill + 1}: blocks {span[0]}:{span[1]}, caught up in {recoveries[-1]:.2f} s", file=sys.stderr)
            del nodes[process], spans[process]
            replacement, peer = start_node(group, model_path, peers, span, f"node-r{kill}", args)
            nodes[replacement], spans[replacement] = peer, span
    return recoveries


def start_node(group, model_path, peers, span, name, args):
    node_args = ["run", "--model", model_path, "--blocks", f"{span[0]}:{span[1]}", "--initial-peers", *peers]
    node_args += ["--dht-prefix", PREFIX, "--device", args.device, "--no-measure", "--announce-period", "1"]
    node_args += ["--torch-threads", str(args.node_threads)]
    process, address_file = group.start(name, node_args)
    address = group.wait_address(process, address_file, timeout_s=300)
    return process, address[0].rsplit("/p2p/", 1)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=2, help="per batch, pipelined down the chain (default 2)")
    parser.add_argument(
        "--node-threads",
        type=int,
        default=0,
        help="--torch-threads of each node (default: its share of this machine's cores, at least 1)",
    )
    parser.add_argument(
        "--client-threads",
        type=int,
        default=1,
        help="torch threads of the training client, set once peft has run (default 1: the nodes have the rest)",
    )
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.node_threads <= 0:  # the nodes that train at once share the cores, as an operator would set them
        args.node_threads = max(1, (os.cpu_count() or 1) // args.nodes)

    model_path = str(train_tiny_model(progress=False).path)
    spec = LoraSpec(rank=args.rank, alpha=2.0 * args.rank)
    train, eval_windows = domain_windows(model_path, args.seq)
    data = batches(train, args.steps, args.batch, args.seed)
    with tempfile.TemporaryDirectory(prefix="nesa-bench-") as workdir, ProcessGroup(workdir) as group:
        initial = Path(workdir) / "initial-adapter"
        local = local_peft(model_path, spec, data, eval_windows, initial, args)
        peft_threads = torch.get_num_threads()
        torch.set_num_threads(args.client_threads)
        bootstrap, address_file = group.start("dht", ["dht"])
        peers = group.wait_address(bootstrap, address_file)
        nodes, spans = {}, {}
        layers = split_blocks(4, args.nodes)

        def start_nodes(first: int) -> None:
            for index, span in enumerate(layers, start=first):
                process, peer = start_node(group, model_path, peers, span, f"node-{index}", args)
                nodes[process], spans[process] = peer, span
            time.sleep(3)  # every record announced

        start_nodes(0)  # the chain the speed is measured on: no idle node shares the cores
        lossless = swarm_run(model_path, peers, initial, data, eval_windows, args, compression="none")
        for process in list(nodes):  # peft again with the cores to itself, right after the swarm's run
            group.stop(process)
        peft_after = peft_speed(model_path, data, initial, args, threads=peft_threads)
        nodes.clear()
        spans.clear()
        start_nodes(0)
        eight_bit = swarm_run(model_path, peers, initial, data, eval_windows, args, compression="blockwise8")
        recoveries = []
        if args.kills:
            start_nodes(len(layers))  # every span twice: a spare for each kill
            recoveries = kill_run(group, model_path, peers, spans, nodes, initial, data, args)
    result = {
        "bench": "finetune",
        "steps": args.steps,
        "micro_batches": args.micro_batches,
        "node_threads": args.node_threads,
        "peft_threads": peft_threads,
        "client_threads": args.client_threads,
        "tokens_per_step": args.batch * args.seq,
        "base_heldout_ppl": round(local["base_ppl"], 3),
        "peft_heldout_ppl": round(local["ppl"], 3),
        "swarm_heldout_ppl": round(lossless["ppl"], 3),
        "swarm_gain_vs_base": round(1 - lossless["ppl"] / local["base_ppl"], 4),
        "swarm_vs_peft_ppl": round(lossless["ppl"] / local["ppl"] - 1, 4),
        "peft_tokens_per_s": round((local["tps"] + peft_after) / 2, 1),
        "peft_tokens_per_s_runs": [round(local["tps"], 1), round(peft_after, 1)],
        "swarm_tokens_per_s": round(lossless["tps"], 1),
        "swarm_vs_peft_tps": round(2 * lossless["tps"] / (local["tps"] + peft_after), 3),
        "blockwise8_heldout_ppl": round(eight_bit["ppl"], 3),
        "blockwise8_extra_ppl": round(eight_bit["ppl"] / lossless["ppl"] - 1, 4),
        "blockwise8_tokens_per_s": round(eight_bit["tps"], 1),
        "kills": len(recoveries),
        "recovery_s_max": round(max(recoveries), 2) if recoveries else None,
        "recovery_s_median": round(statistics.median(recoveries), 2) if recoveries else None,
        "targets": {
            "swarm_gain_vs_base": ">= 0.10",
            "swarm_vs_peft_ppl": "<= 0.02",
            "swarm_vs_peft_tps": ">= 0.5",
            "blockwise8_extra_ppl": "<= 0.01",
            "recovery_s_max": "<= 10",
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
