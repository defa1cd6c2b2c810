"""A node's libp2p identity: one RSA key that fixes its peer id and signs its DHT records.

The key file is hivemind's format (a libp2p PrivateKey protobuf). It is created owner-only and reused, so a
node keeps its peer id across restarts; the same key signs the node's DHT records, which binds each record to
the peer that wrote it. Whoever reads the file can sign as the node: it is created with mode 0400 in one step (no
moment when others may read it), a symbolic link or a file of another user is refused, and a file others may read
is tightened to 0400 with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from multihash import coerce_code
from multihash import encode as multihash_encode

from nesa_node.errors import IdentityFileError

logger = logging.getLogger(__name__)


def ensure_identity(path: str | Path) -> Path:
    """Create an identity key at `path` (mode 0400, atomically) if there is none, else check the one there; returns
    the path. Raises IdentityFileError for a link, a file of another user or something that is not a file."""
    path = Path(path)
    if not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
        except FileExistsError:  # another process made it meanwhile: check that one below
            pass
        else:
            with os.fdopen(descriptor, "wb") as file:
                file.write(key.SerializeToString())
            return path
    _check_identity_file(path)
    return path


def _check_identity_file(path: Path) -> None:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise IdentityFileError(f"identity file {path} is a symbolic link: give the key file itself")
    if not stat.S_ISREG(info.st_mode):
        raise IdentityFileError(f"identity file {path} is not a regular file")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise IdentityFileError(f"identity file {path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o077:
        logger.warning(
            "identity file %s was readable by others (mode %o): tightened to 0400", path, info.st_mode & 0o777
        )
        os.chmod(path, 0o400)


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
