"""LoRA adapters on a node's blocks: slices of a PEFT adapter, read from a folder, and their canonical bytes.

Nesa paper section 2.4, eq. 6 (W' = W + BA). A standard PEFT LoRA folder (`adapter_config.json` and
`adapter_model.safetensors`, as `PeftModel.save_pretrained` writes it) is read with peft's own config class and its
target, rank and alpha matching; a node keeps only the factors of its blocks [start, end): an `AdapterSlice`. Each
targeted projection then gets scale * B A, with

    A (r, in_features), B (out_features, r)
    scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (rsLoRA), r and lora_alpha per module from
    rank_pattern / alpha_pattern

The adapter is split over three modules; this one re-exports the public names of the other two, so
`from nesa_node.sharding.lora import ...` reaches all of them:

- here: `load_adapter_slice(folder, model_config, start, end)` -> AdapterSlice of blocks [start, end) (all blocks
  when end is None); `read_adapter_config(folder)` checks a folder's config alone (no weights read).
  `AdapterSlice`: start, end, rank (largest r), sha256 (hex, the slice's name), nbytes (length of its canonical
  bytes: what a node's adapter budget counts), resident_bytes (plus the float32 device copies it made to run),
  factors ({(block, projection): LoraFactors}), to_bytes(), `AdapterSlice.from_bytes(data, expected_sha256)` (what
  a node calls on bytes fetched from a peer or a client), narrow(start, end), block_hashes() (the sha256 of each
  block's own slice). `merge_slices(slices)` joins adjacent slices.
- sharding/lora_rows.py, applying slices per row of a step: `adapters_for_rows(span, rows, blocks=...)`,
  `enable_lora(span)`, `disable_lora(span)`.
- sharding/lora_identity.py, the same adapter named the same way on every node: `AdapterManifest` (one hash per
  block of the whole model; its sha256 is the adapter id), `adapter_manifest`, `check_slice`, `slice_blobs` and
  `slice_from_blocks` (per-block bytes fetched from a peer, each checked against the manifest).

Refused with UnsupportedAdapterError (code "unsupported_adapter"): PEFT types other than LORA (AdaLoRA included),
DoRA and every other LoRA variant peft marks as such (aLoRA, VeLoRA, BD-LoRA, Arrow, KaSA, MiCA, ...), initialisations
that rewrite the base weights unless converted to plain LoRA at save time (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA),
bias != "none", lora_bias, fan_in_fan_out, target_parameters, layer_replication, QA-LoRA, and any tensor inside the
blocks that is not a LoRA A or B weight of one of the seven projections (modules_to_save there, DoRA magnitudes).
Tensors outside the blocks (LoRA on lm_head or embed_tokens, modules_to_save of the head, trainable tokens) belong to
the client's edge layers: refused unless named in `outside_allowed`, for a caller that applies them itself.
AdapterError (code "adapter"): a missing or unreadable folder, weights that disagree with the config, factors whose
shapes do not fit the model, a slice that does not cover the blocks a step runs. AdapterHashError (code
"adapter_hash"): bytes whose sha256 is not the expected name.

Canonical bytes: safetensors with the tensors "<block>.<projection>.lora_A|lora_B" in their stored dtype and one
metadata entry holding sorted JSON (format, start, end, scale per projection). One entry because safetensors writes
several in the order of a Rust HashMap, which changes from process to process; tensors it orders by dtype and name.
The same adapter sliced the same way on any node gives the same bytes with the same safetensors version (pinned in
constraints.txt); `from_bytes` accepts only bytes in that exact form.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
import struct
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from nesa_node.errors import AdapterError, AdapterHashError, UnsupportedAdapterError
from nesa_node.sharding.lora_edges import EDGE_MODULES
from nesa_node.sharding.lora_identity import (
    AdapterManifest,
    adapter_manifest,
    check_slice,
    slice_blobs,
    slice_from_blocks,
)
from nesa_node.sharding.lora_rows import adapters_for_rows, disable_lora, enable_lora

# the projections of a Llama, Mistral or Qwen2 decoder layer peft can target, as named inside the layer
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
SLICE_FORMAT = "nesa-lora-slice/1"
_METADATA_KEY = "nesa_lora"
_PEFT_PREFIX = "base_model.model."  # PeftModel(base) -> LoraModel -> the causal LM: what saved keys start with
_BLOCK_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FACTOR_KEY = re.compile(r"(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.lora_([AB])\.weight")
_SLICE_KEY = re.compile(r"(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.lora_([AB])")
# inits that change the base weights themselves; peft's save_pretrained(path_initial_model_for_weight_conversion=...)
# turns such an adapter into plain LoRA over the original base
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Target = tuple[int, str]  # (block index in the whole model, projection name such as "self_attn.q_proj")


@dataclasses.dataclass(frozen=True, eq=False)
class LoraFactors:
    """The low-rank update of one projection: scale * B @ A."""

    lora_a: torch.Tensor  # (rank, in_features)
    lora_b: torch.Tensor  # (out_features, rank)
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


class AdapterSlice:
    """The LoRA factors of blocks [start, end) of one adapter, named by the sha256 of their canonical bytes.

    Immutable by contract: the tensors are the slice's identity, never change them in place. Equality is identity;
    compare `sha256` to ask whether two slices hold the same adapter.
    """

    __slots__ = ("start", "end", "factors", "sha256", "nbytes", "_block_hashes", "_device_copies", "__weakref__")

    def __init__(self, start: int, end: int, factors: Mapping[Target, LoraFactors]):
        if not 0 <= start < end:
            raise AdapterError(f"an adapter slice needs 0 <= start < end, got {start}:{end}")
        for (block, projection), factor in factors.items():
            _check_factor(block, projection, factor, start, end)
        self.start, self.end = start, end
        self.factors: Mapping[Target, LoraFactors] = MappingProxyType(dict(sorted(factors.items())))
        data = self.to_bytes()
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.nbytes = len(data)
        self._block_hashes: tuple[str, ...] | None = None
        self._device_copies: dict[str, dict[Target, tuple[torch.Tensor, torch.Tensor, float]]] = {}

    def __repr__(self) -> str:
        return f"AdapterSlice(blocks {self.start}:{self.end}, rank {self.rank}, sha256 {self.sha256[:16]})"

    @property
    def rank(self) -> int:
        """The largest rank of its projections (0 when the adapter targets none of these blocks)."""
        return max((factor.rank for factor in self.factors.values()), default=0)

    @property
    def resident_bytes(self) -> int:
        """Bytes held: the factors as stored plus the float32 device copies made to run them (not the same tensors)."""
        stored = {id(tensor) for factor in self.factors.values() for tensor in (factor.lora_a, factor.lora_b)}
        copies = sum(
            tensor.nbytes
            for on_device in self._device_copies.values()
            for lora_a, lora_b, _ in on_device.values()
            for tensor in (lora_a, lora_b)
            if id(tensor) not in stored
        )
        return sum(t.nbytes for f in self.factors.values() for t in (f.lora_a, f.lora_b)) + copies

    def run_bytes(self, device: torch.device | str) -> int:
        """Bytes of the float32 copies `device_factors(device)` makes beside the stored factors (0 where those are
        float32 on `device` already): with `nbytes`, what a node's adapter budget charges for running the slice there."""
        device = torch.device(device)
        return sum(
            tensor.numel() * 4
            for factor in self.factors.values()
            for tensor in (factor.lora_a, factor.lora_b)
            if tensor.dtype != torch.float32
            or tensor.device.type != device.type
            or (device.index is not None and tensor.device.index != device.index)
        )

    def to_bytes(self) -> bytes:
        """The canonical bytes (module docstring): what travels to peers and what `sha256` names."""
        from safetensors.torch import save

        tensors, scales = {}, {}
        for (block, projection), factor in self.factors.items():
            name = f"{block}.{projection}"
            tensors[f"{name}.lora_A"] = factor.lora_a.detach().cpu().contiguous()
            tensors[f"{name}.lora_B"] = factor.lora_b.detach().cpu().contiguous()
            scales[name] = factor.scale
        header = {"format": SLICE_FORMAT, "start": self.start, "end": self.end, "scales": scales}
        metadata = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return save(tensors, metadata={_METADATA_KEY: metadata})

    @classmethod
    def from_bytes(cls, data: bytes, expected_sha256: str) -> AdapterSlice:
        """The slice `data` holds, once its sha256 equals `expected_sha256` (hex) and it is in canonical form.

        Raises AdapterHashError when the hash differs (a changed byte: fetch from another peer), AdapterError when
        matching bytes are not a well-formed canonical slice."""
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_sha256.lower():
            raise AdapterHashError(
                f"adapter slice bytes hash to {actual[:16]}…, not the {expected_sha256[:16]}… asked for: corrupted "
                "or tampered, refused; fetch the slice from another peer"
            )
        start, end, factors = _parse_slice(data)
        result = cls(start, end, factors)
        if result.sha256 != actual:
            raise AdapterError("adapter slice bytes are not in canonical form (re-serialized they differ); refused")
        return result

    def narrow(self, start: int, end: int) -> AdapterSlice:
        """The slice of blocks [start, end), a part of this one (itself when the range is its own)."""
        if not self.start <= start < end <= self.end:
            raise AdapterError(f"blocks {start}:{end} are not a part of this slice's {self.start}:{self.end}")
        if (start, end) == (self.start, self.end):
            return self
        return AdapterSlice(start, end, {key: f for key, f in self.factors.items() if start <= key[0] < end})

    def block_hashes(self) -> tuple[str, ...]:
        """The sha256 (hex) of each block's own slice, `narrow(b, b + 1).to_bytes()` for b in [start, end): a block
        the adapter does not target has the hash of its empty slice. What an AdapterManifest lists (lora_identity)."""
        if self._block_hashes is None:  # computed once: the factors never change (class docstring)
            self._block_hashes = tuple(self.narrow(block, block + 1).sha256 for block in range(self.start, self.end))
        return self._block_hashes

    def device_factors(self, device: torch.device) -> dict[Target, tuple[torch.Tensor, torch.Tensor, float]]:
        """(A, B, scale) per target in float32 on `device`, made once per device (same tensors when already there):
        what sharding/lora_rows.py runs. Counted in resident_bytes."""
        key = str(device)
        on_device = self._device_copies.get(key)
        if on_device is None:
            # made once, whatever the grad mode of the first step; copies made under inference_mode would be
            # inference tensors, which a later autograd pass (a training service) cannot save for backward
            with torch.inference_mode(False):
                on_device = {
                    target: (f.lora_a.to(device, torch.float32), f.lora_b.to(device, torch.float32), f.scale)
                    for target, f in self.factors.items()
                }
            self._device_copies[key] = on_device
        return on_device


def merge_slices(slices: Iterable[AdapterSlice]) -> AdapterSlice:
    """One slice of the adjacent `slices` (in any order; their ranges must meet end to start without a gap)."""
    ordered = sorted(slices, key=lambda item: item.start)
    if not ordered:
        raise AdapterError("no slices to merge")
    factors: dict[Target, LoraFactors] = {}
    for previous, following in zip(ordered, ordered[1:], strict=False):
        if following.start != previous.end:
            raise AdapterError(
                f"slices {previous.start}:{previous.end} and {following.start}:{following.end} do not meet"
            )
    for item in ordered:
        factors.update(item.factors)
    return AdapterSlice(ordered[0].start, ordered[-1].end, factors)


# ---- loading a PEFT folder -------------------------------------------------------------------------------------


def read_adapter_config(folder: str | Path):
    """The peft LoraConfig of an adapter folder, once nesa-node can serve it (see the module docstring).

    Raises AdapterError for a missing or unreadable config, UnsupportedAdapterError for what is not served."""
    from peft import PeftConfig, PeftType
    from peft.utils import CONFIG_NAME

    path = Path(folder)
    if not (path / CONFIG_NAME).is_file():  # checked first: peft would try the Hugging Face Hub for a missing file
        raise AdapterError(f"{path} has no {CONFIG_NAME}; point at a folder PeftModel.save_pretrained wrote")
    try:
        config = PeftConfig.from_pretrained(str(path))
    except Exception as exc:  # a bad JSON, an unknown peft_type or field: peft raises several kinds
        raise AdapterError(f"{path / CONFIG_NAME} cannot be read by peft ({type(exc).__name__}: {exc})") from None
    if config.peft_type != PeftType.LORA:
        raise UnsupportedAdapterError(f"{path} is a {config.peft_type} adapter; nesa-node serves LoRA adapters only")
    _check_supported(config, path)
    return config


def _check_supported(config, path: Path) -> None:
    refusals = []
    if config.use_dora:
        refusals.append("DoRA (use_dora=True): merge it into the base weights or retrain as plain LoRA")
    for field in dataclasses.fields(config):  # peft's own list of the options that select a LoRA variant
        if field.metadata.get("is_lora_variant") and field.name != "use_dora" and getattr(config, field.name):
            refusals.append(f"the LoRA variant {field.name}")
        if field.name == "init_lora_weights" and config.init_lora_weights in field.metadata.get("lora_variants", ()):
            refusals.append(f"the LoRA variant init_lora_weights={config.init_lora_weights!r}")
    init = config.init_lora_weights
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        refusals.append(
            f"init_lora_weights={init!r} changes the base weights; save it converted to plain LoRA "
            "(save_pretrained(..., path_initial_model_for_weight_conversion=...))"
        )
    if config.bias != "none":
        refusals.append(f'bias={config.bias!r} (trained base biases); only bias="none" is served')
    if getattr(config, "lora_bias", False):
        refusals.append("lora_bias=True")
    if config.fan_in_fan_out:
        refusals.append("fan_in_fan_out=True (Conv1D-style weights; Llama, Mistral and Qwen2 use nn.Linear)")
    if getattr(config, "target_parameters", None):
        refusals.append("target_parameters")
    if getattr(config, "layer_replication", None):
        refusals.append("layer_replication")
    if getattr(config, "use_qalora", False):
        refusals.append("QA-LoRA (use_qalora=True)")
    if refusals:
        raise UnsupportedAdapterError(f"{path}: nesa-node does not serve {'; '.join(refusals)}")


def load_adapter_slice(
    folder: str | Path,
    model_config,
    start: int = 0,
    end: int | None = None,
    *,
    outside_allowed: Collection[str] = (),
) -> AdapterSlice:
    """The factors of blocks [start, end) (end None: the model's last block + 1) of the LoRA adapter in `folder`,
    checked against `model_config` (the base model's transformers config).

    `outside_allowed`: saved names of tensors outside the blocks that the caller applies itself (the client's trained
    edge layers, sharding/lora_edges.py); any other tensor outside them is refused.

    Reads only these blocks' tensors from adapter_model.safetensors (a folder with only adapter_model.bin is read
    whole by peft's `load_peft_weights`, which unpickles with weights_only). Raises AdapterError,
    UnsupportedAdapterError (module docstring)."""
    end = model_config.num_hidden_layers if end is None else end
    if not 0 <= start < end <= model_config.num_hidden_layers:
        raise AdapterError(f"blocks {start}:{end} are outside the model's 0:{model_config.num_hidden_layers} range")
    path = Path(folder)
    config = read_adapter_config(path)
    targets = _targets(config, model_config, start, end)
    tensors = _read_block_tensors(path, start, end, outside_allowed=frozenset(outside_allowed))
    complete = {target for target, pair in tensors.items() if set(pair) == {"A", "B"}}
    if set(targets) != set(tensors) or complete != set(tensors):
        missing = sorted(set(targets) - complete)[:3]
        extra = sorted(set(tensors) - set(targets))[:3]
        raise AdapterError(
            f"{path}: weights and adapter_config.json disagree (targeted without weights: {missing}; weights of "
            f"modules the config does not target: {extra}); re-save the adapter with PeftModel.save_pretrained"
        )
    shapes = projection_shapes(model_config)
    factors = {}
    for target, (rank, alpha) in targets.items():
        lora_a, lora_b = tensors[target]["A"], tensors[target]["B"]
        in_features, out_features = shapes[target[1]]
        if tuple(lora_a.shape) != (rank, in_features) or tuple(lora_b.shape) != (out_features, rank):
            raise AdapterError(
                f"{path}: block {target[0]} {target[1]} has A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)}, but "
                f"this model with the config's rank {rank} needs A {(rank, in_features)} and B {(out_features, rank)}: "
                "an adapter of another model, or a config that does not match its weights"
            )
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank  # as peft's LoraLayer.update_layer
        factors[target] = LoraFactors(lora_a, lora_b, scale)
    return AdapterSlice(start, end, factors)


def projection_shapes(model_config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one block of a Llama, Mistral or Qwen2 model."""
    hidden, heads = model_config.hidden_size, model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    intermediate = model_config.intermediate_size
    return {
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.k_proj": (hidden, kv_heads * head_dim),
        "self_attn.v_proj": (hidden, kv_heads * head_dim),
        "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, intermediate),
        "mlp.up_proj": (hidden, intermediate),
        "mlp.down_proj": (intermediate, hidden),
    }


def check_fits_model(piece: AdapterSlice, model_config) -> None:
    """AdapterError unless every factor of `piece` fits its projection of this model (A (r, in), B (out, r)) and its
    blocks lie inside the model: what a node checks on a slice it did not read from its own folder (sent by a
    client, fetched from a peer) before any session runs it."""
    shapes = projection_shapes(model_config)
    if not 0 <= piece.start < piece.end <= model_config.num_hidden_layers:
        raise AdapterError(f"slice of blocks {piece.start}:{piece.end}, the model has {model_config.num_hidden_layers}")
    for (block, projection), factor in piece.factors.items():
        in_features, out_features = shapes[projection]
        if factor.lora_a.shape[1] != in_features or factor.lora_b.shape[0] != out_features:
            raise AdapterError(
                f"the adapter does not fit this model: block {block} {projection} is {in_features} -> "
                f"{out_features} features, its factors are A {tuple(factor.lora_a.shape)} and B "
                f"{tuple(factor.lora_b.shape)}"
            )


def _targets(config, model_config, start: int, end: int) -> dict[Target, tuple[int, int]]:
    """(rank, alpha) of each projection of blocks [start, end) the config targets, matched as peft matches them:
    the module's name in the causal LM ("model.layers.3.self_attn.q_proj") against target_modules, exclude_modules
    and layers_to_transform, then rank_pattern and alpha_pattern."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND, TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    from peft.utils.other import get_pattern_key

    matcher = config
    if config.target_modules is None or config.target_modules == INCLUDE_LINEAR_LAYERS_SHORTHAND:
        # what peft resolves when it wraps a model: the family's defaults, or every linear layer but the head
        if config.target_modules is None:
            names = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_config.model_type)
            if names is None:
                raise AdapterError(
                    f"the adapter names no target_modules and peft has no default for {model_config.model_type!r}"
                )
        else:
            names = [projection.rpartition(".")[2] for projection in PROJECTIONS]
        matcher = copy.copy(config)  # not dataclasses.replace: peft's __post_init__ would check it again
        matcher.target_modules = set(names)
    rank_pattern, alpha_pattern = config.rank_pattern or {}, config.alpha_pattern or {}
    targets = {}
    for block in range(start, end):
        for projection in PROJECTIONS:
            key = f"model.layers.{block}.{projection}"
            if not check_target_module_exists(matcher, key):
                continue
            rank = rank_pattern.get(get_pattern_key(rank_pattern.keys(), key), config.r)
            alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), key), config.lora_alpha)
            if not isinstance(rank, int) or rank <= 0:
                raise AdapterError(f"rank {rank!r} of {key} is not a positive integer")
            targets[(block, projection)] = (rank, alpha)
    return targets


def _read_block_tensors(
    path: Path, start: int, end: int, *, outside_allowed: frozenset[str]
) -> dict[Target, dict[str, torch.Tensor]]:
    """{(block, projection): {"A": tensor, "B": tensor}} of blocks [start, end), after checking every name in the
    file (any block): only LoRA A/B weights of the projections inside the blocks, and outside only if allowed."""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME, load_peft_weights

    weights_file = path / SAFETENSORS_WEIGHTS_NAME
    if weights_file.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(weights_file, framework="pt") as handle:
                names = list(handle.keys())
                chosen = _chosen_names(path, names, start, end, outside_allowed)
                read = {name: handle.get_tensor(name) for name in chosen}
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            raise AdapterError(f"{weights_file} cannot be read ({type(exc).__name__}: {exc})") from None
    elif (path / WEIGHTS_NAME).is_file():
        try:
            everything = load_peft_weights(str(path), device="cpu")
        except Exception as exc:  # a bad pickle or a refused object: torch raises several kinds
            raise AdapterError(f"{path / WEIGHTS_NAME} cannot be read ({type(exc).__name__}: {exc})") from None
        chosen = _chosen_names(path, list(everything), start, end, outside_allowed)
        read = {name: everything[name] for name in chosen}
    else:
        raise AdapterError(f"{path} has no {SAFETENSORS_WEIGHTS_NAME} (or {WEIGHTS_NAME})")
    tensors: dict[Target, dict[str, torch.Tensor]] = {}
    for name, (block, projection, which) in chosen.items():
        tensors.setdefault((block, projection), {})[which] = read[name].contiguous()
    return tensors


def _chosen_names(
    path: Path, names: list[str], start: int, end: int, outside_allowed: frozenset[str]
) -> dict[str, tuple[int, str, str]]:
    chosen, outside = {}, []
    for name in names:
        if not name.startswith(_PEFT_PREFIX):
            raise UnsupportedAdapterError(f"{path}: tensor {name!r} is not named as PEFT names a causal LM's adapter")
        inner = name[len(_PEFT_PREFIX) :]
        in_block = _BLOCK_KEY.fullmatch(inner)
        if in_block is None:
            if name not in outside_allowed:
                outside.append(inner)
            continue
        factor = _FACTOR_KEY.fullmatch(in_block.group(2))
        if factor is None:
            raise UnsupportedAdapterError(
                f"{path}: {inner} is inside block {in_block.group(1)} but is not a LoRA A or B weight of a q/k/v/o/"
                "gate/up/down projection (modules_to_save inside the blocks, DoRA magnitudes and LoRA biases are not "
                "served)"
            )
        block = int(in_block.group(1))
        if start <= block < end:
            chosen[name] = (block, factor.group(1), factor.group(2))
    whole_edges = {f"{module}.weight" for module in EDGE_MODULES.values()}
    if outside and set(outside) <= whole_edges:
        raise UnsupportedAdapterError(
            f"{path}: the adapter changes modules outside the transformer blocks ({', '.join(sorted(outside)[:4])}), "
            "which the client holds, not the nodes: a client serves such an adapter (its edge layers trained whole) "
            "by naming the folder as its model's adapter (generate --adapter DIR, from_pretrained(adapter=DIR))"
        )
    if outside:
        raise UnsupportedAdapterError(
            f"{path}: the adapter changes {', '.join(sorted(set(outside) - whole_edges)[:4])} outside the transformer "
            "blocks; nesa-node serves LoRA inside the blocks and, trained whole on the client, the embeddings, the "
            "final norm and the LM head (modules_to_save), nothing else"
        )
    return chosen


# ---- canonical form --------------------------------------------------------------------------------------------


def _check_factor(block: int, projection: str, factor: LoraFactors, start: int, end: int) -> None:
    where = f"block {block} {projection}"
    if not start <= block < end or projection not in PROJECTIONS:
        raise AdapterError(f"{where} is not a projection of blocks {start}:{end}")
    lora_a, lora_b = factor.lora_a, factor.lora_b
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] == 0 or lora_b.shape[1] != lora_a.shape[0]:
        raise AdapterError(f"{where}: A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} are not (r, in) and (out, r)")
    if lora_a.dtype not in _FLOAT_DTYPES or lora_b.dtype not in _FLOAT_DTYPES:
        raise AdapterError(f"{where}: factors in {lora_a.dtype}/{lora_b.dtype}; float32, bfloat16 or float16 expected")
    if not (torch.isfinite(lora_a).all() and torch.isfinite(lora_b).all()):
        raise AdapterError(f"{where}: factors hold NaN or Inf")
    if not isinstance(factor.scale, float) or not math.isfinite(factor.scale):
        raise AdapterError(f"{where}: scale {factor.scale!r} is not a finite float")


def _parse_slice(data: bytes) -> tuple[int, int, dict[Target, LoraFactors]]:
    """(start, end, factors) of canonical slice bytes; AdapterError for anything else."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        (header_length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_length])
        described = json.loads(header["__metadata__"][_METADATA_KEY])
        tensors = load(data)
        start, end, scales = described["start"], described["end"], described["scales"]
        if described["format"] != SLICE_FORMAT or type(start) is not int or type(end) is not int:
            raise ValueError(f"format {described['format']!r}, blocks {start!r}:{end!r}")
        by_target: dict[Target, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            matched = _SLICE_KEY.fullmatch(name)
            if matched is None:
                raise ValueError(f"unexpected tensor {name!r}")
            target = (int(matched.group(1)), matched.group(2))
            by_target.setdefault(target, {})[matched.group(3)] = tensor
        if set(scales) != {f"{block}.{projection}" for block, projection in by_target}:
            raise ValueError("scales do not name exactly the projections of the tensors")
        factors = {}
        for (block, projection), pair in by_target.items():
            scale = scales[f"{block}.{projection}"]
            factors[(block, projection)] = LoraFactors(pair["A"], pair["B"], scale)
    except (ValueError, KeyError, TypeError, RecursionError, struct.error, SafetensorError) as exc:
        raise AdapterError(f"bytes are not an adapter slice ({type(exc).__name__}: {exc})") from None
    return start, end, factors


__all__ = [
    "PROJECTIONS",
    "SLICE_FORMAT",
    "AdapterManifest",
    "AdapterSlice",
    "LoraFactors",
    "adapter_manifest",
    "adapters_for_rows",
    "check_fits_model",
    "check_slice",
    "disable_lora",
    "enable_lora",
    "load_adapter_slice",
    "merge_slices",
    "projection_shapes",
    "read_adapter_config",
    "slice_blobs",
    "slice_from_blocks",
]
