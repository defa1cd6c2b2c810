"""LoRA adapters under a node's byte budget, through real nodes: three nodes with room for four adapters each serve
sessions cycling through 24 adapters they fetch from a peer that preloaded all of them; least recently used adapters
are evicted, never one an open session uses, and the budget is never exceeded (the adapter store's own property
tests cycle 200 adapters against a budget of 16: tests/unit/test_adapter_store.py)."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from nesa_node.client.async_model import AsyncDistributedModel, adapter_id_of_folder
from nesa_node.sharding.blocks import load_config
from nesa_node.sharding.lora import load_adapter_slice
from tests.support.adapters import peft_generate, save_random_adapter

pytest.importorskip("peft")

PREFIX = "lora-evict"
SPANS = [(0, 2), (2, 3), (3, 4)]
ADAPTERS = 24
BUDGET = 4  # adapters' worth of bytes on each serving node
OPEN = 3  # sessions held open at once (their adapters pinned)
SESSIONS = 40


@pytest.fixture(scope="module")
def folders(trained_model, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("many-adapters")
    return [
        str(
            save_random_adapter(
                trained_model, root / f"a{index}", 1000 + index, r=2, target_modules=["q_proj", "down_proj"]
            )
        )
        for index in range(ADAPTERS)
    ]


def test_sessions_cycling_adapters_evict_only_unpinned_ones_within_budget(module_swarm, trained_model, folders):
    config = load_config(trained_model)
    holder = module_swarm.start_node(trained_model, 0, 4, dht_prefix=PREFIX, adapters=tuple(folders))
    serving = []
    try:
        for start, end in SPANS:  # room for BUDGET slices of this span
            size = load_adapter_slice(folders[0], config, start, end).nbytes
            budget_mb = BUDGET * size * 1.01 / 2**20
            serving.append(  # one client cycles the adapters here: its share of the budget is all of it
                module_swarm.start_node(
                    trained_model,
                    start,
                    end,
                    dht_prefix=PREFIX,
                    adapter_budget_mb=budget_mb,
                    max_cache_share_per_peer=1.0,
                )
            )
        evicted: list[tuple[str, int]] = []
        for node in serving:
            store = node.adapters.store
            evict = store._evict

            def watched(entry, store=store, evict=evict):
                evicted.append((entry.adapter_id, entry.pins))
                evict(entry)
                assert store.used_bytes <= store.budget_bytes

            store._evict = watched
        ids = [adapter_id_of_folder(folder, config) for folder in folders]
        model = module_swarm.run(
            AsyncDistributedModel.from_pretrained(
                trained_model, initial_peers=module_swarm.initial_peers, dht_prefix=PREFIX, compression="none"
            )
        )
        try:
            module_swarm.run(model.swarm.node_records(fresh=True))
            model.swarm.ban(holder.peer_id, base_s=600.0)  # chains go through the nodes with the small budget
            rng = random.Random(0)
            order = [rng.randrange(ADAPTERS) for _ in range(SESSIONS)]
            prompt = torch.tensor([[5, 6, 7, 8]])
            window: deque = deque()
            for index in order:
                session = module_swarm.run(model.open_session(max_length=8, adapter=ids[index]))
                module_swarm.run(session.step(model.embed(prompt)))
                assert [peer for peer in session.chain.peer_ids] == [node.peer_id for node in serving]
                window.append((session, ids[index]))
                for _, held in window:  # every open session's adapter stays resident on every node
                    assert all(held in node.adapters.store for node in serving)
                while len(window) > OPEN:
                    module_swarm.run(window.popleft()[0].close())
            for session, _ in window:
                module_swarm.run(session.close())
            assert evicted, "the budget never filled: nothing was evicted"
            print(f"\n{len(evicted)} evictions over {SESSIONS} sessions on {len(serving)} nodes")
            assert all(pins == 0 for _, pins in evicted), evicted
            assert all(node.adapters.store.pinned == 0 for node in serving)
            for index in order[-2:]:  # tokens of adapters fetched, evicted and fetched again equal PeftModel's
                output = module_swarm.run(model.generate(prompt, max_new_tokens=6, adapter=ids[index]))
                assert torch.equal(output, peft_generate(trained_model, folders[index], prompt, 6))
        finally:
            module_swarm.run(model.close())
    finally:
        for node in [*serving, holder]:
            module_swarm.stop_node(node)
