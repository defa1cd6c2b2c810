"""A contiguous span of transformer blocks loaded from a Hugging Face model folder.

Only the tensors of blocks [start, end) are read from the safetensors files, so a node never holds the whole
model. The blocks are transformers' own decoder layers (Llama, Mistral and Qwen2 families), run with
transformers' own masks and rotary embeddings, so a chain of spans computes what the full model computes.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from nesa_node.errors import DeviceUnavailableError, ModelLoadError, UnsupportedModelError
from nesa_node.sharding import batch_attention, batch_graph
from nesa_node.sharding.batch_attention import RowsCache, attend_prompts, attend_steps, layer_per_session
from nesa_node.sharding.decode_graph import FixedStep, NoMemory
from nesa_node.sharding.model_folder import check_span, config_file
from nesa_node.sharding.span_cache import SpanCache
from nesa_node.sharding.weights_manifest import WeightsManifest, block_digest, span_hash

if TYPE_CHECKING:
    from nesa_node.compression.weights import QuantizationReport

logger = logging.getLogger(__name__)

# model_type -> (modeling module, class name prefix); classes are <prefix>DecoderLayer, RotaryEmbedding, RMSNorm
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
}
EMBED_WEIGHT, NORM_WEIGHT, HEAD_WEIGHT = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
LAYER_PREFIX = "model.layers.{index}."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")  # rotary types (parts of names) that depend on length: no table
ROPE_TABLE_MIN = 256  # positions in the first rotary table (it doubles as sequences grow past it)


def load_config(model_path: str | Path):
    from transformers import AutoConfig

    path = Path(model_path)
    config_file(path)  # ModelLoadError when the folder has none
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)  # a model's own code never runs here
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise ModelLoadError(f"{path}: config.json cannot be read ({exc})") from None
        raise UnsupportedModelError(
            f"{path} needs custom code (auto_map in config.json), which nesa-node does not run; supported: "
            f"{', '.join(sorted(FAMILIES))}"
        ) from None
    if config.model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    return config


def family_class(config, suffix: str) -> type[nn.Module]:
    """The family's transformers class `<Prefix><suffix>`, e.g. LlamaDecoderLayer for suffix "DecoderLayer"."""
    module_name, prefix = FAMILIES[config.model_type]
    return getattr(importlib.import_module(module_name), prefix + suffix)


def layer_types(config) -> list[str]:
    """Attention type of every block of the model ("full_attention" or "sliding_attention")."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * config.num_hidden_layers


def span_config(config, start: int, end: int):
    """A copy of `config` that describes only blocks [start, end), numbered from 0."""
    sub = copy.deepcopy(config)
    types = layer_types(config)[start:end]
    sub.num_hidden_layers = end - start
    if getattr(config, "layer_types", None):
        sub.layer_types = types
    if getattr(sub, "_attn_implementation", None) in (None, "eager") and config._attn_implementation is None:
        sub._attn_implementation = "sdpa"  # what from_pretrained picks on this stack; keeps node == reference
    return sub


class SafetensorsIndex:
    """Maps tensor names to the safetensors file that holds them, and reads single tensors."""

    def __init__(self, model_path: str | Path):
        self.path = Path(model_path)
        index_file = self.path / "model.safetensors.index.json"
        single_file = self.path / "model.safetensors"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            self.weight_map = {name: self.path / file for name, file in weight_map.items()}
        elif single_file.is_file():
            from safetensors import safe_open

            with safe_open(single_file, framework="pt") as handle:
                self.weight_map = {name: single_file for name in handle.keys()}
        else:
            raise ModelLoadError(f"{self.path} has no model.safetensors or model.safetensors.index.json")

    def names_with_prefix(self, prefix: str) -> list[str]:
        return sorted(name for name in self.weight_map if name.startswith(prefix))

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self.weight_map:
                raise ModelLoadError(f"tensor {name} is missing from {self.path}")
            by_file.setdefault(self.weight_map[name], []).append(name)
        tensors = {}
        for file, file_names in by_file.items():
            with safe_open(file, framework="pt") as handle:
                for name in file_names:
                    tensors[name] = handle.get_tensor(name)
        return tensors


@dataclass(frozen=True)
class SpanSpec:
    start: int  # first block served, inclusive
    end: int  # last block served, exclusive
    dtype: str = "float32"
    device: str = "cpu"
    quant: str = "none"  # weights of the blocks' linear layers: none, int8 (LLM.int8) or nf4; see compression.weights
    # one-token steps of a session, and batched passes that repeat, run at fixed shapes (sharding/decode_graph.py,
    # batch_graph.py), captured as CUDA graphs on a CUDA device; spans they cannot serve (quantized, sliding-window or
    # length-dependent rotary) run as usual
    decode_graphs: bool = False


class BlockSpan(nn.Module):
    """Blocks [start, end) of a decoder-only model, with their rotary embedding.

    `forward(hidden, cache, position, blocks)` runs the blocks on `hidden` (batch, seq, hidden) whose first token sits
    at absolute `position`, updating `cache` (a SpanCache from `new_cache`, or any transformers cache sized for this span) when given. `blocks`
    (first, end) runs only that contiguous part of the span (a chain may use a node for part of its range); the
    cache layers of the other blocks stay empty.
    `quantization` is what quantizing the blocks' weights saved (None when spec.quant is "none"). The blocks' weights
    are frozen (requires_grad False); the grad mode is the caller's.
    """

    def __init__(
        self,
        config,
        spec: SpanSpec,
        layers: list[nn.Module],
        weights_hash: str,
        quantization: QuantizationReport | None = None,
        source_hash: str | None = None,
    ):
        super().__init__()
        self.config = config
        self.spec = spec
        self.start, self.end = spec.start, spec.end
        self.sub_config = span_config(config, spec.start, spec.end)
        self.types = layer_types(config)[spec.start : spec.end]
        self.layers = nn.ModuleList(layers)
        self.rotary = family_class(config, "RotaryEmbedding")(config=config).to(spec.device)
        self.weights_hash = weights_hash
        self.source_hash = source_hash if source_hash is not None else weights_hash  # the checkpoint's, unquantized
        self.quantization = quantization
        self.dtype_ = DTYPES[spec.dtype]
        self._hidden_size = config.hidden_size  # read every step (transformers' config reads are slow)
        # cos, sin of positions 0..n-1 (1, n, head_dim), on the device in the span's dtype: a step reads its rows
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        rope_type = getattr(self.rotary, "rope_type", None)
        self._rope_tabulated = isinstance(rope_type, str) and not any(k in rope_type for k in SEQUENCE_DEPENDENT_ROPE)
        attention = getattr(self.sub_config, "_attn_implementation", None) or "sdpa"
        graphable = spec.quant == "none" and self._rope_tabulated and self.batches_decode
        self.decode_graphs = spec.decode_graphs and graphable and attention in ("sdpa", "eager")
        self._graph_stream = None  # the stream the span's CUDA graph captures run on (sharding/decode_graph.py)
        self.batch_graphs, self._fixed_batch = self.decode_graphs, None  # batched passes too (batch_graph.py)
        # the family's rotary function where every layer is the family's own sdpa decoder layer (`layer_per_session`
        # runs those part by part for a batched pass); None where passes keep the layers' own forward
        self._rotate = _rotation_for_rows(config, self.layers, attention)
        self._decoder = family_class(config, "DecoderLayer")

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    def new_cache(self):
        """An empty KV cache for this span's blocks (keys and values written in place: sharding/span_cache.py)."""
        return SpanCache(self.sub_config)

    @property
    def batches_decode(self) -> bool:
        """Whether `decode_batch` can run this span: every layer attends over its whole cache (sliding-window layers
        would need a window mask per row) and each position's rotary embedding depends on that position alone (a
        `dynamic` or `longrope` rotary scales every position by the longest sequence of its call: one session's
        length would change its batch-mates' outputs and caches). Other spans step one session at a time."""
        return self._rope_tabulated and all(kind == "full_attention" for kind in self.types)

    def rope(self, hidden: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding (cos, sin), each (1, stop - start, head_dim), of positions start..stop-1, as
        `self.rotary` computes them (the same values: each position's row depends on that position alone)."""
        table = self._table(stop)
        if table is None:
            position_ids = torch.arange(start, stop, device=hidden.device).unsqueeze(0)
            return self._rotary_alone(hidden, position_ids)
        cos, sin = table
        return cos[:, start:stop], sin[:, start:stop]

    def rope_rows(self, hidden: torch.Tensor, position_ids: torch.Tensor, longest: int):
        """(cos, sin), each (rows, 1, head_dim), of one position per row (`position_ids` (rows, 1), all below
        `longest`). A rotary type that depends on the length (not tabulated) gets one call a row, each as that row's
        own step would make it, not one call scaled by the longest row."""
        table = self._table(longest)
        if table is None:
            rows = [self._rotary_alone(hidden[:1], row) for row in position_ids.split(1)]
            return torch.cat([cos for cos, _ in rows]), torch.cat([sin for _, sin in rows])
        cos, sin = table
        return cos[0, position_ids], sin[0, position_ids]

    def _rotary_alone(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`self.rotary` of `position_ids` as a call of a fresh module gives it. A `dynamic` rotary keeps the longest
        length it was called with and scales every later call by it while past the model's length: one session's
        call at 6000 would scale another's at 5000. Its frequencies are set back first, so each call is scaled by its
        own positions alone, as in a session's own run (whose positions only grow)."""
        rotary = self.rotary
        original_length = getattr(rotary, "original_max_seq_len", None)
        names = [*rotary._buffers, *vars(rotary)] if original_length else []  # (a buffer, or a plain attribute)
        for name in [name for name in names if name.endswith("original_inv_freq")]:
            prefix = name.removesuffix("original_inv_freq")
            if getattr(rotary, f"{prefix}max_seq_len_cached", original_length) != original_length:
                original = getattr(rotary, name)
                rotary.register_buffer(f"{prefix}inv_freq", original.to(hidden.device), persistent=False)
                setattr(rotary, f"{prefix}max_seq_len_cached", original_length)
        return rotary(hidden, position_ids=position_ids)

    def _table(self, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary table holding at least positions 0..stop-1 (grown by doubling), or None when not tabulated."""
        if not self._rope_tabulated:
            return None
        table = self._rope_table
        if table is None or table[0].shape[1] < stop:
            size = max(stop, ROPE_TABLE_MIN, 2 * table[0].shape[1] if table is not None else 0)
            longest = getattr(self.config, "max_position_embeddings", None)
            if longest:  # the model's length at most, unless asked for more: then it goes on doubling
                size = min(size, longest) if stop <= longest else max(size, 2 * longest)
            probe = torch.empty(0, device=self.rotary.inv_freq.device, dtype=self.dtype_)  # gives the dtype only
            position_ids = torch.arange(size, device=probe.device).unsqueeze(0)
            with torch.inference_mode(False), torch.no_grad():  # a table made in inference mode is usable anywhere
                table = self._rope_table = self.rotary(probe, position_ids=position_ids)
        return table

    def step(self, hidden: torch.Tensor, cache=None, position: int = 0, blocks: tuple[int, int] | None = None):
        """`forward` with the base weights, except that a one-token step of a SpanCache session, on a span loaded with
        `decode_graphs`, runs as that session's fixed-shape step: replayed as a CUDA graph on a CUDA device
        (sharding/decode_graph.py). The caller runs steps with LoRA rows through `forward` (a graph replays the base
        weights only). A failed capture turns the span's graphs off (logged), the step runs as usual; one out of
        device memory (twice: decode_graph.capture) only this session's, until its buffers grow. A failed replay
        raises and drops the session's fixed step."""
        fixed = self._fixed_step(hidden, cache, position, blocks) if self.decode_graphs else None
        if fixed is not None:
            try:
                fresh = fixed.graph is None
                output = fixed(hidden.to(self.spec.device, self.dtype_), position)
                if fresh and fixed.graph is not None:
                    batch_graph.counts(self)["step_built"] += 1
                return output
            except RuntimeError as exc:  # torch's capture errors; the cache's length has not moved
                cache.fixed_step = None
                if fixed.graph is not None:
                    raise  # a replay that failed: not a capture matter
                if isinstance(exc, torch.OutOfMemoryError):
                    logger.info(
                        "blocks %d:%d: no memory for a session's CUDA graph; it steps without", self.start, self.end
                    )
                    cache.fixed_step = NoMemory(fixed.stamps)  # steps as usual until its buffers grow
                else:
                    logger.warning(
                        "CUDA graph capture failed (%s): blocks %d:%d run without graphs", exc, self.start, self.end
                    )
                    self.decode_graphs = False
        return self(hidden, cache, position, blocks)

    def _fixed_step(self, hidden: torch.Tensor, cache, position: int, blocks: tuple[int, int] | None):
        """The session's fixed step for this call (made when the cache's buffers are new), or None where this call
        runs as a plain forward."""
        if hidden.shape[1] != 1 or torch.is_grad_enabled() or not isinstance(cache, SpanCache):
            return None
        first, end = (0, len(self.layers)) if blocks is None else (blocks[0] - self.start, blocks[1] - self.start)
        if not 0 <= first < end <= len(self.layers):
            return None  # forward raises the error
        layer = cache.layers[first]
        if position != layer.get_seq_length() or position >= getattr(layer, "capacity", 0):
            return None  # the buffers grow (or a first step fills them): a plain step, then a new fixed one
        rows = hidden.shape[0]
        held = cache.fixed_step
        if isinstance(held, NoMemory):
            if held.holds(cache.layers, first, end):
                return None  # this session's capture ran out of device memory on these buffers (see `step`)
        elif held is not None and held.fits(cache, first, end, rows):
            return held
        try:
            fixed = FixedStep(self, cache, first, end, rows, capture_stream=self._capture_stream())
        except ValueError:
            return None
        cache.fixed_step = fixed
        return fixed

    def _capture_stream(self):
        """The CUDA stream every capture of this span runs on (None off CUDA: fixed steps run eagerly)."""
        device = torch.device(self.spec.device)
        if device.type != "cuda":
            return None
        if self._graph_stream is None:
            self._graph_stream = torch.cuda.Stream(device)
        return self._graph_stream

    def decode_batch(self, steps: list[tuple[torch.Tensor, object, int]], blocks: tuple[int, int]) -> list:
        """One-token steps of several sessions through `blocks` in one pass: each (hidden (rows, 1, hidden), its
        cache, its position); returns each step's output, as its own `forward` would (same blocks, same cache
        update). Every projection and MLP runs once over all rows; attention reads each session's own cache: on a
        GPU in one call over the caches padded to the longest (a batch that repeats replayed as a CUDA graph:
        batch_graph.py), on the CPU one call a session (batch_attention.py)."""
        first, end = blocks[0] - self.start, blocks[1] - self.start
        if not 0 <= first < end <= len(self.layers):
            raise ValueError(f"blocks {blocks} are not a part of this span {self.start}:{self.end}")
        if self.decode_graphs and (fixed := batch_graph.run(self, steps, first, end)) is not None:
            return fixed  # a batch that repeats, replayed as a CUDA graph
        rows, inputs = [hidden.shape[0] for hidden, _, _ in steps], [step for step, _, _ in steps]
        one_kind = len({(step.device, step.dtype) for step in inputs}) == 1  # the usual case: one copy to the device
        hidden = torch.cat(inputs if one_kind else [step.to(self.spec.device, self.dtype_) for step in inputs])
        hidden = hidden.to(self.spec.device, self.dtype_)  # (all rows, 1, hidden)
        positions = [position for (step, _, position) in steps for _ in range(step.shape[0])]
        position_ids = torch.tensor(positions, device=hidden.device).unsqueeze(1)  # (all rows, 1)
        longest = max(positions) + 1
        position_embeddings = self.rope_rows(hidden, position_ids, longest)
        cache = RowsCache([step_cache for _, step_cache, _ in steps], rows)
        layers = self.layers[first:end]
        # a layer replaced since the span was loaded (a test's pass-through block) runs whole, on the padded path
        if self._rotate is not None and hidden.device.type == "cpu" and all(type(x) is self._decoder for x in layers):
            attend = attend_steps(cache)
            for layer in layers:
                hidden = layer_per_session(layer, hidden, position_embeddings, self._rotate, attend)
            return list(hidden.split(rows))
        # each row sees its own cache (position + 1 keys once this step is in); the rest of the padding is masked
        lengths = position_ids[:, 0] + 1
        keys = torch.arange(longest, device=hidden.device)  # from the host's figure: no wait on the device
        allowed = keys[None, :] < lengths[:, None]  # (all rows, longest)
        mask = torch.zeros(allowed.shape, dtype=self.dtype_, device=hidden.device)
        mask = mask.masked_fill(~allowed, torch.finfo(self.dtype_).min)[:, None, None, :]  # (rows, 1, 1, longest)
        for layer in self.layers[first:end]:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=position_embeddings,
            )
        return list(hidden.split(rows))

    @property
    def batches_prompts(self) -> bool:
        """Whether `run_batch` takes steps of several tokens (prompts) too: attention a session at a time runs the
        family's layers part by part (`layer_per_session`), the span's own layers (none replaced since loading)."""
        return self.batches_decode and self._rotate is not None and all(type(x) is self._decoder for x in self.layers)

    def run_batch(self, steps: list[tuple[torch.Tensor, object, int]], blocks: tuple[int, int]) -> list:
        """Steps of several sessions through `blocks` in one pass, each (hidden (rows, seq, hidden), its cache, its
        position), of any length: prompts with one-token steps. Returns each step's output as its own `forward`
        would (same blocks, same cache update), up to rounding. Every projection and MLP runs once over all the
        steps' tokens; attention runs a session at a time over its own cache, causal among its new tokens. Passes
        of one-token steps only are `decode_batch`'s; others need `batches_prompts` (ValueError otherwise)."""
        if all(hidden.shape[1] == 1 for hidden, _, _ in steps):
            return self.decode_batch(steps, blocks)
        if not self.batches_prompts:
            raise ValueError(f"blocks {self.start}:{self.end} run prompts one at a time (no per-session attention)")
        first, end = blocks[0] - self.start, blocks[1] - self.start
        if not 0 <= first < end <= len(self.layers):
            raise ValueError(f"blocks {blocks} are not a part of this span {self.start}:{self.end}")
        shapes = [(hidden.shape[0], hidden.shape[1], position) for hidden, _, position in steps]
        width = steps[0][0].shape[-1]
        hidden = torch.cat([step.reshape(-1, 1, width).to(self.spec.device, self.dtype_) for step, _, _ in steps])
        positions = [position + token for rows, seq, position in shapes for _ in range(rows) for token in range(seq)]
        position_ids = torch.tensor(positions, device=hidden.device).unsqueeze(1)  # (tokens, 1)
        position_embeddings = self.rope_rows(hidden, position_ids, max(positions) + 1)
        attend = attend_prompts([cache for _, cache, _ in steps], shapes)
        for layer in self.layers[first:end]:
            hidden = layer_per_session(layer, hidden, position_embeddings, self._rotate, attend)
        parts = hidden.split([rows * seq for rows, seq, _ in shapes])
        return [part.reshape(rows, seq, -1) for part, (rows, seq, _) in zip(parts, shapes, strict=True)]

    def forward(
        self, hidden: torch.Tensor, cache=None, position: int = 0, blocks: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Run the blocks under the caller's grad mode: the node's inference runs them in `torch.inference_mode`, a
        training pass with autograd on (gradients reach `hidden` and any trainable weights)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        hidden = hidden.to(self.spec.device, self.dtype_)  # (batch, seq, hidden)
        seq = hidden.shape[1]
        position_ids = torch.arange(position, position + seq, device=hidden.device).unsqueeze(0)  # (1, seq)
        position_embeddings = self.rope(hidden, position, position + seq)
        mask_kwargs = dict(
            config=self.sub_config,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=cache,
            position_ids=position_ids,
        )
        first, end = (0, len(self.layers)) if blocks is None else (blocks[0] - self.start, blocks[1] - self.start)
        if not 0 <= first < end <= len(self.layers):
            raise ValueError(f"blocks {blocks} are not a part of this span {self.start}:{self.end}")
        types = self.types[first:end]
        masks = {}
        # each mask reads the cached length of the first run layer of its kind (the span's other layers may be empty)
        cached = 0 if cache is None else cache.get_seq_length(first)
        if seq == 1 and position == cached and "sliding_attention" not in types:
            masks["full_attention"] = None  # one new token after the cached ones sees every key: nothing to mask
        elif "full_attention" in types:
            layer_idx = first + types.index("full_attention")
            masks["full_attention"] = create_causal_mask(**mask_kwargs, layer_idx=layer_idx)
        if "sliding_attention" in types:
            layer_idx = first + types.index("sliding_attention")
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs, layer_idx=layer_idx)
        for layer, kind in zip(self.layers[first:end], types, strict=True):
            hidden = layer(
                hidden,
                attention_mask=masks[kind],
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=cache is not None,
                position_embeddings=position_embeddings,
            )
        return hidden


def _rotation_for_rows(config, layers, attention: str):
    """The family's `apply_rotary_pos_emb` where `layer_per_session` can run every one of `layers` (each the
    family's decoder layer with transformers' sdpa attention and no extra normalization inside it), else None."""
    if attention != "sdpa" or not layers:
        return None
    module = importlib.import_module(FAMILIES[config.model_type][0])
    rotate = getattr(module, "apply_rotary_pos_emb", None)
    decoder = family_class(config, "DecoderLayer")
    parts = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if type(layer) is not decoder or attn is None or not all(hasattr(attn, part) for part in parts):
            return None
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm") or getattr(attn, "sliding_window", None):
            return None
    return rotate


def check_device(device: str) -> None:
    """Raise DeviceUnavailableError unless torch can place tensors on `device` ("cpu", "cuda", "cuda:1")."""
    try:
        kind = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise DeviceUnavailableError(f"{device!r} is not a device name torch knows ({exc})") from None
    if kind.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceUnavailableError(
            f"--device {device}: torch {torch.__version__} ({build}) sees no CUDA device here; use --device cpu"
        )
    if kind.index is not None and kind.index >= torch.cuda.device_count():
        raise DeviceUnavailableError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"
        )


def weights_manifest_of(model_path: str | Path, *, config=None) -> WeightsManifest:
    """The weights manifest of a model folder: each block's digest of its tensors as stored (one block read at a time).
    Raises ModelLoadError for a bad folder or a block without weights."""
    config = config if config is not None else load_config(model_path)
    index = SafetensorsIndex(model_path)
    digests = []
    for block in range(config.num_hidden_layers):
        names = index.names_with_prefix(LAYER_PREFIX.format(index=block))
        if not names:
            raise ModelLoadError(f"no weights for block {block} in {model_path}")
        digests.append(block_digest(index.read(names).items()))
    return WeightsManifest(tuple(digests))


def load_block_span(model_path: str | Path, spec: SpanSpec, *, config=None) -> BlockSpan:
    """Read only the weights of blocks [spec.start, spec.end) and build them on `spec.device` in `spec.dtype`.

    With spec.quant "int8" or "nf4" each block's linear layers are quantized with bitsandbytes as the block is read,
    so the full-precision span is never held whole. `source_hash` (16 hex characters) is the span hash of the blocks'
    digests as stored in the folder (sharding/weights_manifest.py: what a model's manifest predicts for the span);
    `weights_hash` is the same without quantization, and with it sha256("<source hash>:<mode>:<served digest>"),
    where the served digest (`quantized_state_digest`) covers the quantized weights, their scales and settings: two
    nodes announce the same weights hash only when they serve the same checkpoint quantized the same way.
    Raises ModelLoadError for a bad folder or range, DeviceUnavailableError for a device torch cannot use here, UnsupportedModelError for another model family,
    QuantizationUnsupportedError for a quantization mode this device or bitsandbytes cannot run."""
    config = config if config is not None else load_config(model_path)
    check_span(spec.start, spec.end, config.num_hidden_layers)
    if spec.dtype not in DTYPES:
        raise ModelLoadError(f"dtype {spec.dtype!r} is not one of {', '.join(DTYPES)}")
    check_device(spec.device)
    if torch.device(spec.device).type == "cuda":
        batch_attention.without_cudnn_attention()  # attention lengths change every step: no per-shape cuDNN plans
    quantizer = None
    if spec.quant != "none":
        from nesa_node.compression import weights as quantizer  # bitsandbytes is loaded for quantized spans only

        quantizer.check_quantization_supported(spec.quant, spec.device, DTYPES[spec.dtype])
    report = None
    layer_cls = family_class(config, "DecoderLayer")
    sub_config = span_config(config, spec.start, spec.end)
    index = SafetensorsIndex(model_path)
    digests = []
    layers = []
    for local, block in enumerate(range(spec.start, spec.end)):
        prefix = LAYER_PREFIX.format(index=block)
        names = index.names_with_prefix(prefix)
        if not names:
            raise ModelLoadError(f"no weights for block {block} (prefix {prefix!r}) in {model_path}")
        tensors = index.read(names)
        digests.append(block_digest(tensors.items()))
        state = {name[len(prefix) :]: tensor.to(DTYPES[spec.dtype]) for name, tensor in tensors.items()}
        with torch.device("meta"):
            layer = layer_cls(sub_config, local)
        missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ModelLoadError(f"block {block}: missing weights {missing}, unexpected weights {unexpected}")
        if quantizer is None:
            layers.append(layer.to(spec.device).eval().requires_grad_(False))
            continue
        layer_report = quantizer.quantize_linear_layers(
            layer.eval(), spec.quant, device=spec.device, dtype=DTYPES[spec.dtype]
        )
        report = layer_report if report is None else report + layer_report
        layers.append(layer.requires_grad_(False))
    source_hash = weights_hash = span_hash(digests)
    if quantizer is not None:
        served = quantizer.quantized_state_digest(nn.ModuleList(layers))
        weights_hash = hashlib.sha256(f"{source_hash}:{spec.quant}:{served}".encode()).hexdigest()[:16]
    span = BlockSpan(config, spec, layers, weights_hash=weights_hash, quantization=report, source_hash=source_hash)
    logger.info("loaded blocks %d:%d of %s (%s, %s)", spec.start, spec.end, model_path, spec.dtype, spec.device)
    if report is not None:
        logger.info(
            "quantized %d linear layers to %s: %d -> %d bytes (%.2fx)",
            report.layers,
            report.mode,
            report.bytes_before,
            report.bytes_after,
            report.ratio,
        )
    return span
