"""sharding/lora_edges.py and client/train_edges.py: the client's edge layers trained whole (peft's modules_to_save),
their place in a PEFT folder and in a checkpoint, and one step of them against peft's."""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node.client.checkpoints import Checkpoint, assemble, check_checkpoint_edges
from nesa_node.client.train_edges import EdgeLayers, edge_weights_of, with_edge_weights
from nesa_node.client.train_link import OptimizerSettings, causal_lm_loss
from nesa_node.errors import AdapterError, AdapterHashError, CheckpointError, UnsupportedAdapterError
from nesa_node.sharding.blocks import load_config
from nesa_node.sharding.client_edges import load_client_edges
from nesa_node.sharding.lora import load_adapter_slice
from nesa_node.sharding.lora_edges import EdgeState, edges_of_modules_to_save, peft_edge_key, read_edge_weights
from nesa_node.sharding.lora_train import LoraSpec, init_adapter, save_peft_adapter, spec_of_folder


def test_edges_are_checked_and_kept_in_the_model_order():
    spec = LoraSpec(edges=("lm_head", "embed_tokens"))
    assert spec.edges == ("embed_tokens", "lm_head")
    assert spec.peft_config().modules_to_save == ["model.embed_tokens", "lm_head"]
    assert LoraSpec().peft_config().modules_to_save is None
    with pytest.raises(ValueError, match="trainable edges must be some of embed_tokens, norm, lm_head"):
        LoraSpec(edges=("head",))


@pytest.mark.parametrize(
    ("modules", "expected"),
    [(None, ()), (["lm_head", "model.norm"], ("norm", "lm_head")), (["embed_tokens"], ("embed_tokens",))],
)
def test_modules_to_save_name_the_edges(modules, expected):
    assert edges_of_modules_to_save(modules, "here") == expected


@pytest.mark.parametrize("modules", [["norm"], ["score"], ["input_layernorm"]])
def test_modules_to_save_beyond_the_edges_are_refused(modules):
    """ "norm" alone would match every norm inside the blocks too, by peft's end-of-name rule."""
    with pytest.raises(UnsupportedAdapterError, match="modules_to_save"):
        edges_of_modules_to_save(modules, "here")


def test_an_edge_state_round_trips_and_refuses_other_bytes():
    state = EdgeState(3, {"norm": torch.rand(8)}, {"norm.exp_avg": torch.rand(8), "norm.exp_avg_sq": torch.rand(8)})
    data = state.to_bytes()
    again = EdgeState.from_bytes(data, state.sha256)
    assert again.step == 3 and torch.equal(again.weights["norm"], state.weights["norm"])
    assert set(again.moments) == {"norm.exp_avg", "norm.exp_avg_sq"}
    with pytest.raises(AdapterHashError):
        EdgeState.from_bytes(data, "0" * 64)
    odd = EdgeState(3, {"norm": torch.rand(8)}, {"lm_head.exp_avg": torch.rand(8)})
    with pytest.raises(AdapterError, match="moments of other edges"):
        EdgeState.from_bytes(odd.to_bytes(), odd.sha256)
    with pytest.raises(AdapterError, match="not an edge state"):
        EdgeState.from_bytes(b"\x05garbage", __import__("hashlib").sha256(b"\x05garbage").hexdigest())


def test_a_folder_with_trained_edges_is_peft_s_and_nodes_refuse_it(tiny_llama, tmp_path):
    config = load_config(tiny_llama)
    spec = LoraSpec(rank=2, alpha=4, targets=("q_proj",), edges=("norm", "lm_head"))
    weights = {"norm": torch.rand(config.hidden_size), "lm_head": torch.randn(config.vocab_size, config.hidden_size)}
    whole = init_adapter(config, spec, 0)
    with pytest.raises(AdapterError, match="edge weights"):
        save_peft_adapter(whole, spec, tmp_path / "missing", edges={"norm": weights["norm"]})
    folder = save_peft_adapter(whole, spec, tmp_path / "adapter", edges=weights)
    assert spec_of_folder(folder) == spec
    read = read_edge_weights(folder, spec.edges, config)
    assert all(torch.equal(read[name], weights[name]) for name in weights)
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), folder)
    assert torch.equal(loaded.base_model.model.lm_head.modules_to_save["default"].weight, weights["lm_head"])
    with pytest.raises(UnsupportedAdapterError, match="the client holds"):
        load_adapter_slice(folder, config)  # what a node reads: the edges are not its to run
    assert (
        load_adapter_slice(folder, config, outside_allowed={peft_edge_key(n) for n in spec.edges}).sha256
        == whole.sha256
    )
    with pytest.raises(AdapterError, match="not a finite"):
        read_edge_weights(folder, spec.edges, _wider(config))  # the weights of another model


def _wider(config):
    other = type(config).from_dict(config.to_dict())
    other.hidden_size = config.hidden_size * 2
    return other


def test_one_step_of_the_edges_is_peft_s_and_a_restore_goes_back(tiny_llama):
    """Embeddings, norm and head trained by EdgeLayers (with the blocks frozen and run in between as the nodes
    would) take the step peft takes with modules_to_save; restoring the state before the step undoes it."""
    config = load_config(tiny_llama)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    torch.manual_seed(0)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head", "model.norm", "model.embed_tokens"])
    )  # fmt: skip
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.requires_grad_(False)  # only the edges train here
    ids = torch.randint(3, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    settings = OptimizerSettings(lr=1e-2, weight_decay=0.01)
    edges = load_client_edges(tiny_llama, config=config)
    names = ("embed_tokens", "norm", "lm_head")
    initial = EdgeState(0, edge_weights_of(edges, names), {})
    layers = EdgeLayers(edges, config, names, settings, initial)

    # the blocks in between, as a chain of nodes runs them: frozen, with the gradient of their input returned
    blocks = model.base_model.model.model
    embedded = layers.embed(ids)
    inputs = embedded.detach().requires_grad_(True)
    with torch.enable_grad():
        hidden = inputs
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        rotary = blocks.rotary_emb(hidden, positions)
        mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
        for layer in blocks.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    loss, grad = layers.loss_and_grad(hidden.detach(), ids, None)
    hidden.backward(grad)
    layers.embed_backward(embedded, inputs.grad)
    layers.step()

    optimizer = torch.optim.AdamW(
        [parameter for parameter in model.parameters() if parameter.requires_grad], lr=1e-2, weight_decay=0.01,
        foreach=False,
    )  # fmt: skip
    expected_loss = causal_lm_loss(model(ids).logits, ids)
    expected_loss.backward()
    optimizer.step()
    assert abs(loss - expected_loss.item()) < 1e-5
    trained = layers.weights()
    saved = {n.removeprefix("base_model.model.").split(".modules_to_save")[0]: p for n, p in model.named_parameters()
             if ".modules_to_save.default." in n}  # fmt: skip
    for name, module in (("embed_tokens", "model.embed_tokens"), ("norm", "model.norm"), ("lm_head", "lm_head")):
        assert torch.allclose(trained[name], saved[module].detach(), atol=1e-6, rtol=0), name
        assert not torch.equal(trained[name], initial.weights[name])

    after = layers.state(1)
    assert after.step == 1 and len(after.moments) == 6
    layers.restore(initial)
    assert all(torch.equal(layers.weights()[name], initial.weights[name]) for name in names)
    layers.restore(after)
    assert all(torch.equal(layers.weights()[name], after.weights[name]) for name in names)
    bad = EdgeState(1, after.weights, {**after.moments, "norm.exp_avg_sq": -after.moments["norm.exp_avg_sq"] - 1})
    with pytest.raises(AdapterError, match="negative"):
        layers.restore(bad)

    served = with_edge_weights(edges, trained)  # a serving client's layers: the model's own are left alone
    assert torch.equal(served.lm_head.weight, trained["lm_head"]) and torch.equal(edges.lm_head.weight,
                                                                                   initial.weights["lm_head"])  # fmt: skip


def test_a_checkpoint_holds_the_edges_of_its_spec_at_its_step():
    """Checked before the spans are: an edge state missing, of another step, or where the spec trains none."""
    spec = LoraSpec(rank=2, targets=("q_proj",), edges=("norm",))
    with pytest.raises(CheckpointError, match="edge state"):
        assemble(0, "s", spec, {}, [], None)
    with pytest.raises(CheckpointError, match="edge state"):
        assemble(0, "s", spec, {}, [], EdgeState(1, {"norm": torch.ones(4)}, {}))
    with pytest.raises(CheckpointError, match="edge state"):
        assemble(0, "s", LoraSpec(rank=2, targets=("q_proj",)), {}, [], EdgeState(0, {"norm": torch.ones(4)}, {}))


def test_edge_state_that_is_not_finite_or_not_of_the_model_is_a_checkpoint_error(tiny_llama):
    config = load_config(tiny_llama)
    spec = LoraSpec(rank=2, targets=("q_proj",), edges=("norm",))
    fine = torch.ones(config.hidden_size)

    def checkpoint(edges: EdgeState) -> Checkpoint:
        return Checkpoint(0, "s", spec, {}, None, None, (), edges)

    check_checkpoint_edges(checkpoint(EdgeState(0, {"norm": fine}, {})), config, "resumed")
    diverged = fine.clone()
    diverged[3] = float("nan")
    for edges in (
        EdgeState(0, {"norm": diverged}, {}),
        EdgeState(0, {"norm": torch.ones(config.hidden_size + 1)}, {}),
        EdgeState(0, {"norm": fine}, {"norm.exp_avg": fine, "norm.exp_avg_sq": -fine}),
        EdgeState(0, {"norm": fine}, {"norm.exp_avg": fine}),
    ):
        with pytest.raises(CheckpointError, match="resumed"):
            check_checkpoint_edges(checkpoint(edges), config, "resumed")
