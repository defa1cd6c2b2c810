"""The files a client reads from its model folder besides weights: the weights manifest and known-answer canaries,
each given by the caller or found under its default name."""

from __future__ import annotations

from pathlib import Path

from nesa_node.errors import CanaryFileError, WeightsManifestError
from nesa_node.sharding.weights_manifest import FILE_NAME as MANIFEST_FILE
from nesa_node.sharding.weights_manifest import WeightsManifest
from nesa_node.verification.canaries import FILE_NAME as CANARIES_FILE
from nesa_node.verification.canaries import CanarySet


def read_canaries(given, model_path: str, model_config) -> CanarySet:
    """The canary set `given` names, or the model folder's own; CanaryFileError without one or for another model."""
    if isinstance(given, CanarySet):
        if (given.num_blocks, given.hidden_size) != (model_config.num_hidden_layers, model_config.hidden_size):
            raise CanaryFileError(
                f"canaries of {given.num_blocks} blocks of hidden size {given.hidden_size}, not this model's "
                f"{model_config.num_hidden_layers} of {model_config.hidden_size}"
            )
        return given
    path = Path(given) if given is not None else Path(model_path) / CANARIES_FILE
    if given is None and not path.is_file():
        raise CanaryFileError(
            f'verify="canary:P" needs known answers: none at {path}; `nesa-node model canaries {model_path}` writes '
            "them there, or pass canaries=FILE"
        )
    return CanarySet.read(path, num_blocks=model_config.num_hidden_layers, hidden_size=model_config.hidden_size)


def read_weights_manifest(given, model_path: str, model_config) -> WeightsManifest | None:
    """The manifest `given` names, or the model folder's own when it has one; None without either."""
    if isinstance(given, WeightsManifest):
        manifest = given
    elif given is not None:
        manifest = WeightsManifest.read(given)
    elif (Path(model_path) / MANIFEST_FILE).is_file():
        manifest = WeightsManifest.read(Path(model_path) / MANIFEST_FILE)
    else:
        return None
    if manifest.num_blocks != model_config.num_hidden_layers:
        raise WeightsManifestError(
            f"the weights manifest lists {manifest.num_blocks} blocks, the model has {model_config.num_hidden_layers}"
        )
    return manifest


__all__ = ["read_canaries", "read_weights_manifest"]
