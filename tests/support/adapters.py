"""Random PEFT LoRA adapters for tests, made and saved by peft itself (B not zero: `init_lora_weights=False`)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def save_random_adapter(model_path: str, folder: Path, seed: int, **lora) -> Path:
    """A LoRA adapter of the model in `model_path` with `lora` (LoraConfig fields), saved in `folder`."""
    import peft

    base = AutoModelForCausalLM.from_pretrained(model_path)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(folder)
    return folder


def peft_generate(model_path: str, folder: Path | None, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy tokens of one process: `PeftModel.from_pretrained(base, folder)` (the base model when None)."""
    import peft

    base = AutoModelForCausalLM.from_pretrained(model_path)
    model = base if folder is None else peft.PeftModel.from_pretrained(base, folder)
    with torch.inference_mode():
        return model.generate(
            input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None
        )
