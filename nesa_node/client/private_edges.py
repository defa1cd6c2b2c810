"""Client-held edge blocks: the client runs blocks [0, a) and [L-b, L) itself, the swarm only the middle.

With `private_edges=(a, b)` (from_pretrained, the gateway's and `generate`'s --private-edges) the client keeps the
embeddings, the first `a` decoder blocks, the last `b`, the final norm and the LM head; routing and failover cover
blocks [a, L-b) only, so nodes never receive token ids or anything vocabulary-sized: the first node gets the hidden
states after block a, the last node sends those after block L-b. Seed 000's split (the client keeps the embedding and
k edge layers) and the Nesa paper's split learning (sec. 6.3.1) describe it. `noise_sigma` adds Gaussian noise to
what leaves the client (privacy/noise.py, eq. 25's tunable parameter).

What it hides is measured, not assumed: with open weights an adversary holding the public embedding and edge blocks
inverts what the first node receives (`nesa-node privacy-check`; the README's leakage table). Each edge block costs
the client its weights and compute; the KV caches of its own blocks live in the client's memory.

`EdgeSession` wraps an InferenceSession: each step runs the front blocks on the client (with their own caches), the
chain, then the back blocks. A step that fails in the chain rolls the front caches back, so the session's caches
stay in step with the nodes'.
"""

from __future__ import annotations

import torch

from nesa_node.client.session import InferenceSession
from nesa_node.errors import SessionStateError
from nesa_node.privacy.noise import add_boundary_noise, check_sigma
from nesa_node.sharding.blocks import BlockSpan, SpanSpec, load_block_span


def check_private_edges(edges, num_blocks: int) -> tuple[int, int]:
    """`edges` (a, b) as two ints; ValueError unless a, b >= 0 and a + b < num_blocks (the swarm serves at least one
    block: with every block on the client there is no swarm to use)."""
    try:
        front, back = (int(value) for value in edges)
    except (TypeError, ValueError):
        raise ValueError(f"private_edges must be two integers (a, b), got {edges!r}") from None
    if front < 0 or back < 0:
        raise ValueError(f"private_edges must be >= 0, got ({front}, {back})")
    if front + back >= num_blocks:
        raise ValueError(
            f"private_edges ({front}, {back}) leave no block of the model's {num_blocks} to the swarm "
            f"(a + b must be below {num_blocks})"
        )
    return front, back


class EdgeBlocks:
    """The decoder blocks a client runs itself: `front` = [0, a) and `back` = [L-b, L) (None when 0 blocks)."""

    def __init__(self, front: BlockSpan | None, back: BlockSpan | None, num_blocks: int, noise_sigma: float = 0.0):
        self.front = front
        self.back = back
        self.num_blocks = num_blocks
        self.noise_sigma = check_sigma(noise_sigma)
        self.generator = torch.Generator()
        self.generator.seed()  # noise the nodes cannot predict

    @classmethod
    def load(
        cls,
        model_path: str,
        edges: tuple[int, int],
        *,
        config,
        dtype: str = "float32",
        device: str = "cpu",
        noise_sigma: float = 0.0,
    ) -> EdgeBlocks:
        """Read the front and back blocks of `model_path` (ModelLoadError for a bad folder)."""
        num_blocks = config.num_hidden_layers
        front_count, back_count = check_private_edges(edges, num_blocks)
        front = back = None
        if front_count:
            front = load_block_span(model_path, SpanSpec(0, front_count, dtype, device), config=config)
        if back_count:
            spec = SpanSpec(num_blocks - back_count, num_blocks, dtype, device)
            back = load_block_span(model_path, spec, config=config)
        return cls(front, back, num_blocks, noise_sigma)

    @property
    def swarm_blocks(self) -> tuple[int, int]:
        """The blocks the swarm serves: [a, L-b)."""
        return (self.front.end if self.front else 0, self.back.start if self.back else self.num_blocks)

    @property
    def edges(self) -> tuple[int, int]:
        first, end = self.swarm_blocks
        return first, self.num_blocks - end

    def new_caches(self) -> tuple[object | None, object | None]:
        return (
            self.front.new_cache() if self.front else None,
            self.back.new_cache() if self.back else None,
        )

    def run_front(self, hidden: torch.Tensor, cache=None, position: int = 0) -> torch.Tensor:
        """What leaves the client: the front blocks over `hidden` (batch, seq, hidden), plus the boundary noise; on the
        CPU in `hidden`'s dtype."""
        with torch.inference_mode():
            if self.front is not None:
                hidden = self.front(hidden, cache, position).to("cpu", hidden.dtype)
            return add_boundary_noise(hidden, self.noise_sigma, self.generator)

    def run_back(self, hidden: torch.Tensor, cache=None, position: int = 0) -> torch.Tensor:
        """The back blocks over what the last node sent (batch, seq, hidden); on the CPU in `hidden`'s dtype."""
        if self.back is None:
            return hidden
        with torch.inference_mode():
            return self.back(hidden, cache, position).to("cpu", hidden.dtype)


class EdgeSession:
    """An InferenceSession whose steps pass through the client's edge blocks (see the module docstring). Other
    attributes are the inner session's (position, chain, timings, failovers, session_id, ...)."""

    def __init__(self, session: InferenceSession, blocks: EdgeBlocks):
        self.session = session
        self.blocks = blocks
        self.front_cache, self.back_cache = blocks.new_caches()
        if self.front_cache is not None:  # sliding-window layers keep what a refused step must be cropped back to
            for layer in self.front_cache.layers:
                if hasattr(layer, "activate_past_recording"):
                    layer.activate_past_recording()

    async def open(self) -> EdgeSession:
        await self.session.open()
        return self

    async def close(self) -> None:
        await self.session.close()

    async def __aenter__(self) -> EdgeSession:
        return await self.open()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def __getattr__(self, name: str):
        return getattr(self.session, name)

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last block's hidden states for the new tokens' embeddings `hidden` (batch, seq, hidden)."""
        position = self.session.position
        if hidden.dim() >= 2 and hidden.shape[1] == 0:
            raise SessionStateError("a step takes at least one token")
        if position + hidden.shape[1] > self.session.max_length:  # checked before the front caches grow
            raise SessionStateError(
                f"{position + hidden.shape[1]} tokens exceed the session's max_length {self.session.max_length}"
            )
        sent = self.blocks.run_front(hidden, self.front_cache, position)
        try:
            received = await self.session.step(sent)
        except BaseException:
            if self.front_cache is not None:  # the nodes did not take these tokens: neither do the front blocks
                self.front_cache.crop(position - self.front_cache.get_seq_length())  # a count to remove, negative
            raise
        if self.front_cache is not None:
            self.front_cache.crop(0)  # taken: sliding-window layers drop what has left their window
        return self.blocks.run_back(received, self.back_cache, position)


__all__ = ["EdgeBlocks", "EdgeSession", "check_private_edges"]
