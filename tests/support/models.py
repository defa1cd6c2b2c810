"""Tiny seeded models the tests build (no downloads)."""

ARCHES = ("llama", "mistral", "qwen2")  # the model families nesa-node serves


def greedy_tokens(model_path: str, prompt, new_tokens: int):
    """Single-process greedy generation of exactly `new_tokens` after `prompt` (batch, seq): the reference a swarm's
    tokens must equal."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(model_path)
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
