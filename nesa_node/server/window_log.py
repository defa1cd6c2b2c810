"""A node's signed hop records of one session (verification of untrusted nodes, nesa_node/verification).

When a client opens a session with `commit_hop` set, the node keeps, per window of WINDOW_TOKENS positions, the hash
of the hidden states it received for those positions (as decoded, what it computed on) and a commitment to its
outputs for them before the wire codec; when a window's last position is computed, or the client asks with `final`,
it signs a HopRecord of the window with its identity key. The client fetches the records (RecordsRequest) and may
re-execute sampled windows elsewhere to check them (client/audit.py).

A step may cross windows (a prefill of 50 tokens fills window 0 and starts window 1): it is split at the boundary.
A duplicate step (answered from record) adds nothing; a replay (the node replacing a failed one) records the windows
it recomputes, under its own key.
"""

from __future__ import annotations

import torch

from nesa_node.verification.commitment import WINDOW_TOKENS, InputHasher, WindowCommitter
from nesa_node.verification.receipts import HopRecord, RecordSigner

MAX_UNSENT_RECORDS = 1 << 14  # records a session keeps until the client fetches them (~600 bytes each)


class WindowLog:
    """The records of one session on this node (see the module docstring)."""

    def __init__(
        self,
        signer: RecordSigner,
        *,
        session_id: str,
        hop: int,
        blocks: tuple[int, int],
        hidden_size: int,
        weights_hash: str,
        adapter_hash: str,
        codec: str,
    ):
        self.signer = signer
        self.session_id = session_id
        self.hop = hop
        self.blocks = blocks
        self.hidden_size = hidden_size
        self.weights_hash = weights_hash
        self.adapter_hash = adapter_hash
        self.codec = codec
        self.unsent: list[HopRecord] = []
        self.dropped = 0  # records dropped because the client never fetched them
        self._window: int | None = None  # the window under way
        self._start = 0  # its first position
        self._end = 0  # one past the last position added to it
        self._hasher: InputHasher | None = None
        self._committer: WindowCommitter | None = None

    def add(self, position: int, received: torch.Tensor, output: torch.Tensor) -> None:
        """A computed step: `received` and `output` (batch, seq, hidden) for positions [position, position + seq)."""
        seq = received.shape[1]
        offset = 0
        while offset < seq:
            at = position + offset
            window = at // WINDOW_TOKENS
            if window != self._window or at != self._end:  # a new window, or a gap (positions replayed elsewhere)
                self._close()
                self._open(window, at)
            take = min(seq - offset, (window + 1) * WINDOW_TOKENS - at)
            self._hasher.update(received[:, offset : offset + take])
            self._committer.add(output[:, offset : offset + take])
            self._end = at + take
            offset += take
            if self._end == (window + 1) * WINDOW_TOKENS:
                self._close()

    def take(self, final: bool = False) -> list[HopRecord]:
        """The records not fetched yet (closing the window under way first when `final`)."""
        if final:
            self._close()
        records, self.unsent = self.unsent, []
        return records

    def _open(self, window: int, position: int) -> None:
        self._window, self._start, self._end = window, position, position
        self._hasher = InputHasher()
        self._committer = WindowCommitter(self.hidden_size)

    def _close(self) -> None:
        if self._window is None or self._end == self._start:
            self._window = None
            return
        record = HopRecord(
            session_id=self.session_id,
            hop=self.hop,
            span_start=self.blocks[0],
            span_end=self.blocks[1],
            window=self._window,
            token_start=self._start,
            token_end=self._end,
            input_hash=self._hasher.digest(),
            commitment=self._committer.finish().to_bytes(),
            weights_hash=self.weights_hash,
            adapter_hash=self.adapter_hash,
            codec=self.codec,
            peer_id=self.signer.peer_id,
        )
        self.unsent.append(self.signer.sign(record))
        if len(self.unsent) > MAX_UNSENT_RECORDS:
            self.unsent.pop(0)
            self.dropped += 1
        self._window = None


__all__ = ["MAX_UNSENT_RECORDS", "WindowLog"]
