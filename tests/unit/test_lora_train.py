"""sharding/lora_train.py: a new adapter's initial factors, the PEFT folder a session writes, trainable slices."""

from __future__ import annotations

import math

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node.errors import UnsupportedAdapterError
from nesa_node.sharding.blocks import load_config
from nesa_node.sharding.lora import load_adapter_slice
from nesa_node.sharding.lora_train import LoraSpec, TrainableSlice, init_adapter, save_peft_adapter, spec_of_folder


def test_a_new_adapter_starts_as_peft_starts_one(tiny_llama):
    config = load_config(tiny_llama)
    spec = LoraSpec(rank=4, alpha=8, targets=("v_proj", "q_proj"))
    assert spec.targets == ("q_proj", "v_proj")  # the model's order, whatever the caller's
    first, again, other = (init_adapter(config, spec, seed) for seed in (3, 3, 4))
    assert first.sha256 == again.sha256 != other.sha256
    assert len(first.factors) == 2 * config.num_hidden_layers
    for (_, projection), factor in first.factors.items():
        assert projection in ("self_attn.q_proj", "self_attn.v_proj")
        assert torch.count_nonzero(factor.lora_b) == 0  # the adapter starts as the base model
        bound = 1 / math.sqrt(factor.lora_a.shape[1])  # peft: kaiming_uniform_(a=sqrt(5))
        assert factor.lora_a.abs().max() <= bound and factor.lora_a.abs().max() > 0.8 * bound
        assert factor.scale == 2.0
    assert LoraSpec(rank=4, alpha=8, use_rslora=True).scale == 4.0


@pytest.mark.parametrize("bad", [dict(rank=0), dict(alpha=0.0), dict(targets=("lm_head",)), dict(targets=())])
def test_a_bad_spec_is_refused(bad):
    with pytest.raises(ValueError):
        LoraSpec(**bad)


def test_the_written_folder_is_a_peft_adapter_of_the_same_factors(tiny_llama, tmp_path):
    config = load_config(tiny_llama)
    spec = LoraSpec(rank=2, alpha=4, targets=("k_proj", "down_proj"))
    whole = init_adapter(config, spec, seed=1)
    trainable = TrainableSlice(whole)
    with torch.no_grad():
        for _, lora_b, _ in trainable.factors.values():
            lora_b.normal_()  # a trained adapter: B no longer zero
    trained = trainable.snapshot()
    folder = save_peft_adapter(trained, spec, tmp_path / "adapter", base_model=tiny_llama)
    assert load_adapter_slice(folder, config).sha256 == trained.sha256
    assert spec_of_folder(folder) == spec
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    loaded = peft.PeftModel.from_pretrained(base, folder)
    weight = loaded.base_model.model.model.layers[1].mlp.down_proj.lora_B["default"].weight
    assert torch.equal(weight.detach(), trained.factors[(1, "mlp.down_proj")].lora_b)


def test_a_folder_with_rank_patterns_cannot_be_trained(tiny_llama, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], rank_pattern={"layers.0.self_attn.q_proj": 4})
    peft.get_peft_model(base, config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedAdapterError):
        spec_of_folder(tmp_path)
