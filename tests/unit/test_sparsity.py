"""Activation sparsity of ReLU MLPs (sharding/sparsity.py) on a tiny random Llama with hidden_act "relu".

Figures measured on this model (4 blocks, hidden 64, 128 neurons, seed 1; MLP inputs of random hidden states): about
half of the neurons are active per token; a rank-32 predictor calibrated for recall 0.99 on 1024 tokens keeps recall
0.981-0.984 on 512 other tokens, precision 0.65-0.66, predicting 0.75 of the neurons active against a true 0.50 (a
random model's gates are a full-rank map of the input, which a rank-32 predictor only approximates).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node.devtools.tiny_model import TinyModelSpec, build_config
from nesa_node.errors import RequestError, SparsityUnsupportedError, error_from_code
from nesa_node.sharding import sparsity
from nesa_node.sharding.blocks import SpanSpec, load_block_span

SPEC = TinyModelSpec(seed=1)
FAST = sparsity.PredictorConfig(steps=150)  # a quarter of the default's steps: the same recall here, in a second


def _write_model(path, activation: str) -> str:
    config = build_config(SPEC, vocab_size=SPEC.vocab)
    config.hidden_act = activation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SPEC.seed)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These are many tiny matmuls: on a loaded machine torch's thread pool stalls them (40 predictor steps took 23 s
    with 2 threads under load, 0.3 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def relu_model(tmp_path_factory) -> str:
    return _write_model(tmp_path_factory.mktemp("sparsity") / "tiny-relu", "relu")


@pytest.fixture(scope="module")
def mlp_inputs(relu_model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per block, the MLP inputs (tokens, hidden) of a real forward pass: (1024 training tokens, 512 held-out)."""
    span = load_block_span(relu_model, SpanSpec(0, 4))
    generator = torch.Generator().manual_seed(0)
    train = [torch.randn(4, 64, SPEC.hidden, generator=generator) for _ in range(4)]  # (batch, seq, hidden)
    heldout = [torch.randn(4, 64, SPEC.hidden, generator=generator) for _ in range(2)]
    return sparsity.record_mlp_inputs(span, train), sparsity.record_mlp_inputs(span, heldout)


def _steps(span, hidden: torch.Tensor) -> list[torch.Tensor]:
    """A 6-token prefill then one-token decode steps on a cache: every output."""
    cache = span.new_cache()
    with torch.inference_mode():
        outputs = [span(hidden[:, :6], cache, 0)]
        outputs += [span(hidden[:, index : index + 1], cache, index) for index in range(6, hidden.shape[1])]
    return outputs


def test_the_oracle_mask_gives_the_dense_output_bitwise(relu_model, mlp_inputs):
    span = load_block_span(relu_model, SpanSpec(0, 4))
    _, heldout = mlp_inputs
    with torch.inference_mode():
        for layer, x in zip(span.layers, heldout, strict=True):
            mask = sparsity.oracle_mask(layer.mlp, x)  # (tokens, intermediate)
            assert 0.3 < mask.float().mean() < 0.7  # a random ReLU MLP: about half active
            assert torch.equal(sparsity.masked_mlp(layer.mlp, x, mask), layer.mlp(x))
            assert torch.equal(sparsity.masked_mlp(layer.mlp, x[:1], mask[:1]), layer.mlp(x[:1]))
    hidden = torch.randn(2, 10, SPEC.hidden, generator=torch.Generator().manual_seed(3))  # (batch, seq, hidden)
    dense = _steps(span, hidden)
    with sparsity.sparse_span(span, [sparsity.oracle_mask] * 4, mode="masked") as handle:
        oracle = _steps(span, hidden)
    assert all(torch.equal(got, expected) for got, expected in zip(oracle, dense, strict=True))
    assert [stats.tokens for stats in handle.stats] == [20] * 4 and handle.stats[0].steps == 5


def test_the_gathered_oracle_is_within_the_rounding_bound(relu_model, mlp_inputs):
    span = load_block_span(relu_model, SpanSpec(0, 4))
    _, heldout = mlp_inputs
    with torch.inference_mode():
        for layer in span.layers:
            mlp, down_by_neuron = layer.mlp, sparsity.neuron_major_down(layer.mlp)
            tokens = heldout[layer.self_attn.layer_idx]
            for x in (tokens[:1], tokens[:3]):  # a decode step; a union (of 3: 8 would cover every neuron here)
                neurons = sparsity.oracle_mask(mlp, x).any(0).nonzero().squeeze(1)  # the union of the tokens' sets
                assert len(neurons) < mlp.gate_proj.out_features  # some neurons really are skipped
                dense = mlp(x)  # (tokens, hidden)
                bound = sparsity.rounding_bound(mlp, x, neurons)
                assert (
                    bound.max() < 1e-3 * dense.abs().max()
                )  # measured 3-5e-4: worst-case rounding, far below a neuron
                for down in (None, down_by_neuron):
                    gathered = sparsity.gathered_mlp(mlp, x, neurons, down)
                    assert ((gathered - dense).abs() <= bound).all()


def test_a_wrong_mask_changes_the_output(relu_model, mlp_inputs):
    span = load_block_span(relu_model, SpanSpec(0, 4))
    mlp, x = span.layers[1].mlp, mlp_inputs[1][1][:1]  # block 1, one token
    with torch.inference_mode():
        mask = sparsity.oracle_mask(mlp, x)  # (1, intermediate)
        contribution = (mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)).abs()[0] * mlp.down_proj.weight.norm(dim=0)
        missed = int(contribution.argmax())  # the active neuron that matters most
        assert mask[0, missed]
        mask[0, missed] = False
        dense = mlp(x)
        assert not torch.equal(sparsity.masked_mlp(mlp, x, mask), dense)
        neurons = mask[0].nonzero().squeeze(1)
        gathered = sparsity.gathered_mlp(mlp, x, neurons, sparsity.neuron_major_down(mlp))
        assert ((gathered - dense).abs() > sparsity.rounding_bound(mlp, x, neurons)).any()


def test_nothing_selected_gives_zero(relu_model, mlp_inputs):
    mlp, x = load_block_span(relu_model, SpanSpec(0, 1)).layers[0].mlp, mlp_inputs[1][0][:3]
    none = torch.zeros(0, dtype=torch.long)
    with torch.inference_mode():
        for tokens in (x[:1], x):
            empty = torch.zeros(tokens.shape[0], mlp.gate_proj.out_features, dtype=torch.bool)
            assert torch.equal(sparsity.masked_mlp(mlp, tokens, empty), torch.zeros_like(tokens))  # Llama: no bias
            for down in (None, sparsity.neuron_major_down(mlp)):
                assert torch.equal(sparsity.gathered_mlp(mlp, tokens, none, down), torch.zeros_like(tokens))


def test_predictor_training_is_deterministic_for_a_seed(relu_model, mlp_inputs):
    span = load_block_span(relu_model, SpanSpec(0, 1))
    x = mlp_inputs[0][0]
    labels = sparsity.oracle_mask(span.layers[0].mlp, x)
    config = dataclasses.replace(FAST, steps=40)
    first, second = sparsity.train_predictor(x, labels, config), sparsity.train_predictor(x, labels, config)
    other = sparsity.train_predictor(x, labels, dataclasses.replace(config, seed=1))
    assert set(first.state_dict()) == {"to_rank.weight", "to_neurons.weight", "to_neurons.bias", "threshold_logit"}
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name])
    assert not torch.equal(first.to_rank.weight, other.to_rank.weight)


def test_a_predictor_calibrated_for_recall_keeps_it_on_other_tokens(relu_model, mlp_inputs):
    span = load_block_span(relu_model, SpanSpec(0, 4))
    train, heldout = mlp_inputs
    with torch.inference_mode():
        for layer, x, other in zip(span.layers, train, heldout, strict=True):
            labels = sparsity.oracle_mask(layer.mlp, x)
            predictor = sparsity.train_predictor(x, labels, FAST)
            seen = sparsity.prediction_metrics(predictor.predict(layer.mlp, x), labels)
            assert seen.recall >= FAST.target_recall  # what the threshold was chosen for
            unseen = sparsity.prediction_metrics(
                predictor.predict(layer.mlp, other), sparsity.oracle_mask(layer.mlp, other)
            )
            assert unseen.recall > 0.95  # measured 0.981-0.984
            assert unseen.precision > unseen.true_density + 0.1  # measured +0.15: far better than every neuron
            assert unseen.predicted_density < 0.85  # measured 0.75


def test_metrics_count_hits_and_misses():
    actual = torch.tensor([[True, True, False, False], [True, False, False, False]])
    predicted = torch.tensor([[True, False, True, False], [True, False, False, False]])
    metrics = sparsity.prediction_metrics(predicted, actual)
    assert (metrics.recall, metrics.precision) == (2 / 3, 2 / 3)
    assert (metrics.predicted_density, metrics.true_density, metrics.tokens) == (3 / 8, 3 / 8, 2)


def test_installing_then_removing_restores_the_dense_forward(relu_model, mlp_inputs):
    span = load_block_span(relu_model, SpanSpec(0, 4))
    train, _ = mlp_inputs
    with torch.inference_mode():
        predictors = [
            sparsity.train_predictor(x, sparsity.oracle_mask(layer.mlp, x), FAST)
            for layer, x in zip(span.layers, train, strict=True)
        ]
    hidden = torch.randn(1, 8, SPEC.hidden, generator=torch.Generator().manual_seed(5))  # (batch, seq, hidden)
    dense = _steps(span, hidden)
    handle = sparsity.install_sparsity(span, predictors)  # "gather", the node's path
    with pytest.raises(ValueError, match="already wrapped"):
        sparsity.install_sparsity(span, predictors)
    sparse = _steps(span, hidden)
    assert handle.stats[0].steps == 3 and handle.stats[0].tokens == 8
    assert 0 < handle.stats[0].selected_density < handle.stats[0].computed_density <= 1  # prefill: the union
    for got, expected in zip(sparse, dense, strict=True):  # misses of ~1% of the active neurons: close, not equal
        torch.testing.assert_close(got, expected, atol=0.1, rtol=0)
    handle.remove()
    assert all("forward" not in layer.mlp.__dict__ for layer in span.layers)
    assert all(torch.equal(got, expected) for got, expected in zip(_steps(span, hidden), dense, strict=True))
    with pytest.raises(RuntimeError), sparsity.sparse_span(span, [sparsity.all_neurons, None, None, None]):
        assert "forward" in span.layers[0].mlp.__dict__ and "forward" not in span.layers[1].mlp.__dict__
        raise RuntimeError("the block fails")
    assert "forward" not in span.layers[0].mlp.__dict__  # removed on the way out


def test_a_hooked_projection_runs_dense(relu_model):
    """A forward hook on a projection (how LoRA rows are added) would be skipped by gathered weights: dense runs."""
    span = load_block_span(relu_model, SpanSpec(0, 1))
    mlp = span.layers[0].mlp
    x = torch.randn(3, SPEC.hidden, generator=torch.Generator().manual_seed(7))  # (tokens, hidden)
    handle = mlp.gate_proj.register_forward_hook(lambda module, args, output: output + 0.5)
    with torch.inference_mode():
        hooked_dense = mlp(x)
        with sparsity.sparse_span(span, [sparsity.oracle_mask]) as installed:
            got = mlp(x)
    handle.remove()
    assert torch.equal(got, hooked_dense) and installed.stats[0].dense_fallbacks == 1


@pytest.mark.parametrize("activation", ["relu", "relu2", "relu6"])
def test_relu_family_activations_are_accepted(activation):
    config = build_config(SPEC, vocab_size=SPEC.vocab)
    config.hidden_act = activation
    sparsity.check_relu_family(config)


def test_a_silu_model_is_refused(tmp_path):
    """A SiLU neuron is never exactly zero, so skipping any would change the output."""
    span = load_block_span(_write_model(tmp_path / "tiny-silu", "silu"), SpanSpec(0, 2))
    with pytest.raises(SparsityUnsupportedError, match="'silu'") as caught:
        sparsity.install_sparsity(span, [sparsity.oracle_mask] * 2)
    assert caught.value.code == "unsupported_sparsity"
    # a node's own model error: a peer naming its code gets no such error rebuilt, only a request error with it
    rebuilt = error_from_code(caught.value.code, caught.value.message)
    assert type(rebuilt) is RequestError and rebuilt.code == "unsupported_sparsity"
    assert all("forward" not in layer.mlp.__dict__ for layer in span.layers)


def test_a_quantized_span_is_refused(relu_model):
    pytest.importorskip("bitsandbytes")
    span = load_block_span(relu_model, SpanSpec(0, 1, quant="int8"))
    with pytest.raises(SparsityUnsupportedError, match="quantized"):
        sparsity.install_sparsity(span, [sparsity.oracle_mask])
