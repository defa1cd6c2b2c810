"""Churn soak (RELIABILITY.md A8): several clients generate while node processes are killed and restarted on a
schedule; every generation must complete with the reference tokens, and open files (and, in the long form, memory)
stay flat. The short form runs in `make test`; `make test-slow` runs the long one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.devtools.chaos import ChaosSwarm, Churn
from tests.support.swarm import wait_for_chain, wait_until

pytestmark = pytest.mark.serial  # measures time: run alone, after the parallel pass (Makefile)

SPANS = [(0, 1), (1, 3), (3, 4)]
PROMPT_TOKENS = 8


@dataclass(frozen=True)
class Soak:
    clients: int
    generations: int  # per client, at least; clients go on until `kills` nodes were killed
    kills: int
    new_tokens: int
    kill_period_s: float
    open_files_slack: int  # descriptors that may come and go (DHT connections); a leak grows with every session
    rss_growth: float | None  # allowed fraction; None: not checked (too noisy for a short run)


SHORT = Soak(clients=2, generations=2, kills=3, new_tokens=48, kill_period_s=2.0, open_files_slack=24, rss_growth=None)
LONG = Soak(clients=3, generations=10, kills=30, new_tokens=96, kill_period_s=4.0, open_files_slack=24, rss_growth=0.10)
PROMPTS = 6  # generations cycle through these, each with its reference


def prompts(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 1000, (1, PROMPT_TOKENS), generator=generator) for _ in range(count)]


def client_tree_files(models) -> int:
    """Descriptors of this process and of each client's p2pd."""
    total = psutil.Process().num_fds()
    for model in models:
        total += psutil.Process(model.swarm.p2p._child.pid).num_fds()  # hivemind keeps its daemon as P2P._child
    return total


def client_tree_rss_mb(models) -> float:
    processes = [psutil.Process()] + [psutil.Process(model.swarm.p2p._child.pid) for model in models]
    return sum(process.memory_info().rss for process in processes) / 2**20


def run_soak(tiny_llama: str, soak: Soak, caplog) -> None:
    # the clients' log (each failover: the failed node and why), shown on a failure
    caplog.set_level(logging.INFO, logger="nesa_node.client")
    begin = time.monotonic()
    reference_model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    inputs = prompts(PROMPTS)
    with torch.inference_mode():
        references = [
            reference_model.generate(
                prompt, max_new_tokens=soak.new_tokens, min_new_tokens=soak.new_tokens, do_sample=False
            )
            for prompt in inputs
        ]
    with ChaosSwarm(tiny_llama, SPANS, copies=2, dht_prefix="churn") as swarm:
        print(f"\nswarm of {len(swarm.nodes)} node processes up after {time.monotonic() - begin:.1f} s")
        models = [
            DistributedModelForCausalLM.from_pretrained(
                tiny_llama, initial_peers=swarm.initial_peers, dht_prefix="churn", compression="none"
            )
            for _ in range(soak.clients)
        ]
        try:
            for model in models:  # warm up: connections, caches and the first chains exist before the baseline
                wait_for_chain(model, hops=len(SPANS), max_length=PROMPT_TOKENS + soak.new_tokens)
                model.generate(inputs[0], max_new_tokens=4, do_sample=False)
            print(f"clients warmed up after {time.monotonic() - begin:.1f} s")
            survivors = {node.peer_id for node in swarm.live()}
            node_files = {peer: swarm.open_files(peer) for peer in survivors}
            client_files, client_rss = client_tree_files(models), client_tree_rss_mb(models)

            results: list[tuple[int, bool]] = []  # (prompt, tokens equal to its reference)
            failures: list[BaseException] = []

            def generate(client: int, churn: Churn) -> None:
                try:
                    done = 0
                    while done < soak.generations or len(churn.events) < soak.kills:
                        index = (client + done * soak.clients) % PROMPTS
                        output = models[client].generate(
                            inputs[index],
                            max_new_tokens=soak.new_tokens,
                            min_new_tokens=soak.new_tokens,
                            do_sample=False,
                        )
                        results.append((index, torch.equal(output, references[index])))
                        done += 1
                except BaseException as exc:
                    failures.append(exc)

            started = time.monotonic()
            with Churn(swarm, period_s=soak.kill_period_s, seed=3) as churn:
                threads = [threading.Thread(target=generate, args=(client, churn)) for client in range(soak.clients)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            elapsed = time.monotonic() - started
            client_log = [r.getMessage() for r in caplog.records if r.name.startswith("nesa_node.client")]
            assert not failures, "\n".join(map(str, [*failures, *churn.events, *client_log]))
            assert len(churn.events) >= soak.kills
            assert [index for index, equal in results if not equal] == []
            print(
                f"churn soak: {len(results)} generations of {soak.new_tokens} tokens by {soak.clients} clients in "
                f"{elapsed:.1f} s, {len(churn.events)} nodes killed and restarted, all tokens equal the reference"
            )

            # resources: the clients and the nodes that lived through the soak return to their baseline
            survivors &= {node.peer_id for node in swarm.live()}
            wait_until(lambda: client_tree_files(models) <= client_files + soak.open_files_slack, timeout_s=30)
            for peer in survivors:
                wait_until(lambda peer=peer: swarm.open_files(peer) <= node_files[peer] + soak.open_files_slack, 30)
            print(
                f"open files: clients {client_files} -> {client_tree_files(models)}; nodes "
                + ", ".join(f"{node_files[peer]} -> {swarm.open_files(peer)}" for peer in sorted(survivors))
            )
            if soak.rss_growth is not None:
                assert client_tree_rss_mb(models) <= client_rss * (1 + soak.rss_growth)
        finally:
            for model in models:
                model.close()


def test_a8_churn_soak_short(tiny_llama, caplog):
    run_soak(tiny_llama, SHORT, caplog)


@pytest.mark.slow
def test_a8_churn_soak_long(tiny_llama, caplog):
    run_soak(tiny_llama, LONG, caplog)
