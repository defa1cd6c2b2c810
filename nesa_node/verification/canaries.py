"""Known-answer canaries: hidden states at every block boundary of a model, for checking any node on its own.

`build_canaries` runs a model folder's blocks, one block in memory at a time and in float32 on the CPU by default,
over `count` sequences of random token ids (`tokens` each), starting from the model's token embeddings, and keeps
every boundary: states[k, b] is sequence k's input to block b (b = 0: the embeddings) and states[k, L] the output of
the last block. For any span [s, e) of any split of the model, states[k, s] is an input and states[k, e] its known
answer, so a client holding the file can check a node that no other node could audit (the only server of its
span). The blocks run through the same code a node runs (sharding/blocks.py), so an honest node differs only by
rounding: its dtype's and its batch shape's.

The file (safetensors) holds one float32 tensor "states" (count, blocks + 1, tokens, hidden) and metadata naming
the format and the numbers of blocks and hidden size. The token ids and their seed are not kept: a node that cannot
read the file cannot tell a canary's hidden states from a prompt's. At the defaults (8 canaries of 32 tokens) a
model of 16 blocks of hidden 2048 takes 34 MiB.

The client side (sending canaries, comparing, blaming) is client/canaries.py.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nesa_node.errors import CanaryFileError, ModelLoadError

logger = logging.getLogger(__name__)

FORMAT = "nesa-canaries/1"
FILE_NAME = "canaries.safetensors"  # the name a client looks for in its model folder
DEFAULT_COUNT = 8
DEFAULT_TOKENS = 32
MAX_COUNT = 4096
MAX_TOKENS = 8192


@dataclass(frozen=True)
class CanarySet:
    """Hidden states at every block boundary of `count` sequences: `states` (count, blocks + 1, tokens, hidden)."""

    states: torch.Tensor

    @property
    def count(self) -> int:
        return self.states.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.states.shape[1] - 1

    @property
    def tokens(self) -> int:
        return self.states.shape[2]

    @property
    def hidden_size(self) -> int:
        return self.states.shape[3]

    def case(self, index: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Canary `index` for blocks [start, end): its input and the known output, each (1, tokens, hidden)."""
        if not 0 <= start < end <= self.num_blocks:
            raise ValueError(f"blocks {start}:{end} are not a span of a model of {self.num_blocks} blocks")
        if not 0 <= index < self.count:
            raise ValueError(f"canary {index} of {self.count}")
        return self.states[index, start].unsqueeze(0), self.states[index, end].unsqueeze(0)

    def write(self, path: str | Path) -> Path:
        """Save as the canary file format (module docstring); readable by the owner alone: a node holding the file
        would know every canary by its input."""
        from safetensors.torch import save_file

        path = Path(path)
        metadata = {
            "format": FORMAT,
            "num_blocks": str(self.num_blocks),
            "hidden_size": str(self.hidden_size),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".partial")
        save_file({"states": self.states.contiguous()}, str(temporary), metadata=metadata)
        temporary.chmod(0o600)
        temporary.replace(path)
        return path

    @classmethod
    def read(cls, path: str | Path, *, num_blocks: int | None = None, hidden_size: int | None = None) -> CanarySet:
        """A canary file; CanaryFileError when it cannot be read, is not one, or does not fit a model of `num_blocks`
        blocks and `hidden_size` (when given)."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise CanaryFileError(f"no canary file at {path} (`nesa-node model canaries MODEL` writes one)")
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                names = list(handle.keys())
                if metadata.get("format") != FORMAT or names != ["states"]:
                    raise CanaryFileError(
                        f"{path} is not a canary file of format {FORMAT} (metadata {json.dumps(metadata)[:200]}, "
                        f"tensors {names[:8]})"
                    )
                shape = tuple(handle.get_slice("states").get_shape())
                declared = shape[1] - 1 if len(shape) == 4 else None
                if len(shape) != 4 or not (
                    0 < shape[0] <= MAX_COUNT and shape[1] >= 2 and 0 < shape[2] <= MAX_TOKENS and shape[3] > 0
                ):
                    raise CanaryFileError(
                        f"{path}: states of shape {shape}, not (count <= {MAX_COUNT}, blocks + 1, tokens <= "
                        f"{MAX_TOKENS}, hidden)"
                    )
                if metadata.get("num_blocks") != str(declared) or metadata.get("hidden_size") != str(shape[3]):
                    raise CanaryFileError(f"{path}: metadata {json.dumps(metadata)[:200]} disagrees with shape {shape}")
                if num_blocks is not None and declared != num_blocks:
                    raise CanaryFileError(f"{path} holds canaries of a model of {declared} blocks, not {num_blocks}")
                if hidden_size is not None and shape[3] != hidden_size:
                    raise CanaryFileError(f"{path} holds canaries of hidden size {shape[3]}, not {hidden_size}")
                states = handle.get_tensor("states")
        except (SafetensorError, OSError, ValueError) as error:
            raise CanaryFileError(f"{path} is not a readable canary file: {error}") from None
        if states.dtype != torch.float32:
            raise CanaryFileError(f"{path}: states in {states.dtype}, not float32")
        if not bool(torch.isfinite(states).all()):
            raise CanaryFileError(f"{path}: states hold non-finite values")
        return cls(states)


def build_canaries(
    model_path: str | Path,
    *,
    count: int = DEFAULT_COUNT,
    tokens: int = DEFAULT_TOKENS,
    seed: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> CanarySet:
    """Run the blocks of the model folder `model_path` over `count` random sequences of `tokens` token ids (seeded by
    `seed`, random when None) and keep every block boundary (module docstring). `dtype` and `device`: where the
    blocks run (the states are kept in float32); `progress(done, blocks)` after each block. Raises ModelLoadError
    for a bad folder, ValueError for counts out of range."""
    from nesa_node.sharding.blocks import SpanSpec, load_block_span, load_client_edges, load_config

    if not 0 < count <= MAX_COUNT:
        raise ValueError(f"canary count must be 1..{MAX_COUNT}, got {count}")
    if not 0 < tokens <= MAX_TOKENS:
        raise ValueError(f"canary tokens must be 1..{MAX_TOKENS}, got {tokens}")
    config = load_config(model_path)
    blocks = config.num_hidden_layers
    generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
    ids = torch.randint(0, config.vocab_size, (count, tokens), generator=generator)
    states = torch.empty(count, blocks + 1, tokens, config.hidden_size, dtype=torch.float32)
    with torch.inference_mode():
        edges = load_client_edges(model_path, dtype=dtype, device=device, config=config)
        hidden = edges.embed_tokens(ids.to(device))
        del edges
        states[:, 0] = hidden.float().cpu()
        for block in range(blocks):
            span = load_block_span(model_path, SpanSpec(block, block + 1, dtype=dtype, device=device), config=config)
            hidden = span(hidden)
            del span
            if not bool(torch.isfinite(hidden).all()):
                raise ModelLoadError(f"block {block} of {model_path} gives non-finite hidden states on random tokens")
            states[:, block + 1] = hidden.float().cpu()
            if progress is not None:
                progress(block + 1, blocks)
    return CanarySet(states)


__all__ = ["FILE_NAME", "FORMAT", "CanarySet", "build_canaries"]
