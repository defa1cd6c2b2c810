"""KV cache sizing and the node's cache budget.

Eq. 4 of the Nesa paper sizes the cache per token as 2 * d_model * n_layers values. That ignores grouped-query
attention and the element size, so this module uses the corrected form

    bytes_per_token = 2 * head_dim * n_kv_heads * n_layers * bytes_per_element

and accounts every session in bytes: a session of `batch` rows reserves batch * tokens * bytes_per_token bytes for
the tokens it may hold, growing in chunks as it uses them (server/sessions.py) up to its `max_length`, so an idle
session holds little; a reservation that does not fit is refused.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from nesa_node.errors import CacheBudgetError

logger = logging.getLogger(__name__)


def kv_bytes_per_token(*, head_dim: int, n_kv_heads: int, n_layers: int, bytes_per_element: int) -> int:
    """Bytes of keys and values one token occupies across `n_layers` blocks (eq. 4, corrected for GQA)."""
    for name, value in (
        ("head_dim", head_dim),
        ("n_kv_heads", n_kv_heads),
        ("n_layers", n_layers),
        ("bytes_per_element", bytes_per_element),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return 2 * head_dim * n_kv_heads * n_layers * bytes_per_element


def kv_bytes_per_token_for(config, n_layers: int, bytes_per_element: int) -> int:
    """`kv_bytes_per_token` for a transformers config (Llama, Mistral, Qwen2 families)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return kv_bytes_per_token(
        head_dim=head_dim, n_kv_heads=n_kv_heads, n_layers=n_layers, bytes_per_element=bytes_per_element
    )


@dataclass
class CacheBudget:
    """Byte accounting of a node's KV cache: reservations are exact and always returned."""

    capacity_bytes: int  # total bytes the node gives to KV caches
    bytes_per_token: int  # for this node's span, batch 1

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0 or self.bytes_per_token <= 0:
            raise ValueError("capacity must be >= 0 and bytes_per_token > 0")
        self.used_bytes = 0

    @classmethod
    def for_tokens(cls, max_tokens: int, bytes_per_token: int) -> CacheBudget:
        return cls(capacity_bytes=max_tokens * bytes_per_token, bytes_per_token=bytes_per_token)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def tokens_left(self) -> int:
        """Tokens (batch 1) that still fit: the `cache_tokens_left` of the node's record."""
        return self.free_bytes // self.bytes_per_token

    def session_bytes(self, batch: int, max_length: int) -> int:
        return batch * max_length * self.bytes_per_token

    def reserve(self, batch: int, max_length: int) -> int:
        """Reserve the bytes of a session; raises CacheBudgetError when it does not fit. Returns the bytes."""
        if batch <= 0 or max_length <= 0:
            raise CacheBudgetError(f"batch ({batch}) and max_length ({max_length}) must be positive")
        need = self.session_bytes(batch, max_length)
        if need > self.free_bytes:
            raise CacheBudgetError(
                f"session needs {need} bytes of KV cache ({batch} x {max_length} tokens) but only "
                f"{self.free_bytes} bytes ({self.tokens_left} tokens) are free; use a shorter max_length "
                "or another node"
            )
        self.used_bytes += need
        return need

    def release(self, nbytes: int) -> None:
        if nbytes < 0 or nbytes > self.used_bytes:
            raise ValueError(f"cannot release {nbytes} bytes, {self.used_bytes} are reserved")
        self.used_bytes -= nbytes

    @contextlib.contextmanager
    def allocate(self, batch: int, max_length: int) -> Iterator[int]:
        """Hold a reservation for the life of the `with` block; freed on exit, errors included."""
        nbytes = self.reserve(batch, max_length)
        try:
            yield nbytes
        finally:
            self.release(nbytes)
