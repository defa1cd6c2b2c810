"""Shared fixtures: tiny random models built once per test session (fixed seeds, no downloads)."""

from __future__ import annotations

import pytest
from hypothesis import settings

from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model
from tests.support.models import ARCHES

# properties are checked for correctness, never speed: no per-example deadline (`make test` runs pytest in two workers
# on a 2-core machine, where an example's time says nothing)
settings.register_profile("nesa", deadline=None)
settings.load_profile("nesa")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Path of a 4-block tiny model per architecture."""
    root = tmp_path_factory.mktemp("models")
    return {arch: str(init_tiny_model(root / f"tiny-{arch}", TinyModelSpec(arch=arch, seed=1))) for arch in ARCHES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def trained_model() -> str:
    """The trained tiny Llama of `nesa-node model train-tiny` (4 blocks, hidden 128), trained once per machine and
    cached under ~/.cache/nesa-node/trained: honest activations for accuracy tests."""
    import fcntl

    from nesa_node.devtools.tiny_train import default_cache_dir, train_tiny_model

    # `make test` trains it before pytest (`make trained-model`); a bare pytest run in several workers has the first
    # to need it train it, the others waiting for it instead of training the same weights at once
    default_cache_dir().mkdir(parents=True, exist_ok=True)
    with open(default_cache_dir() / ".tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return str(train_tiny_model(progress=False).path)
