"""The client's edge layers in a LoRA adapter: the token embeddings, the final norm and the LM head, trained whole
next to the nodes' LoRA slices (peft's `modules_to_save`).

A fine-tuning session may train some of them (LoraSpec.edges); they live on the client, which holds these layers
anyway (client/train_edges.py), and end in the PEFT folder as peft writes `modules_to_save`:

    base_model.model.model.embed_tokens.weight   (vocab, hidden)     edge "embed_tokens"
    base_model.model.model.norm.weight           (hidden,)           edge "norm"
    base_model.model.lm_head.weight              (vocab, hidden)     edge "lm_head"

with `modules_to_save` in adapter_config.json naming "model.embed_tokens", "model.norm", "lm_head" (peft matches a
module by the end of its name: "norm" alone would also take every norm inside the blocks, so it is refused). Nodes
never hold these tensors: a node refuses a folder with them (sharding/lora.py), and a client that serves such an
adapter applies them to its own layers.

`EdgeState`: the trained weights, AdamW's two moments of each and the step count, with canonical bytes named by their
sha256 (what a checkpoint keeps, sharding/lora_train.py's OptimizerState for the client's part).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch

from nesa_node.errors import AdapterError, UnsupportedAdapterError
from nesa_node.sharding.state_bytes import CanonicalState, encode_state

EDGE_MODULES = {"embed_tokens": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
EDGE_NAMES = tuple(EDGE_MODULES)
_PEFT_PREFIX = "base_model.model."  # as sharding/lora.py: what a PeftModel's saved keys start with
_MODULE_NAMES = {module: name for name, module in EDGE_MODULES.items()} | {"embed_tokens": "embed_tokens"}
STATE_FORMAT = "nesa-edges-adamw/1"
_STATE_KEY = {"weight", "exp_avg", "exp_avg_sq"}


def check_edge_names(names) -> tuple[str, ...]:
    """`names` in canonical order (EDGE_NAMES), or ValueError naming the allowed ones."""
    names = tuple(names)
    unknown = [name for name in names if name not in EDGE_MODULES]
    if unknown:
        raise ValueError(f"trainable edges must be some of {', '.join(EDGE_NAMES)}; got {', '.join(unknown)}")
    return tuple(name for name in EDGE_NAMES if name in names)


def edges_of_modules_to_save(modules, folder: str | Path) -> tuple[str, ...]:
    """The edge names a PEFT config's `modules_to_save` stands for; UnsupportedAdapterError for any other module."""
    modules = [modules] if isinstance(modules, str) else list(modules or ())
    other = [module for module in modules if module not in _MODULE_NAMES]
    if other:
        raise UnsupportedAdapterError(
            f"{folder}: modules_to_save {other!r} are not supported; only the client's edge layers "
            f"({', '.join(sorted(set(EDGE_MODULES.values())))}) can be trained whole"
        )
    return check_edge_names(_MODULE_NAMES[module] for module in modules)


def edge_shapes(model_config) -> dict[str, tuple[int, ...]]:
    hidden, vocab = model_config.hidden_size, model_config.vocab_size
    return {"embed_tokens": (vocab, hidden), "norm": (hidden,), "lm_head": (vocab, hidden)}


def check_edge_weights(weights: Mapping[str, torch.Tensor], names: tuple[str, ...], model_config, where: str) -> None:
    """AdapterError unless `weights` are exactly the edges `names`, each finite and of this model's shape."""
    if set(weights) != set(names):
        raise AdapterError(f"{where}: edge weights {sorted(weights)} where the adapter trains {list(names)}")
    shapes = edge_shapes(model_config)
    for name, weight in weights.items():
        if tuple(weight.shape) != shapes[name] or not weight.is_floating_point() or not torch.isfinite(weight).all():
            raise AdapterError(
                f"{where}: edge {name} is {tuple(weight.shape)} {weight.dtype}, not a finite {shapes[name]} tensor "
                "of this model"
            )


def check_edge_state(state: EdgeState, names: tuple[str, ...], model_config, where: str) -> None:
    """AdapterError unless `state` holds exactly the edges `names`, finite and of this model's shapes, with AdamW's
    two moments of each (or none: no step taken yet) finite, of their weight's shape, the second never negative."""
    check_edge_weights(state.weights, names, model_config, where)
    expected = {f"{name}.{moment}" for name in names for moment in ("exp_avg", "exp_avg_sq")}
    if state.moments and set(state.moments) != expected:
        raise AdapterError(f"{where}: the moments do not name exactly the trained edges")
    for key, moment in state.moments.items():
        if moment.shape != state.weights[key.partition(".")[0]].shape or not torch.isfinite(moment).all():
            raise AdapterError(f"{where}: {key} is not of its weight's shape or not finite")
        if key.endswith("exp_avg_sq") and (moment < 0).any():
            raise AdapterError(f"{where}: {key} has a negative value")


def peft_edge_key(name: str) -> str:
    return f"{_PEFT_PREFIX}{EDGE_MODULES[name]}.weight"


def read_edge_weights(folder: str | Path, names: tuple[str, ...], model_config) -> dict[str, torch.Tensor]:
    """The edge weights `names` of the PEFT adapter in `folder` (float32), checked against the model."""
    from safetensors import SafetensorError, safe_open

    path = Path(folder) / "adapter_model.safetensors"
    weights = {}
    try:
        with safe_open(str(path), framework="pt") as tensors:
            keys = set(tensors.keys())
            for name in names:
                if peft_edge_key(name) not in keys:
                    raise AdapterError(f"{folder}: modules_to_save names {EDGE_MODULES[name]} but it has no weight")
                weights[name] = tensors.get_tensor(peft_edge_key(name)).float()
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"{folder}: cannot read the edge weights ({type(exc).__name__}: {exc})") from None
    check_edge_weights(weights, names, model_config, str(folder))
    return weights


@dataclasses.dataclass(frozen=True, eq=False)
class EdgeState(CanonicalState):
    """Trained edge weights {name: tensor}, AdamW's moments {"<name>.exp_avg" | "<name>.exp_avg_sq": tensor} (empty
    before the first step) and the step count, float32."""

    step: int
    weights: dict[str, torch.Tensor]
    moments: dict[str, torch.Tensor]

    METADATA_KEY = "nesa_edges"
    WHAT = "edge state"

    def to_bytes(self) -> bytes:
        tensors = {f"{name}.weight": tensor for name, tensor in self.weights.items()} | dict(self.moments)
        return encode_state(tensors, self.METADATA_KEY, {"format": STATE_FORMAT, "step": self.step})

    @classmethod
    def _build(cls, described: dict, tensors: dict[str, torch.Tensor]) -> EdgeState:
        step = described["step"]
        if described["format"] != STATE_FORMAT or type(step) is not int or step < 0:
            raise ValueError(f"format {described['format']!r}, step {step!r}")
        weights, moments = {}, {}
        for key, tensor in tensors.items():
            name, _, kind = key.partition(".")
            if name not in EDGE_MODULES or kind not in _STATE_KEY or tensor.dtype != torch.float32:
                raise ValueError(f"tensor {key!r} is not a float32 edge weight or moment")
            (weights if kind == "weight" else moments)[name if kind == "weight" else key] = tensor
        if moments and {key.partition(".")[0] for key in moments} != set(weights):
            raise ValueError("moments of other edges than the weights")
        return cls(step, weights, moments)


__all__ = [
    "EDGE_MODULES",
    "EDGE_NAMES",
    "EdgeState",
    "check_edge_names",
    "check_edge_state",
    "check_edge_weights",
    "edge_shapes",
    "edges_of_modules_to_save",
    "peft_edge_key",
    "read_edge_weights",
]
