"""Weight commitments: a model's manifest of per-block weight hashes, and the span hash a node announces.

A block's digest is the sha256 of its tensors as stored in the model folder, in name order: for each tensor its name,
then its bytes (the stored dtype, C order). A span's source hash is the first 16 hex characters of
sha256("<digest of block start>:...:<digest of block end - 1>"), so whoever holds the manifest (the digests of every
block) computes the hash any span of an unchanged checkpoint must announce, without the weights.

A node announces its span's source hash (NodeInfo.source_hash) next to `weights_hash`, which for a quantized span
also covers the quantized weights (sharding/blocks.py). A client given the manifest (`from_pretrained(...,
weights_manifest=...)`, or a `weights-manifest.json` in its model folder) routes only to nodes whose source hash is
the manifest's for their span: a node that announces other weights, by mistake or on purpose, is left out. What this
cannot catch is a node that announces the right hash and serves other weights: announcements are claims, which
output checks and audits test.

The manifest file is JSON: {"format": "nesa-weights-manifest/1", "num_blocks": N, "blocks": ["<sha256 hex>", ...]}.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from nesa_node.errors import WeightsManifestError

FORMAT = "nesa-weights-manifest/1"
FILE_NAME = "weights-manifest.json"  # looked for in a client's model folder
MAX_MANIFEST_BYTES = 1 << 20  # 10,000 blocks of 64 hex characters fit many times
_DIGEST = re.compile(r"[0-9a-f]{64}")

__all__ = ["FILE_NAME", "FORMAT", "WeightsManifest", "block_digest", "span_hash"]


def block_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The sha256 (hex) of one block's tensors, (name, tensor) pairs as stored, taken in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda pair: pair[0]):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def span_hash(block_digests: Sequence[str]) -> str:
    """The source hash of a span whose blocks have `block_digests`, in block order (module docstring)."""
    return hashlib.sha256(":".join(block_digests).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class WeightsManifest:
    """The block digests of one model checkpoint."""

    blocks: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.blocks or not all(isinstance(b, str) and _DIGEST.fullmatch(b) for b in self.blocks):
            raise WeightsManifestError("a weights manifest lists one sha256 (64 lowercase hex characters) per block")

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def span_hash(self, start: int, end: int) -> str:
        """The source hash blocks [start, end) of this checkpoint announce. WeightsManifestError outside the model."""
        if not 0 <= start < end <= self.num_blocks:
            raise WeightsManifestError(f"blocks {start}:{end} are outside the manifest's 0:{self.num_blocks}")
        return span_hash(self.blocks[start:end])

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "num_blocks": self.num_blocks, "blocks": list(self.blocks)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> WeightsManifest:
        """The manifest `text` holds; WeightsManifestError for anything else."""
        try:
            document = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise WeightsManifestError(f"a weights manifest is JSON: {exc}") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise WeightsManifestError(f"not a weights manifest (format {FORMAT!r} expected)")
        blocks = document.get("blocks")
        if not isinstance(blocks, list) or document.get("num_blocks") != len(blocks):
            raise WeightsManifestError("a weights manifest's num_blocks must equal the length of its blocks list")
        return cls(tuple(blocks))

    @classmethod
    def read(cls, path: str | Path) -> WeightsManifest:
        """The manifest in file `path`; WeightsManifestError, naming the file, when it cannot be read or is not one."""
        try:
            with open(path, "rb") as handle:
                data = handle.read(MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise WeightsManifestError(f"weights manifest {path}: {exc.strerror or exc}") from None
        if len(data) > MAX_MANIFEST_BYTES:
            raise WeightsManifestError(f"weights manifest {path} is over {MAX_MANIFEST_BYTES} bytes")
        try:
            return cls.from_json(data.decode())
        except UnicodeDecodeError:
            raise WeightsManifestError(f"weights manifest {path} is not UTF-8 text") from None
        except WeightsManifestError as exc:
            raise WeightsManifestError(f"weights manifest {path}: {exc.message}") from None

    def write(self, path: str | Path) -> None:
        """Write the manifest to `path` (atomically: a reader never sees half a file)."""
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(self.to_json() + "\n")
        tmp.replace(target)
