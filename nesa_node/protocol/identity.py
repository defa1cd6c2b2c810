"""A node's libp2p identity: one RSA key that fixes its peer id and signs its DHT records.

The key file is hivemind's format (a libp2p PrivateKey protobuf). It is created owner-only and reused, so a
node keeps its peer id across restarts; the same key signs the node's DHT records, which binds each record to
the peer that wrote it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from multihash import coerce_code
from multihash import encode as multihash_encode


def ensure_identity(path: str | Path) -> Path:
    """Create an identity key at `path` (mode 0400) if there is none; returns the path."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
        os.chmod(path, 0o400)
    return path


def load_private_key(path: str | Path) -> RSAPrivateKey:
    data = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
    if data.key_type != crypto_pb2.KeyType.RSA:
        raise ValueError(f"{path} holds a {data.key_type} key; nesa-node identities are RSA")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": data.data})
    return key


def peer_id_of_identity(path: str | Path) -> PeerID:
    return PeerID.from_identity(Path(path).read_bytes())


def peer_id_of_public_key(public_key: RSAPublicKey) -> PeerID:
    """The libp2p peer id of an RSA public key (sha2-256 multihash of its PublicKey protobuf)."""
    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash_encode(hashlib.sha256(encoded).digest(), coerce_code("sha2-256")))
