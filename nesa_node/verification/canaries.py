"""Known-answer canaries: hidden states at every block boundary of a model, for checking any node on its own.

`build_canaries` runs a model folder's blocks, one block in memory at a time and in float32 on the CPU by default,
over `count` sequences of `tokens` token ids, starting from the model's token embeddings, and keeps every boundary:
states[k, b] is sequence k's input to block b (b = 0: the embeddings) and states[k, L] the output of the last block.
For any span [s, e) of any split of the model, states[k, s] is an input and states[k, e] its known answer, so a
client holding the file can check a node that no other node could audit (the only server of its span). The blocks
run through the code a node runs (sharding/blocks.py), so an honest node differs only by rounding.

The sequences start as a prompt does, with the tokens the folder's tokenizer puts before any text (BOS for Llama and
Mistral, nothing for Qwen2); the rest are windows of a text the builder gives (`texts`), else random ids of the
tokenizer's vocabulary. Random ids are the weaker choice: a node of the first blocks sees token identities and can
tell random text from prose.

Outputs are compared token by token (`comparable`): each token's hidden state is divided by the RMS of its known
answer, so the first token's very large activations (an attention sink in trained models, the same for every
sequence, which a node could cache) weigh as much as any other token's, not more.

Rounding is calibrated when the file is built: each block is also run in bfloat16 and in float16 on its float32
input rounded to that dtype, and the largest relative RMS error (token-normalized) over the canaries is kept per
block and dtype (`honest_error`). A client checking a node that computes (or is sent inputs) in one of those dtypes
bounds the node's honest error on a span by ERROR_MARGIN times the root sum of squares of its blocks' errors
(independent roundings add so), not less than the audits' calibration (`tolerance`); past MAX_BOUND a span's
rounding hides too much to tell a cheat by, and the node is not checked. Measured on the CPU that builds the file
(a GPU's kernels round otherwise), and on the tiny test models: calibrate on the real model before relying on it.

The file (safetensors) holds one float32 tensor "states" (count, blocks + 1, tokens, hidden) and metadata: the
format, the numbers of blocks and hidden size, and the honest errors. Token ids and seed are not kept. At 16
canaries of 32 tokens a model of 16 blocks of hidden 2048 takes 68 MiB. The client side (sending canaries,
comparing, blaming) is client/canaries.py.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from nesa_node.errors import CanaryFileError, ModelLoadError
from nesa_node.files import write_atomically
from nesa_node.verification.commitment import Tolerance, tolerance_for

logger = logging.getLogger(__name__)

FORMAT = "nesa-canaries/2"
FILE_NAME = "canaries.safetensors"  # the name a client looks for in its model folder
DEFAULT_COUNT = 16
DEFAULT_TOKENS = 32
MAX_COUNT = 4096
MAX_TOKENS = 8192
CALIBRATED = ("bfloat16", "float16")  # dtypes whose honest error per block a file holds
# the honest error bound of a span: this many times the root sum of squares of its blocks' measured errors (a GPU's
# kernels round otherwise than the CPU that built the file)
ERROR_MARGIN = 3.0
MAX_BOUND = 0.05  # a span whose bound would pass 5% relative error is not checked: its cheats hide in the rounding


@dataclass(frozen=True)
class CanarySet:
    """Hidden states at every block boundary of `count` sequences: `states` (count, blocks + 1, tokens, hidden);
    `honest_error[dtype][b]`: block b's largest relative RMS error when run in that dtype (module docstring)."""

    states: torch.Tensor
    honest_error: dict[str, tuple[float, ...]] = field(default_factory=dict)

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

    def tolerance(self, start: int, end: int, node_dtype: str, input_dtype: str) -> Tolerance | None:
        """How far (`comparable`) an honest node computing blocks [start, end) in `node_dtype` on inputs sent in
        `input_dtype` may be from the known answer: the audits' calibrated tolerance for those dtypes, widened to
        ERROR_MARGIN times the root sum of squares of the span's honest errors when the file measured a low-precision
        dtype of the two and that is larger; None when the widened bound passes MAX_BOUND (not a check worth making)."""
        base = tolerance_for(node_dtype, input_dtype)
        rounded = [dtype for dtype in CALIBRATED if dtype in (node_dtype, input_dtype)]
        errors = self.honest_error.get(rounded[0]) if rounded else None
        if not errors:
            return base
        bound = ERROR_MARGIN * math.sqrt(sum(error * error for error in errors[start:end]))
        if bound <= base.sketch:
            return base
        if bound > MAX_BOUND:
            return None
        factor = bound / base.sketch
        # top-k entries drift apart as the error grows: a quarter of them may leave the top for each doubling
        overlap = max(0.5, base.overlap - 0.25 * math.log2(factor))
        return replace(base, sketch=bound, scale=base.scale * factor, value=base.value * factor, overlap=overlap)

    def write(self, path: str | Path) -> Path:
        """Save in the canary file format (module docstring), readable by the owner alone from its first byte (a node
        holding the file would know every canary by its input); the file appears whole or not at all."""
        from safetensors.torch import save

        path = Path(path)
        metadata = {
            "format": FORMAT,
            "num_blocks": str(self.num_blocks),
            "hidden_size": str(self.hidden_size),
            "honest_error": json.dumps(self.honest_error),
        }
        return write_atomically(path, save({"states": self.states.contiguous()}, metadata=metadata))  # mode 0600

    @classmethod
    def read(cls, path: str | Path, *, num_blocks: int | None = None, hidden_size: int | None = None) -> CanarySet:
        """A canary file; CanaryFileError when it cannot be read, is not one, or does not fit a model of `num_blocks`
        blocks and `hidden_size` (when given). Shapes and dtype are checked before the states are read."""
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
                header = handle.get_slice("states")
                shape, dtype = tuple(header.get_shape()), header.get_dtype()
                if len(shape) != 4 or not (
                    0 < shape[0] <= MAX_COUNT and shape[1] >= 2 and 0 < shape[2] <= MAX_TOKENS and shape[3] > 0
                ):
                    raise CanaryFileError(
                        f"{path}: states of shape {shape}, not (count <= {MAX_COUNT}, blocks + 1, tokens <= "
                        f"{MAX_TOKENS}, hidden)"
                    )
                if dtype != "F32":
                    raise CanaryFileError(f"{path}: states in {dtype}, not float32 (F32)")
                declared = shape[1] - 1
                if metadata.get("num_blocks") != str(declared) or metadata.get("hidden_size") != str(shape[3]):
                    raise CanaryFileError(f"{path}: metadata {json.dumps(metadata)[:200]} disagrees with shape {shape}")
                if num_blocks is not None and declared != num_blocks:
                    raise CanaryFileError(f"{path} holds canaries of a model of {declared} blocks, not {num_blocks}")
                if hidden_size is not None and shape[3] != hidden_size:
                    raise CanaryFileError(f"{path} holds canaries of hidden size {shape[3]}, not {hidden_size}")
                honest_error = _honest_error(metadata.get("honest_error", "{}"), declared, path)
                states = handle.get_tensor("states")
        except (SafetensorError, OSError, ValueError) as error:
            raise CanaryFileError(f"{path} is not a readable canary file: {error}") from None
        if not bool(torch.isfinite(states).all()):
            raise CanaryFileError(f"{path}: states hold non-finite values")
        return cls(states, honest_error)


def _honest_error(text: str, blocks: int, path: Path) -> dict[str, tuple[float, ...]]:
    """The metadata's honest errors: for dtypes of CALIBRATED only, one finite error of 0 or more per block."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise CanaryFileError(f"{path}: honest_error is not a JSON object")
    errors = {}
    for dtype, per_block in value.items():
        if dtype not in CALIBRATED:
            raise CanaryFileError(f"{path}: honest_error of dtype {str(dtype)[:20]!r}, not one of {CALIBRATED}")
        if not (
            isinstance(per_block, list)
            and len(per_block) == blocks
            and all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                for x in per_block
            )
        ):
            raise CanaryFileError(f"{path}: honest_error[{dtype}] is not {blocks} finite errors of 0 or more")
        errors[dtype] = tuple(float(x) for x in per_block)
    return errors


def comparable(answer: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`answer` and `output` (batch, tokens, hidden) divided, token by token, by the RMS of the answer's token (module
    docstring), in float32: what canary comparisons and their calibration measure."""
    answer, output = answer.float(), output.float()
    scale = answer.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-30)
    return answer / scale, output / scale


def canary_token_ids(
    model_path: str | Path,
    config,
    count: int,
    tokens: int,
    generator: torch.Generator,
    texts: Sequence[str] | None = None,
) -> torch.Tensor:
    """(count, tokens) token ids: the tokens the folder's tokenizer puts before any text, then windows of `texts` at
    random offsets or random ids of the tokenizer's vocabulary (without a tokenizer: random ids of the model's, no
    prefix). ValueError when the texts are too short for one window or `tokens` leaves no room after the prefix."""
    prefix: list[int] = []
    vocabulary = config.vocab_size
    stream = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=False)
    except (OSError, ValueError, ImportError) as error:
        if texts is not None:
            raise ModelLoadError(f"no tokenizer in {model_path} to read the canary texts with: {error}") from None
        tokenizer = None
    if tokenizer is not None:
        vocabulary = min(vocabulary, len(tokenizer))  # ids past the tokenizer's are padding rows, never text
        marked, plain = tokenizer("a").input_ids, tokenizer("a", add_special_tokens=False).input_ids
        at = next((i for i in range(len(marked) - len(plain) + 1) if marked[i : i + len(plain)] == plain), 0)
        prefix = marked[:at]  # what the tokenizer adds in front (its BOS, when it adds one), not what it adds behind
        if any(not 0 <= token < config.vocab_size for token in prefix):
            raise ModelLoadError(
                f"{model_path}: the tokenizer starts prompts with {prefix}, outside the model's vocabulary"
            )
        if texts is not None:
            stream = [i for text in texts for i in tokenizer(text, add_special_tokens=False).input_ids]
    body = tokens - len(prefix)
    if body < 1:
        raise ValueError(f"canaries of {tokens} tokens leave none after the prompt's first {len(prefix)}")
    if stream is not None and len(stream) < body:
        raise ValueError(f"the texts give {len(stream)} tokens, fewer than the {body} of one canary")
    rows = []
    for _ in range(count):
        if stream is not None:
            start = int(torch.randint(0, len(stream) - body + 1, (1,), generator=generator))
            row = torch.tensor(stream[start : start + body], dtype=torch.long)
        else:
            row = torch.randint(0, vocabulary, (body,), generator=generator)
        rows.append(torch.cat([torch.tensor(prefix, dtype=torch.long), row]))
    return torch.stack(rows)


def build_canaries(
    model_path: str | Path,
    *,
    count: int = DEFAULT_COUNT,
    tokens: int = DEFAULT_TOKENS,
    seed: int | None = None,
    texts: Sequence[str] | None = None,
    device: str = "cpu",
    calibrate: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> CanarySet:
    """Run the blocks of the model folder `model_path` in float32 on `device` over `count` sequences of `tokens` ids
    (`canary_token_ids`, seeded by `seed`, random when None) and keep every block boundary; with `calibrate`, also
    each block's honest error in bfloat16 and float16 (module docstring). `progress(done, blocks)` after each block.
    Raises ModelLoadError for a bad folder, ValueError for counts out of range or texts too short."""
    from nesa_node.sharding.blocks import EMBED_WEIGHT, SafetensorsIndex, SpanSpec, load_block_span, load_config

    if not 0 < count <= MAX_COUNT:
        raise ValueError(f"canary count must be 1..{MAX_COUNT}, got {count}")
    if not 0 < tokens <= MAX_TOKENS:
        raise ValueError(f"canary tokens must be 1..{MAX_TOKENS}, got {tokens}")
    config = load_config(model_path)
    blocks = config.num_hidden_layers
    generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
    ids = canary_token_ids(model_path, config, count, tokens, generator, texts)
    states = torch.empty(count, blocks + 1, tokens, config.hidden_size, dtype=torch.float32)
    honest_error: dict[str, list[float]] = {dtype: [] for dtype in (CALIBRATED if calibrate else ())}
    with torch.inference_mode():
        embeddings = SafetensorsIndex(model_path).read([EMBED_WEIGHT])[EMBED_WEIGHT]  # only this of the client's part
        states[:, 0] = embeddings[ids].float()
        del embeddings
        for block in range(blocks):
            given = states[:, block].to(device)
            span = load_block_span(model_path, SpanSpec(block, block + 1, device=device), config=config)
            output = span(given)
            del span
            if not bool(torch.isfinite(output).all()):
                raise ModelLoadError(f"block {block} of {model_path} gives non-finite hidden states on its canaries")
            states[:, block + 1] = output.float().cpu()
            for dtype in honest_error:
                rounded = load_block_span(
                    model_path, SpanSpec(block, block + 1, dtype=dtype, device=device), config=config
                )
                answer, computed = comparable(output, rounded(given.to(rounded.dtype_)))
                honest_error[dtype].append(float((computed - answer).pow(2).mean(dim=(1, 2)).sqrt().max()))
                del rounded
            if progress is not None:
                progress(block + 1, blocks)
    calibrated = {}
    for dtype, errors in honest_error.items():
        if all(math.isfinite(error) for error in errors):
            calibrated[dtype] = tuple(errors)
        else:  # overflow in that dtype: its nodes are held to the audits' tolerance, as without calibration
            logger.warning("%s overflows in blocks of %s: its rounding is not calibrated", dtype, model_path)
    return CanarySet(states, calibrated)


__all__ = ["FILE_NAME", "FORMAT", "MAX_BOUND", "CanarySet", "build_canaries", "canary_token_ids", "comparable"]
