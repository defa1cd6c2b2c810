"""The client's own layers (embeddings, final norm, LM head) run in the dtype the nodes announce by default, so a
lossless swarm of bfloat16 nodes gives the tokens of one bfloat16 process; a dtype or device can be asked for."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model
from nesa_node.errors import DeviceUnavailableError
from tests.support.swarm import wait_for_chain

# wide enough, with large enough weights, that bfloat16 and float32 runs of this model give different tokens
SPEC = TinyModelSpec(hidden=256, heads=8, kv_heads=4, intermediate=512, initializer_range=0.2, seed=5)
PROMPT = torch.tensor([[3, 14, 15, 92, 65]])
NEW_TOKENS = 48
PREFIX = "bf16-nodes"


@pytest.fixture(scope="module")
def bf16_swarm(module_swarm, tmp_path_factory):
    path = str(init_tiny_model(tmp_path_factory.mktemp("wide") / "llama", SPEC))
    for start, end in ((0, 2), (2, 4)):
        module_swarm.start_node(path, start, end, dht_prefix=PREFIX, dtype="bfloat16")
    references = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        with torch.inference_mode():
            references[dtype] = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    # the test means something only where the two dtypes part ways
    assert not torch.equal(references[torch.bfloat16], references[torch.float32])
    return module_swarm, path, references


def connect(swarm, path: str, **kwargs) -> DistributedModelForCausalLM:
    return DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=swarm.initial_peers, dht_prefix=PREFIX, compression="none", **kwargs
    )


def test_the_client_takes_the_nodes_dtype_and_gives_the_single_process_tokens_in_it(bf16_swarm):
    swarm, path, references = bf16_swarm
    with connect(swarm, path) as model:
        assert model.client.dtype == torch.bfloat16
        assert model.client.edges.lm_head.weight.dtype == torch.bfloat16
        wait_for_chain(model)
        output = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(output, references[torch.bfloat16])


def test_an_explicit_client_dtype_is_kept(bf16_swarm):
    swarm, path, _ = bf16_swarm
    with connect(swarm, path, dtype="float32") as model:
        assert model.client.dtype == torch.float32
        wait_for_chain(model)
        output = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    assert output.shape == (1, PROMPT.shape[1] + 4)


def test_a_client_on_an_empty_swarm_runs_in_float32(module_swarm, tiny_llama):
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix="nobody-here"
    ) as model:
        assert model.client.dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_a_typed_error(module_swarm, tiny_llama):
    with pytest.raises(DeviceUnavailableError, match="use --device cpu"):
        DistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=module_swarm.initial_peers, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_client_on_cuda_with_bf16_cuda_nodes_gives_the_single_process_tokens(module_swarm, tmp_path_factory):
    path = str(init_tiny_model(tmp_path_factory.mktemp("wide-cuda") / "llama", SPEC))
    for start, end in ((0, 2), (2, 4)):
        module_swarm.start_node(path, start, end, dht_prefix="bf16-cuda", dtype="bfloat16", device="cuda")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
    with torch.inference_mode():
        expected = reference.generate(PROMPT.cuda(), max_new_tokens=NEW_TOKENS, do_sample=False).cpu()
    with DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=module_swarm.initial_peers, dht_prefix="bf16-cuda", compression="none", device="cuda"
    ) as model:
        assert model.client.device.type == "cuda" and model.client.dtype == torch.bfloat16
        wait_for_chain(model)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nodes_replaying_cuda_graphs_give_the_single_process_tokens(module_swarm, tmp_path_factory):
    path = str(init_tiny_model(tmp_path_factory.mktemp("graphs-cuda") / "llama", SPEC))
    nodes = [
        module_swarm.start_node(path, start, end, dht_prefix="graphs-cuda", device="cuda", cuda_graphs=True)
        for start, end in ((0, 2), (2, 4))
    ]
    reference = AutoModelForCausalLM.from_pretrained(path).to("cuda")
    with torch.inference_mode():
        expected = reference.generate(PROMPT.cuda(), max_new_tokens=NEW_TOKENS, do_sample=False).cpu()
    with DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=module_swarm.initial_peers, dht_prefix="graphs-cuda", compression="none", device="cuda"
    ) as model:
        wait_for_chain(model)
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS):
            assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
            for node in nodes:  # each node replays a captured step for the session
                (session,) = node.sessions.sessions.values()
                assert session.cache.fixed_step is not None and session.cache.fixed_step.graph is not None
