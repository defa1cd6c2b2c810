"""Shared fixtures: tiny random models built once per test session (fixed seeds, no downloads)."""

from __future__ import annotations

import pytest

from nesa_node.model_init import TinyModelSpec, init_tiny_model

ARCHES = ("llama", "mistral", "qwen2")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Path of a 4-block tiny model per architecture."""
    root = tmp_path_factory.mktemp("models")
    return {arch: str(init_tiny_model(root / f"tiny-{arch}", TinyModelSpec(arch=arch, seed=1))) for arch in ARCHES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]
