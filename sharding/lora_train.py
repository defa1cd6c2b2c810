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
  every module: rank_pattern and alpha_pattern are refused with UnsupportedAdapterError; modules_to_save only of the
  client's edge layers, LoraSpec.edges, sharding/lora_edges.py).
- `TrainableSlice(piece, device)`: the slice's factors as float32 parameters on `device`; `factors` is what
  sharding/lora_rows.py `trainable_adapter` runs; `snapshot()` the AdapterSlice of their current values.
- `OptimizerState`: AdamW's moments of a slice's parameters and its step count, with canonical bytes (a
  checkpoint, or what a replacement node restores); `TrainableSlice.optimizer_state` / `restore_optimizer`.
- `save_peft_adapter(whole, spec, folder, base_model=..., edges=...)`: `adapter_model.safetensors` and
  `adapter_config.json`, as `PeftModel.save_pretrained` writes them, so `PeftModel.from_pretrained` loads it and
  nodes serve it (with trained edge layers: a client that names the folder serves it, applying them itself).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
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
from nesa_node.sharding.lora_edges import EDGE_MODULES, check_edge_names, edges_of_modules_to_save, peft_edge_key
from nesa_node.sharding.state_bytes import CanonicalState, encode_state

OPTIMIZER_FORMAT = "nesa-lora-adamw/1"
_MOMENT_KEY = re.compile(r"\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.lora_[AB]\.exp_avg(_sq)?")
SHORT_NAMES = {projection.split(".")[-1]: projection for projection in PROJECTIONS}  # "q_proj" -> "self_attn.q_proj"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What a trained adapter is: its rank, alpha and targeted projections (short names, as peft's target_modules)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    use_rslora: bool = False
    edges: tuple[str, ...] = ()  # client edge layers trained whole (sharding/lora_edges.py): peft's modules_to_save

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
        object.__setattr__(self, "edges", check_edge_names(self.edges))

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
            modules_to_save=[EDGE_MODULES[name] for name in self.edges] or None,
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
    other = [name for name in names if name.split(".")[-1] not in SHORT_NAMES]
    if other and not isinstance(modules, str):
        raise UnsupportedAdapterError(
            f"{folder}: target_modules {other!r} are not projections inside the blocks; a session trains LoRA on "
            f"{', '.join(SHORT_NAMES)} and the edge layers whole (modules_to_save)"
        )
    if not targets:
        raise UnsupportedAdapterError(f"{folder}: target_modules {modules!r} name none of {', '.join(SHORT_NAMES)}")
    edges = edges_of_modules_to_save(config.modules_to_save, folder)
    return LoraSpec(
        rank=config.r, alpha=float(config.lora_alpha), targets=targets, use_rslora=config.use_rslora, edges=edges
    )


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

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """{"<block>.<projection>.lora_A|lora_B": parameter}: the names optimizer state is stored under."""
        named = {}
        for (block, projection), (lora_a, lora_b, _) in self.factors.items():
            named[f"{block}.{projection}.lora_A"] = lora_a
            named[f"{block}.{projection}.lora_B"] = lora_b
        return named

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> OptimizerState:
        """AdamW's moments of every parameter (none yet before the first step) and its step count."""
        tensors, step = {}, 0
        for name, parameter in self.named_parameters().items():
            state = optimizer.state.get(parameter)
            if not state:
                continue
            step = int(state["step"])
            tensors[f"{name}.exp_avg"] = state["exp_avg"].detach().cpu().clone()
            tensors[f"{name}.exp_avg_sq"] = state["exp_avg_sq"].detach().cpu().clone()
        return OptimizerState(self.start, self.end, step, tensors)

    def restore_optimizer(self, optimizer: torch.optim.Optimizer, saved: OptimizerState) -> None:
        """Put `saved` (of this slice's blocks) into `optimizer`'s state; AdapterError when it does not match the
        parameters (a moment missing, of another shape, or not finite)."""
        if (saved.start, saved.end) != (self.start, self.end):
            raise AdapterError(
                f"optimizer state of blocks {saved.start}:{saved.end}, the slice's are {self.start}:{self.end}"
            )
        named = self.named_parameters()
        expected = {f"{name}.{moment}" for name in named for moment in ("exp_avg", "exp_avg_sq")}
        if saved.tensors and set(saved.tensors) != expected:
            raise AdapterError("optimizer state does not name exactly the slice's parameters")
        for name, parameter in named.items():
            if not saved.tensors:
                break
            moments = [saved.tensors[f"{name}.{moment}"] for moment in ("exp_avg", "exp_avg_sq")]
            for moment in moments:
                if moment.shape != parameter.shape or not torch.isfinite(moment).all():
                    raise AdapterError(
                        f"optimizer state of {name} is not of shape {tuple(parameter.shape)} or not finite"
                    )
            if (moments[1] < 0).any():
                raise AdapterError(f"optimizer state of {name} has a negative second moment")
            device = parameter.device
            optimizer.state[parameter] = {
                "step": torch.tensor(float(saved.step)),
                "exp_avg": moments[0].to(device, torch.float32).clone(),
                "exp_avg_sq": moments[1].to(device, torch.float32).clone(),
            }

    def snapshot(self) -> AdapterSlice:
        """The slice of the parameters' current values (float32, on the CPU)."""
        factors = {
            target: LoraFactors(lora_a.detach().cpu().clone(), lora_b.detach().cpu().clone(), scale)
            for target, (lora_a, lora_b, scale) in self.factors.items()
        }
        return AdapterSlice(self.start, self.end, factors)


@dataclasses.dataclass(frozen=True, eq=False)
class OptimizerState(CanonicalState):
    """AdamW's moments of the LoRA parameters of blocks [start, end) ("<block>.<projection>.lora_A|lora_B.exp_avg"
    and ".exp_avg_sq", float32; empty before the first step) and its step count. Canonical bytes as an AdapterSlice's:
    safetensors plus one sorted JSON metadata entry, named by their sha256."""

    METADATA_KEY = "nesa_optimizer"
    WHAT = "optimizer state"

    start: int
    end: int
    step: int
    tensors: dict[str, torch.Tensor]

    def to_bytes(self) -> bytes:
        header = {"format": OPTIMIZER_FORMAT, "start": self.start, "end": self.end, "step": self.step}
        return encode_state(self.tensors, self.METADATA_KEY, header)

    @classmethod
    def _build(cls, described: dict, tensors: dict[str, torch.Tensor]) -> OptimizerState:
        start, end, step = described["start"], described["end"], described["step"]
        if described["format"] != OPTIMIZER_FORMAT or not all(type(v) is int for v in (start, end, step)):
            raise ValueError(f"format {described['format']!r}, blocks {start!r}:{end!r}, step {step!r}")
        if not 0 <= start < end or step < 0:
            raise ValueError(f"blocks {start}:{end}, step {step}")
        if not all(_MOMENT_KEY.fullmatch(name) and t.dtype == torch.float32 for name, t in tensors.items()):
            raise ValueError("a tensor that is not a float32 moment of a LoRA factor")
        return cls(start, end, step, dict(tensors))

    def narrow(self, start: int, end: int) -> OptimizerState:
        """The state of blocks [start, end), a part of these."""
        if not self.start <= start < end <= self.end:
            raise AdapterError(f"blocks {start}:{end} are not a part of this state's {self.start}:{self.end}")
        kept = {name: tensor for name, tensor in self.tensors.items() if start <= int(name.split(".")[0]) < end}
        return OptimizerState(start, end, self.step, kept)


def merge_optimizer_states(states: list[OptimizerState]) -> OptimizerState:
    """One state of adjacent `states` taken at the same step."""
    ordered = sorted(states, key=lambda state: state.start)
    if not ordered or len({state.step for state in ordered}) != 1:
        raise AdapterError("optimizer states to merge must be of the same step")
    for previous, following in zip(ordered, ordered[1:], strict=False):
        if following.start != previous.end:
            raise AdapterError(f"optimizer states {previous.start}:{previous.end} and {following.start}: do not meet")
    tensors = {name: tensor for state in ordered for name, tensor in state.tensors.items()}
    return OptimizerState(ordered[0].start, ordered[-1].end, ordered[0].step, tensors)


def save_peft_adapter(
    whole: AdapterSlice,
    spec: LoraSpec,
    folder: str | Path,
    *,
    base_model: str | None = None,
    edges: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write `whole` (every block of the model) as a PEFT LoRA folder: `adapter_model.safetensors` with peft's key
    names and `adapter_config.json` from `spec`; `edges`: the weights of the edge layers the spec trains (its
    modules_to_save, sharding/lora_edges.py). Returns the folder."""
    from safetensors.torch import save_file

    if set(edges or {}) != set(spec.edges):
        raise AdapterError(f"edge weights {sorted(edges or {})} for an adapter that trains {list(spec.edges)}")

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
    for name, weight in (edges or {}).items():
        tensors[peft_edge_key(name)] = weight.detach().cpu().contiguous()
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    spec.peft_config(base_model).save_pretrained(str(folder))
    return folder


__all__ = [
    "SHORT_NAMES",
    "LoraSpec",
    "OptimizerState",
    "TrainableSlice",
    "init_adapter",
    "merge_optimizer_states",
    "save_peft_adapter",
    "spec_of_folder",
]
