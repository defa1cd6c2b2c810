"""Sharding: loading a span of transformer blocks from a model folder, and KV cache accounting.

May import torch, transformers, safetensors (and later peft, bitsandbytes); never networking or hivemind.
"""
