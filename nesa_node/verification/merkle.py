"""Merkle roots over a session's hop records, and inclusion proofs (pure: bytes in, bytes out).

    leaf hash      SHA-256(b"nesa-leaf\\x00" || leaf bytes)          (a record's canonical encoding, signature in)
    interior node  SHA-256(b"nesa-node\\x00" || left || right)
    tree root      pairs hashed level by level; an odd last node is promoted to the next level unchanged
    root           SHA-256(b"nesa-root\\x00" || u64 leaf count, big-endian || tree root)   (32 zero bytes: no leaf)

The domain prefixes keep a leaf from passing for an interior node and the other way round (second preimages).
Promoting the odd node, rather than pairing it with a copy of itself as Bitcoin does, means [a, b, c] and
[a, b, c, c] have different trees (CVE-2012-2459); the leaf count in the root separates trees of different sizes
even where their shapes could agree.

A proof of leaf i is the list of siblings from the leaf up, skipping the levels where i's node is promoted; the
verifier replays the same levels from (index, count), so a proof cannot be moved to another position or tree size.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

LEAF_DOMAIN = b"nesa-leaf\x00"
NODE_DOMAIN = b"nesa-node\x00"
ROOT_DOMAIN = b"nesa-root\x00"
_EMPTY_TREE = bytes(32)


def leaf_hash(leaf: bytes) -> bytes:
    """The 32-byte hash of one leaf's bytes."""
    return hashlib.sha256(LEAF_DOMAIN + leaf).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_DOMAIN + left + right).digest()


def _bind_count(count: int, tree_root: bytes) -> bytes:
    return hashlib.sha256(ROOT_DOMAIN + struct.pack(">Q", count) + tree_root).digest()


def root_of_hashes(hashes: Sequence[bytes]) -> bytes:
    """The root over leaf hashes (see the module docstring)."""
    level = list(hashes)
    if not level:
        return _bind_count(0, _EMPTY_TREE)
    while len(level) > 1:
        paired = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])  # promoted, not duplicated
        level = paired
    return _bind_count(len(hashes), level[0])


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """The root over leaves' bytes (each hashed with `leaf_hash`)."""
    return root_of_hashes([leaf_hash(leaf) for leaf in leaves])


@dataclass(frozen=True)
class InclusionProof:
    index: int  # the leaf's position, from 0
    count: int  # leaves in the tree
    siblings: tuple[bytes, ...]  # 32-byte hashes, leaf level first; none at levels where the node is promoted


def proof(leaves: Sequence[bytes], index: int) -> InclusionProof:
    """The proof that leaf `index` is in the tree of `leaves`; raises IndexError for an index outside it."""
    if not 0 <= index < len(leaves):
        raise IndexError(f"leaf {index} of a tree of {len(leaves)}")
    level = [leaf_hash(leaf) for leaf in leaves]
    siblings = []
    position = index
    while len(level) > 1:
        sibling = position ^ 1
        if sibling < len(level):
            siblings.append(level[sibling])
        paired = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level, position = paired, position // 2
    return InclusionProof(index=index, count=len(leaves), siblings=tuple(siblings))


def verify_proof(leaf: bytes, inclusion: InclusionProof, root: bytes) -> bool:
    """Whether `leaf` (its bytes) sits at `inclusion.index` of a tree of `inclusion.count` leaves with this root.
    False for any malformed proof (wrong number or length of siblings, index out of range)."""
    index, count = inclusion.index, inclusion.count
    if not 0 <= index < count or any(len(sibling) != 32 for sibling in inclusion.siblings):
        return False
    current = leaf_hash(leaf)
    position, width, used = index, count, 0
    while width > 1:
        sibling = position ^ 1
        if sibling < width:
            if used == len(inclusion.siblings):
                return False
            other = inclusion.siblings[used]
            used += 1
            current = node_hash(other, current) if position % 2 else node_hash(current, other)
        position, width = position // 2, (width + 1) // 2
    return used == len(inclusion.siblings) and _bind_count(count, current) == root
