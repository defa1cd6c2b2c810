"""The client's token embeddings for the wire (ClientEdges.lookup): on the CPU the module's own call; a table off the
CPU is read through a host copy that follows the weight when it changes, and gives the device's values exactly."""

import pytest
import torch
from torch import nn

from nesa_node.sharding import client_edges
from nesa_node.sharding.client_edges import load_client_edges

IDS = torch.tensor([[5, 6, 7, 8, 9], [1, 0, 3, 3, 2]])


def test_a_cpu_table_is_looked_up_by_the_module_without_a_copy(tiny_llama):
    edges = load_client_edges(tiny_llama)
    with torch.inference_mode():
        looked = edges.lookup(IDS)
    assert looked.device.type == "cpu" and looked.dtype == torch.float32
    assert torch.equal(looked, edges.embed_tokens(IDS)) and edges._embed_host is None


def test_the_host_copy_gives_the_tables_rows_and_follows_its_changes(tiny_llama, monkeypatch):
    """The host-copy path run on a CPU table (which device the copy comes from does not change its logic)."""
    monkeypatch.setattr(client_edges, "reads_host_copy", lambda weight: True)
    edges = load_client_edges(tiny_llama)
    with torch.inference_mode():
        first = edges.lookup(IDS)
    held = edges._embed_host
    assert held is not None and held[2].data_ptr() != edges.embed_tokens.weight.data_ptr()  # a copy, not a view
    assert torch.equal(first, edges.embed_tokens(IDS))
    with torch.inference_mode():
        edges.lookup(IDS[:1])
    assert edges._embed_host is held  # unchanged weight: the same copy
    with torch.no_grad():  # an in-place change (a user editing the input embeddings)
        edges.embed_tokens.weight[6].mul_(3)
    with torch.inference_mode():
        changed = edges.lookup(IDS)
    assert torch.equal(changed, edges.embed_tokens(IDS)) and not torch.equal(changed, first)
    edges.embed_tokens.weight = nn.Parameter(torch.zeros_like(edges.embed_tokens.weight), requires_grad=False)
    with torch.inference_mode():
        assert torch.count_nonzero(edges.lookup(IDS)) == 0  # a replaced weight: copied again
    # a hooked module keeps its own call, hook included, and no copy is read
    edges.embed_tokens.register_forward_hook(lambda module, args, out: out + 1)
    with torch.inference_mode():
        assert torch.equal(edges.lookup(IDS), torch.ones(2, 5, edges.embed_tokens.embedding_dim))
    assert edges._embed_host is None  # and the copy is let go
    # with autograd on (training the embeddings), the module's call keeps its graph
    trained = load_client_edges(tiny_llama)
    trained.embed_tokens.weight.requires_grad_(True)
    assert trained.lookup(IDS).requires_grad and trained._embed_host is None


@pytest.mark.gpu
def test_a_cuda_tables_lookup_equals_the_devices_rows_exactly(tiny_llama):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    edges = load_client_edges(tiny_llama, dtype="bfloat16", device="cuda")
    with torch.inference_mode():
        looked = edges.lookup(IDS)
        on_device = edges.embed_tokens(IDS.cuda()).cpu()
    assert edges._embed_host is not None and looked.device.type == "cpu"
    assert looked.dtype == torch.bfloat16 and torch.equal(looked, on_device)
    with torch.no_grad():
        edges.embed_tokens.weight[5].add_(1)
    with torch.inference_mode():
        assert torch.equal(edges.lookup(IDS), edges.embed_tokens(IDS.cuda()).cpu())
