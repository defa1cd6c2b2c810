"""Who may use a gateway: API keys for `/v1/*` (`nesa-node gateway --api-key-file FILE`), and where adapters may be
loaded from.

With keys, every `/v1/*` request needs `Authorization: Bearer KEY` (what OpenAI's clients send as their `api_key`);
a missing or wrong key is a 401 `invalid_api_key` in OpenAI's shape, answered before the request's body is read. The
file holds one key per line (blank lines and lines starting with `#` are skipped); keys are kept as sha256 digests
and compared in constant time. `/health`, `/metrics`, the dashboard (`/`) and `/api/swarm` stay open: they show what
the swarm's DHT shows anyone.

`POST /v1/adapters/load|unload` change what the gateway serves for every caller. With admin keys
(`--admin-key-file FILE`, the same format) they take one of those, from any address (403 `permission_error` for a
user's key; without a key, the 401 of any `/v1` request where there are API keys, else 403), checked before the body
is read, and an admin key also serves as an API key for the rest of `/v1`: users' keys then use the swarm but cannot
unload an adapter others use. Without admin keys, any API key manages adapters, and without keys
at all they are answered only for clients on this machine (a loopback address), whatever `--host` the gateway
listens on.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_KEY_CHARS = 512
MAX_KEYS = 1024
KEY_NEEDED = "a valid API key is needed: send `Authorization: Bearer KEY` (the client's api_key)"
ADMIN_KEY_NEEDED = "loading and unloading adapters takes one of the gateway's admin keys (`Authorization: Bearer KEY`)"

__all__ = ["ADMIN_KEY_NEEDED", "KEY_NEEDED", "ApiKeys", "is_loopback"]


class ApiKeys:
    """A gateway's API keys (see the module docstring)."""

    def __init__(self, keys: Iterable[str]):
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]
        if not self._digests:
            raise ValueError("no API key given")

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def from_file(cls, path: str | Path, *, option: str = "--api-key-file") -> ApiKeys:
        """The keys in file `path`. Raises ValueError, naming the file (as given to `option`), when it cannot be
        read, holds no key, more than MAX_KEYS, or a key with spaces or over MAX_KEY_CHARS characters. A file others
        may read is used, with a warning."""
        try:
            text = Path(path).read_text()
            mode = os.stat(path).st_mode
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{option} {path}: {getattr(exc, 'strerror', None) or exc}") from None
        keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise ValueError(f"{option} {path}: no key in it (one key per line)")
        if len(keys) > MAX_KEYS:
            raise ValueError(f"{option} {path}: {len(keys)} keys, at most {MAX_KEYS}")
        for number, key in enumerate(keys, 1):
            if len(key) > MAX_KEY_CHARS or any(char.isspace() for char in key):
                raise ValueError(f"{option} {path}: key {number} has spaces or is over {MAX_KEY_CHARS} chars")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("%s may be read by other users (mode %o): chmod 600 it", path, stat.S_IMODE(mode))
        return cls(keys)

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header's value names one of the keys (`Bearer KEY`)."""
        return self.identify(authorization) is not None

    def identify(self, authorization: str | None) -> str | None:
        """Which key an `Authorization` header's value names (`Bearer KEY`): "key:" and the start of its digest, the
        same for every request with that key and never the key itself; None for no key of this gateway's."""
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip() or len(key) > MAX_KEY_CHARS:
            return None
        digest = hashlib.sha256(key.strip().encode()).digest()
        matches = [hmac.compare_digest(digest, known) for known in self._digests]  # every key compared: no early out
        return f"key:{digest.hex()[:16]}" if any(matches) else None


def is_loopback(host: str | None) -> bool:
    """Whether an HTTP client's address is this machine's loopback (127.0.0.0/8, ::1, or ::ffff:127.x)."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback
