"""The malicious-node modes (devtools/malicious.py) are real: a cheating node of blocks 2:4 keeps announcing the
honest node's record (span, weights and source hashes), yet the hidden states a chain through it returns differ
from those of a chain through an honest node of the same blocks: on every step for the weight modes and the lazy
node, on exactly the tampered steps for the noisy one. These are the cheats verification has to catch."""

from __future__ import annotations

import pytest
import torch

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.session import InferenceSession
from nesa_node.devtools.malicious import MODES, make_malicious
from tests.support.adapters import save_random_adapter
from tests.support.swarm import wait_until

PREFIX = "malicious"
TOKENS = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(11))
PROMPT = 6  # tokens in the first step; each later step sends one


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> str:
    return str(save_random_adapter(tiny_llama, tmp_path_factory.mktemp("adapter") / "a", seed=3, r=4))


@pytest.fixture(scope="module")
def honest(module_swarm, tiny_llama, adapter):
    """Honest nodes of blocks 0:2 and 2:4 (both holding the adapter), and a client that sees them."""
    settings = dict(dht_prefix=PREFIX, adapters=(adapter,))
    front = module_swarm.start_node(tiny_llama, 0, 2, **settings)
    back = module_swarm.start_node(tiny_llama, 2, 4, **settings)
    model = DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix=PREFIX, compression="none"
    )
    try:
        yield front, back, model
    finally:
        model.close()
        for node in (front, back):
            module_swarm.stop_node(node)


def outputs_through(model, first, last, other, adapter_id: str | None) -> list[torch.Tensor]:
    """The hidden states a session on the chain first -> last (routed with `other` left out) returns for each step
    of TOKENS."""
    client = model.client

    async def run() -> list[torch.Tensor]:
        chain = await client.choose_chain(max_length=32, exclude=frozenset({other.peer_id}))
        assert chain.peer_ids == (first.peer_id, last.peer_id), chain
        session = InferenceSession(client.swarm, chain, client.config, batch=1, max_length=32, adapter=adapter_id)
        async with session:
            outputs = [await session.step(client.embed(TOKENS[:, :PROMPT]))]
            for index in range(PROMPT, TOKENS.shape[1]):
                outputs.append(await session.step(client.embed(TOKENS[:, index : index + 1])))
        return outputs

    return model.call(run())


@pytest.mark.parametrize("mode", MODES)
def test_a_cheating_node_announces_the_honest_record_but_computes_something_else(
    module_swarm, tiny_llama, adapter, honest, mode
):
    front, back, model = honest
    adapter_id = model.call(model.client.resolve_adapter(adapter)) if mode == "wrong_adapter" else None
    cheat = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=PREFIX, adapters=(adapter,))
    try:
        misbehaviour = make_malicious(cheat, mode, rate=0.3, seed=5)
        for field in ("start_block", "end_block", "weights_hash", "source_hash", "quantization", "dtype", "adapters"):
            assert getattr(cheat.current_info(), field) == getattr(back.current_info(), field), field
        seen = lambda: {record.info.peer_id for record in model.call(model.swarm.node_records(fresh=True))}  # noqa: E731
        wait_until(lambda: {front.peer_id, back.peer_id, cheat.peer_id} <= seen(), timeout_s=30)
        expected = outputs_through(model, front, back, cheat, adapter_id)
        got = outputs_through(model, front, cheat, back, adapter_id)
    finally:
        module_swarm.stop_node(cheat)
    differs = [not torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(expected, got, strict=True)]
    assert misbehaviour.tampered_steps > 0 or mode in ("perturbed", "nf4_as_announced", "skip_block")
    if mode == "noisy":
        assert 0 < sum(differs) == misbehaviour.tampered_steps < len(differs)  # some steps, not all
    else:
        assert all(differs), differs


def test_modes_refuse_what_they_cannot_do(module_swarm, tiny_llama):
    node = module_swarm.start_node(tiny_llama, 2, 3, dht_prefix=PREFIX + "-refuse")
    try:
        with pytest.raises(ValueError, match="unknown malicious mode"):
            make_malicious(node, "sloppy")
        with pytest.raises(ValueError, match="outside the node's span"):
            make_malicious(node, "perturbed", block=0)
        with pytest.raises(ValueError, match="after the span's first"):
            make_malicious(node, "skip_block")
    finally:
        module_swarm.stop_node(node)
