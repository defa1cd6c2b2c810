"""LoRA adapter identity across nodes: the manifest of per-block hashes that names an adapter the same way everywhere.

Each node holds a different slice of an adapter (sharding/lora.py), so a slice's own sha256 cannot name the adapter:
nodes with blocks 0:4 and 4:8 hold different bytes. The manifest lists, for every block of the whole model (block 0
first), the sha256 of that block's own canonical slice (`AdapterSlice.block_hashes`; a block the adapter does not
target has the hash of its empty slice, which still names the block), and the adapter's rank. Its sha256 is the
adapter id: what a request names and a node announces. From the id alone a node can check any block it is given:

- `adapter_manifest(whole, num_blocks)` -> AdapterManifest of an adapter loaded over all blocks.
- `AdapterManifest.to_bytes()` / `AdapterManifest.from_bytes(data, expected_id)`: the manifest travels as compact
  sorted JSON; bytes whose sha256 is not the id asked for are refused (AdapterHashError), as is anything not in the
  canonical form or past the bounds (AdapterError: at most MAX_BLOCKS blocks, every hash 64 lowercase hex digits).
- `slice_blobs(piece)` -> one canonical blob per block (what a node sends a peer that fetches its slice);
  `slice_from_blocks(manifest, start, end, blobs)` -> the slice of [start, end) rebuilt from them, each blob checked
  against the manifest's hash of its block first: one changed byte and the fetch is refused (AdapterHashError).
- `check_slice(manifest, piece)`: AdapterHashError unless every block of `piece` is the manifest's.

sharding/lora.py re-exports these names. This module imports sharding/lora.py only inside functions: lora.py
imports this one at its top, so either may be imported first.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nesa_node.errors import AdapterError, AdapterHashError

if TYPE_CHECKING:
    from nesa_node.sharding.lora import AdapterSlice

MANIFEST_FORMAT = "nesa-lora-manifest/1"
MAX_BLOCKS = 4096  # far past any served model (Llama 3.1 405B has 126 blocks); bounds what a peer can make us parse
MAX_RANK = 1 << 16  # the bound NodeInfo's AdapterInfo puts on an announced rank (protocol/records.py)
# the canonical JSON of a manifest with MAX_BLOCKS hashes is 67 bytes per hash plus its keys; anything longer is
# refused before it is hashed or parsed
MAX_MANIFEST_BYTES = MAX_BLOCKS * 67 + 256
_HASH = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class AdapterManifest:
    """One sha256 (hex) per block of the whole model, block 0 first, and the adapter's largest rank.

    Checked at construction: 1 to MAX_BLOCKS hashes of 64 lowercase hex digits each, rank 1 to MAX_RANK (an adapter
    of rank 0 changes no block and has nothing for a node to serve). Raises AdapterError otherwise."""

    block_hashes: tuple[str, ...]
    rank: int

    def __post_init__(self) -> None:
        hashes = self.block_hashes
        if not isinstance(hashes, tuple) or not 1 <= len(hashes) <= MAX_BLOCKS:
            count = len(hashes) if isinstance(hashes, tuple | list) else type(hashes).__name__
            raise AdapterError(f"an adapter manifest lists 1 to {MAX_BLOCKS} block hashes in a tuple, not {count}")
        for block, value in enumerate(hashes):
            if not isinstance(value, str) or _HASH.fullmatch(value) is None:
                raise AdapterError(f"block {block}'s hash in an adapter manifest is not 64 lowercase hex digits")
        if type(self.rank) is not int or not 1 <= self.rank <= MAX_RANK:
            raise AdapterError(
                f"an adapter manifest's rank is {self.rank!r}, not an integer from 1 to {MAX_RANK}; an adapter that "
                "changes none of the model's blocks has nothing for a node to serve"
            )

    @property
    def num_blocks(self) -> int:
        """Blocks of the whole model the manifest covers."""
        return len(self.block_hashes)

    @functools.cached_property
    def adapter_id(self) -> str:
        """The sha256 (hex) of `to_bytes()`: the adapter's name on every node."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def to_bytes(self) -> bytes:
        """The canonical bytes: compact JSON with sorted keys, ASCII only."""
        body = {"format": MANIFEST_FORMAT, "block_hashes": list(self.block_hashes), "rank": self.rank}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes, expected_id: str) -> AdapterManifest:
        """The manifest `data` holds, once its sha256 equals `expected_id` (hex) and it is in canonical form.

        Raises AdapterHashError when the hash differs (corrupted or another adapter: fetch it elsewhere),
        AdapterError for data longer than MAX_MANIFEST_BYTES or matching bytes that are not a canonical manifest."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise AdapterError(f"an adapter manifest of {len(data)} bytes is longer than {MAX_MANIFEST_BYTES}; refused")
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_id.lower():
            raise AdapterHashError(
                f"adapter manifest bytes hash to {actual[:16]}…, not the adapter id {expected_id[:16]}… asked for: "
                "corrupted or another adapter, refused; fetch the manifest from another peer"
            )
        try:
            body = json.loads(data.decode("ascii"))
            if not isinstance(body, dict) or set(body) != {"format", "block_hashes", "rank"}:
                raise ValueError("not an object with exactly format, block_hashes and rank")
            if body["format"] != MANIFEST_FORMAT or not isinstance(body["block_hashes"], list):
                raise ValueError(f"format {body['format']!r}")
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; deep nesting
            raise AdapterError(f"bytes are not an adapter manifest ({type(exc).__name__}: {exc})") from None
        manifest = cls(tuple(body["block_hashes"]), body["rank"])
        if manifest.to_bytes() != data:
            raise AdapterError("adapter manifest bytes are not in canonical form (re-serialized they differ); refused")
        return manifest


def adapter_manifest(whole: AdapterSlice, num_blocks: int) -> AdapterManifest:
    """The manifest of an adapter loaded over all `num_blocks` blocks of its model (`load_adapter_slice(folder,
    config)` with end None). Raises AdapterError when `whole` covers another range or changes no block."""
    if (whole.start, whole.end) != (0, num_blocks):
        raise AdapterError(
            f"an adapter manifest needs the slice of all blocks 0:{num_blocks}, not {whole.start}:{whole.end}; load "
            "the adapter with start=0, end=None"
        )
    return AdapterManifest(whole.block_hashes(), whole.rank)


def check_slice(manifest: AdapterManifest, piece: AdapterSlice) -> None:
    """Raises AdapterHashError unless `piece` covers blocks inside the manifest and each block's hash is the
    manifest's (a slice of another adapter, or of other bytes), AdapterError when its rank is above the manifest's."""
    if piece.end > manifest.num_blocks:
        raise AdapterHashError(
            f"adapter slice of blocks {piece.start}:{piece.end} is not a part of adapter {manifest.adapter_id[:16]}…, "
            f"which has blocks 0:{manifest.num_blocks}: an adapter of another model, refused"
        )
    for block, actual in zip(range(piece.start, piece.end), piece.block_hashes(), strict=True):
        if actual != manifest.block_hashes[block]:
            raise AdapterHashError(
                f"block {block} of adapter slice {piece.sha256[:16]}… hashes to {actual[:16]}…, not the "
                f"{manifest.block_hashes[block][:16]}… adapter {manifest.adapter_id[:16]}… lists: another adapter or "
                "changed bytes, refused"
            )
    if piece.rank > manifest.rank:
        raise AdapterError(f"adapter slice of rank {piece.rank} is above its manifest's rank {manifest.rank}")


def slice_blobs(piece: AdapterSlice) -> list[bytes]:
    """The canonical bytes of each block's own slice, block `piece.start` first: what `slice_from_blocks` takes."""
    return [piece.narrow(block, block + 1).to_bytes() for block in range(piece.start, piece.end)]


def slice_from_blocks(manifest: AdapterManifest, start: int, end: int, blobs: Sequence[bytes]) -> AdapterSlice:
    """The slice of blocks [start, end) of the manifest's adapter, from one canonical blob per block (`slice_blobs`),
    each checked with `AdapterSlice.from_bytes(blob, manifest.block_hashes[block])` before anything is built.

    Raises AdapterHashError for a blob whose sha256 is not its block's (changed bytes, another adapter: fetch from
    another peer), AdapterError for a range outside the manifest, a count of blobs other than end - start, or a
    blob that is not the canonical slice of exactly its block."""
    # not at the top: lora.py imports this module (module docstring)
    from nesa_node.sharding.lora import AdapterSlice, merge_slices

    if not 0 <= start < end <= manifest.num_blocks:
        raise AdapterError(
            f"blocks {start}:{end} are outside adapter {manifest.adapter_id[:16]}…'s 0:{manifest.num_blocks}"
        )
    if len(blobs) != end - start:
        raise AdapterError(f"blocks {start}:{end} need {end - start} per-block adapter blobs, got {len(blobs)}")
    pieces = []
    for block, blob in zip(range(start, end), blobs, strict=True):
        piece = AdapterSlice.from_bytes(blob, manifest.block_hashes[block])
        if (piece.start, piece.end) != (block, block + 1):  # only a manifest built by hand could list such a hash
            raise AdapterError(f"the blob given for block {block} holds blocks {piece.start}:{piece.end}")
        pieces.append(piece)
    result = merge_slices(pieces)
    if result.rank > manifest.rank:
        raise AdapterError(f"adapter slice of rank {result.rank} is above its manifest's rank {manifest.rank}")
    return result


__all__ = [
    "MANIFEST_FORMAT",
    "MAX_BLOCKS",
    "MAX_MANIFEST_BYTES",
    "AdapterManifest",
    "adapter_manifest",
    "check_slice",
    "slice_blobs",
    "slice_from_blocks",
]
