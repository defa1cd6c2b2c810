"""LoRA adapters that learn: a node's trainable slice, a fresh adapter's initial factors, and the PEFT folder a
training session hands its user.

Nesa paper section 2.4.2: every node runs its blocks with its own slice of the adapter, gradients flow back from
the last block, and each node updates only its slice (eq. 7, theta <- theta - eta * grad, the SGD case; AdamW here,
as peft users train). The optimizer is elementwise, so slices updated on different nodes with the gradients of the
same loss end where one process updating the whole adapter ends: no node needs another's parameters.

- `LoraSpec`: rank, alpha, targeted projections, rsLoRA; `scale` is peft's (alpha / r, or alpha / sqrt(r)).
- `init_adapter(model_config, spec, seed)`: an AdapterSlice of every block, initialised as peft initialises a new
  adapter (A Kaiming-uniform with a = sqrt(5), B zero: the adapter starts as the base model).
- `spec_of_folder(folder)`: the LoraSpec of a PEFT adapter folder a session starts from (one rank and alpha for
  every module: rank_pattern and alpha_pattern are refused with UnsupportedAdapterError).
- `TrainableSlice(piece, device)`: the slice's factors as float32 parameters on `device`; `factors` is what
  sharding/lora_rows.py `trainable_adapter` runs; `snapshot()` the AdapterSlice of their current values.
- `save_peft_adapter(whole, spec, folder, base_model=...)`: `adapter_model.safetensors` and `adapter_config.json`,
  as `PeftModel.save_pretrained` writes them, so `PeftModel.from_pretrained` loads it and nodes serve it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn

from nesa_node.errors import AdapterError, UnsupportedAdapterError
from nesa_node.sharding.lora import (
    _PEFT_PREFIX,
    PROJECTIONS,
    AdapterSlice,
    LoraFactors,
    Target,
    projection_shapes,
    read_adapter_config,
)

SHORT_NAMES = {projection.split(".")[-1]: projection for projection in PROJECTIONS}  # "q_proj" -> "self_attn.q_proj"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What a trained adapter is: its rank, alpha and targeted projections (short names, as peft's target_modules)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= 1 << 16:
            raise ValueError(f"rank must be between 1 and 65536, got {self.rank}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"alpha must be a positive number, got {self.alpha}")
        unknown = [name for name in self.targets if name not in SHORT_NAMES]
        if unknown or not self.targets:
            raise ValueError(
                f"targets must be some of {', '.join(SHORT_NAMES)}; got {', '.join(self.targets) or 'none'}"
            )
        object.__setattr__(self, "targets", tuple(name for name in SHORT_NAMES if name in self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def peft_config(self, base_model: str | None = None):
        import peft

        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=list(self.targets),
            lora_dropout=0.0,
            bias="none",
            use_rslora=self.use_rslora,
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model,
        )


def init_adapter(model_config, spec: LoraSpec, seed: int) -> AdapterSlice:
    """A new adapter over every block of the model, initialised as peft does (A Kaiming-uniform, B zero), from a
    generator seeded with `seed` (the global RNG is left alone)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(model_config)
    factors: dict[Target, LoraFactors] = {}
    for block in range(model_config.num_hidden_layers):
        for name in spec.targets:
            projection = SHORT_NAMES[name]
            in_features, out_features = shapes[projection]
            lora_a = torch.empty(spec.rank, in_features)
            bound = 1.0 / math.sqrt(
                in_features
            )  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain*sqrt(3/fan_in)
            lora_a.uniform_(-bound, bound, generator=generator)
            factors[(block, projection)] = LoraFactors(lora_a, torch.zeros(out_features, spec.rank), spec.scale)
    return AdapterSlice(0, model_config.num_hidden_layers, factors)


def spec_of_folder(folder: str | Path) -> LoraSpec:
    """The LoraSpec of the PEFT adapter in `folder` (AdapterError for a missing or unreadable one)."""
    config = read_adapter_config(folder)
    if config.rank_pattern or config.alpha_pattern:
        raise UnsupportedAdapterError(
            f"{folder}: training an adapter with rank_pattern or alpha_pattern is not supported; one rank and alpha "
            "for every module"
        )
    modules = config.target_modules
    names = [modules] if isinstance(modules, str) else sorted(modules or ())
    targets = tuple(name.split(".")[-1] for name in names if name.split(".")[-1] in SHORT_NAMES)
    if not targets:
        raise UnsupportedAdapterError(f"{folder}: target_modules {modules!r} name none of {', '.join(SHORT_NAMES)}")
    return LoraSpec(rank=config.r, alpha=float(config.lora_alpha), targets=targets, use_rslora=config.use_rslora)


class TrainableSlice:
    """An AdapterSlice's factors as float32 parameters on `device`, updated in place by the node's optimizer."""

    def __init__(self, piece: AdapterSlice, device: str | torch.device = "cpu"):
        self.start, self.end = piece.start, piece.end
        self.factors: dict[Target, tuple[nn.Parameter, nn.Parameter, float]] = {}
        with torch.inference_mode(False):
            for target, factor in piece.factors.items():
                lora_a = nn.Parameter(factor.lora_a.detach().to(device, torch.float32).clone())
                lora_b = nn.Parameter(factor.lora_b.detach().to(device, torch.float32).clone())
                self.factors[target] = (lora_a, lora_b, factor.scale)

    def parameters(self) -> list[nn.Parameter]:
        return [tensor for lora_a, lora_b, _ in self.factors.values() for tensor in (lora_a, lora_b)]

    @property
    def nbytes(self) -> int:
        return sum(parameter.nbytes for parameter in self.parameters())

    def check_fits(self, span) -> None:
        """AdapterError unless every factor fits `span`'s projection of its block and lies inside the span."""
        for (block, projection), (lora_a, lora_b, _) in self.factors.items():
            if not span.start <= block < span.end:
                raise AdapterError(f"adapter factors of block {block} on a node serving {span.start}:{span.end}")
            module = span.layers[block - span.start].get_submodule(projection)
            if lora_a.shape[1] != module.in_features or lora_b.shape[0] != module.out_features:
                raise AdapterError(
                    f"adapter factors of block {block} {projection} are A {tuple(lora_a.shape)} and B "
                    f"{tuple(lora_b.shape)}; the model's projection is {module.in_features} -> {module.out_features}"
                )

    def snapshot(self) -> AdapterSlice:
        """The slice of the parameters' current values (float32, on the CPU)."""
        factors = {
            target: LoraFactors(lora_a.detach().cpu().clone(), lora_b.detach().cpu().clone(), scale)
            for target, (lora_a, lora_b, scale) in self.factors.items()
        }
        return AdapterSlice(self.start, self.end, factors)


def save_peft_adapter(
    whole: AdapterSlice, spec: LoraSpec, folder: str | Path, *, base_model: str | None = None
) -> Path:
    """Write `whole` (every block of the model) as a PEFT LoRA folder: `adapter_model.safetensors` with peft's key
    names and `adapter_config.json` from `spec`. Returns the folder."""
    from safetensors.torch import save_file

    for (block, projection), factor in whole.factors.items():
        if projection.split(".")[-1] not in spec.targets or not math.isclose(factor.scale, spec.scale):
            raise AdapterError(f"block {block} {projection} does not match the adapter's spec {spec}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (block, projection), factor in whole.factors.items():
        name = f"{_PEFT_PREFIX}model.layers.{block}.{projection}"
        tensors[f"{name}.lora_A.weight"] = factor.lora_a.detach().cpu().contiguous()
        tensors[f"{name}.lora_B.weight"] = factor.lora_b.detach().cpu().contiguous()
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    spec.peft_config(base_model).save_pretrained(str(folder))
    return folder


__all__ = ["SHORT_NAMES", "LoraSpec", "TrainableSlice", "init_adapter", "save_peft_adapter", "spec_of_folder"]
