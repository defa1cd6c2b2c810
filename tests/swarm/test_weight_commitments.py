"""Weight commitments live (sharding/weights_manifest.py): a node serving a checkpoint whose block 3 was changed
announces another source hash; a client given the model's weights manifest never routes to it (with the honest node
of those blocks banned, it finds no chain, and says why) and gets the single-process tokens, while a client without
the manifest routes to it and gets other tokens. A manifest in the client's model folder is used by default."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.errors import NoRouteError, WeightsManifestError
from nesa_node.sharding.blocks import weights_manifest_of
from nesa_node.sharding.weights_manifest import FILE_NAME, WeightsManifest
from tests.support.swarm import wait_for_chain, wait_until

PREFIX = "commitments"
PROMPT = torch.tensor([[3, 14, 15, 92, 65]])
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def folders(tiny_llama, tmp_path_factory) -> tuple[str, str, WeightsManifest]:
    """The honest model folder (a copy, with its manifest inside), a copy whose block 3 is changed, and the manifest."""
    root = tmp_path_factory.mktemp("commitments")
    honest, changed = root / "honest", root / "changed"
    shutil.copytree(tiny_llama, honest)
    shutil.copytree(tiny_llama, changed)
    weights = load_file(changed / "model.safetensors")
    name = "model.layers.3.mlp.down_proj.weight"
    noise = torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(0))
    weights[name] = weights[name] + noise * weights[name].std() * 3  # enough to change greedy tokens
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    manifest = weights_manifest_of(honest)
    manifest.write(honest / FILE_NAME)
    return str(honest), str(changed), manifest


def generate(model) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


def test_a_node_announcing_other_weights_is_not_routed_to_by_a_client_with_the_manifest(module_swarm, folders):
    honest, changed, manifest = folders
    with torch.inference_mode():
        reference = generate(AutoModelForCausalLM.from_pretrained(honest))
    first = module_swarm.start_node(honest, 0, 2, dht_prefix=PREFIX)
    good = module_swarm.start_node(honest, 2, 4, dht_prefix=PREFIX)
    cheat = module_swarm.start_node(changed, 2, 4, dht_prefix=PREFIX)
    try:
        assert cheat.current_info().source_hash != manifest.span_hash(2, 4) == good.current_info().source_hash
        connect = dict(initial_peers=module_swarm.initial_peers, dht_prefix=PREFIX, compression="none")
        with DistributedModelForCausalLM.from_pretrained(honest, **connect) as checked:  # its folder's manifest
            assert checked.client.router.weights_manifest == manifest
            wait_for_chain(checked, hops=2)
            wait_until(lambda: len(checked.call(checked.swarm.node_records())) == 3, timeout_s=30)
            for _ in range(5):
                assert cheat.peer_id not in checked.choose_chain(max_length=16).peer_ids
            assert torch.equal(generate(checked), reference)
            checked.swarm.ban(good.peer_id, fault=True)  # out for good: no second chance when no chain is left
            with pytest.raises(NoRouteError, match="announces other weights than the manifest's"):
                checked.choose_chain(max_length=16)

        with DistributedModelForCausalLM.from_pretrained(changed, **connect) as unchecked:  # no manifest
            wait_for_chain(unchecked, hops=2)
            unchecked.swarm.ban(good.peer_id)
            assert cheat.peer_id in unchecked.choose_chain(max_length=16).peer_ids
            assert not torch.equal(generate(unchecked), reference)  # the changed block's tokens
    finally:
        for node in (first, good, cheat):
            module_swarm.stop_node(node)


def test_a_manifest_of_another_model_is_refused_before_joining(module_swarm, folders, tmp_path):
    honest, _, manifest = folders
    other = tmp_path / "other.json"
    WeightsManifest(manifest.blocks[:3]).write(other)
    with pytest.raises(WeightsManifestError, match="lists 3 blocks, the model has 4"):
        DistributedModelForCausalLM.from_pretrained(
            honest, initial_peers=module_swarm.initial_peers, dht_prefix=PREFIX, weights_manifest=other
        )
