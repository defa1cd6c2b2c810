"""Tiny seeded models the tests build (no downloads)."""

ARCHES = ("llama", "mistral", "qwen2")  # the model families nesa-node serves
