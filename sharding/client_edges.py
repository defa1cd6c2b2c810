"""What a client holds of the model: the token embeddings, the final norm and the LM head (the blocks run on the
nodes: blocks.py)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from nesa_node.sharding.blocks import (
    DTYPES,
    EMBED_WEIGHT,
    HEAD_WEIGHT,
    NORM_WEIGHT,
    SafetensorsIndex,
    check_device,
    family_class,
    load_config,
)

__all__ = ["ClientEdges", "load_client_edges", "reads_host_copy"]


class ClientEdges(nn.Module):
    """What a client holds locally: the token embeddings, the final norm and the LM head.

    `scores` runs the LM head. On the CPU in float32 a pass over two rows or more reads a transposed copy of the
    head's matrix, made at the first such pass and remade when the weight changes: MKL runs such products about 1.4x
    faster with that layout (32000 x 512 over 8 rows: 20.8 against 15.0 ms on one core), at the cost of one more head
    matrix of memory. One row keeps the head's own arithmetic (a lone session's scores are the single process's bit
    for bit), as do bfloat16 and float16 over several rows (3-5x slower transposed), hooked heads and weights made in
    inference mode. The head's product of one row runs on one core (a matrix-vector product: 6.2 ms for 32000 x 512 in
    float32, the largest part of a CPU client's time a token), so on a CPU with torch threads to spare a large head's
    rows are split into `SPLIT_PARTS` parts computed at once on threads of the client's own: each logit is the same dot
    product, over the same row of the head, as in the head's own call, and the first split product of a weight is
    checked against that call bit for bit (a library computing otherwise keeps the head's own call for that weight). Not
    under CPU autocast (a thread's own setting), nor while another thread's split product holds the threads (no call
    waits).

    `lookup` gives token embeddings on the CPU, for the wire. A table on another device (a CUDA client) is read
    through a host copy of it, made at the first lookup and remade when the weight changes: a lookup copies rows,
    the same values on any device, and the host copy spares every step a launch and a wait for the device (on a GPU
    the nodes share, a wait behind their work), for the table's size in host memory (131 MB for a 32000 x 2048
    bfloat16 table).
    """

    def __init__(self, embed: nn.Embedding, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.embed_tokens = embed
        self.norm = norm
        self.lm_head = lm_head
        self._head_t: tuple[torch.Tensor, tuple[int, int], torch.Tensor] | None = None  # (weight, key, weight.T)
        self._embed_host: tuple[torch.Tensor, tuple, torch.Tensor] | None = None  # (weight, key, copy)
        # (the head weight's key, whether split products of it are exact): see `_split_scores`
        self._split: tuple[tuple, bool] | None = None

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (..., hidden) of `input_ids`, on the CPU (the class docstring says how). A hooked
        module, a table with max_norm, a weight made in inference mode, or autograd on keep the module's own call."""
        module = self.embed_tokens
        weight = module.weight
        plain = (
            type(module) is nn.Embedding and module.max_norm is None and not module._forward_hooks
            and not module._forward_pre_hooks and not torch.is_grad_enabled() and not weight.is_inference()
        )  # fmt: skip
        if not plain or not reads_host_copy(weight):
            self._embed_host = None  # a table moved to the CPU, or hooked: no copy kept
            return module(input_ids.to(weight.device)).cpu()
        held = self._embed_host
        # as for the head's copy: this storage, this version (edits in place through `.data` are not seen: change
        # the table under torch.no_grad()), and this layout (a freed block may come back at the same address)
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape), weight.device)
        if held is None or held[0] is not weight or held[1] != key:
            with torch.inference_mode(False), torch.no_grad():
                held = self._embed_host = (weight, key, weight.detach().to("cpu", copy=True))
        return nn.functional.embedding(input_ids.cpu(), held[2])

    def scores(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of normed hidden states (..., hidden) -> (..., vocab)."""
        head = self.lm_head
        weight = head.weight
        rows = normed.numel() // max(normed.shape[-1], 1)
        plain = (
            type(head) is nn.Linear and head.bias is None and not head._forward_hooks and not head._forward_pre_hooks
            and not torch.is_grad_enabled() and not weight.is_inference()  # an inference tensor keeps no version
        )  # fmt: skip
        if rows == 1 and plain and weight.device.type == "cpu" and not torch.is_autocast_enabled("cpu"):
            if (parts := split_parts(weight)) > 1 and (scores := self._split_scores(normed, weight, parts)) is not None:
                return scores
        if rows < 2 or not plain or weight.device.type != "cpu" or weight.dtype != torch.float32:
            return head(normed)
        held = self._head_t
        # the copy is of this weight, its storage (`.data` may be replaced) and its version (changed in place)
        key = (weight.data_ptr(), weight._version)
        if held is None or held[0] is not weight or held[1] != key:
            with torch.inference_mode(False), torch.no_grad():  # usable inside and outside inference mode
                held = self._head_t = (weight, key, weight.detach().t().contiguous())
        return normed @ held[2]

    def _split_scores(self, normed: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor | None:
        """One row's logits, the head's rows in `parts` parts computed at once on the process's head threads (the
        class docstring); None where the head's own call is to run instead: a first check found the split product not
        bit for bit the same for this weight, or the threads are taken (another thread's split product: none waits)."""
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape), parts)
        held = self._split
        checked = held is not None and held[0] == key  # the verdict is the library's: any weight of this key shares it
        if checked and not held[1]:
            return None
        if not _SPLIT_LOCK.acquire(blocking=False):
            return None
        try:
            scores = _split_product(normed, weight.chunk(parts))  # views: whole rows of the head, in order
        finally:
            _SPLIT_LOCK.release()
        if scores is None:
            return None
        if not checked:
            exact = torch.equal(scores, self.lm_head(normed))
            self._split = (key, exact)
            if not exact:
                return None
        return scores


def _split_product(normed: torch.Tensor, chunks: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The logits of `normed` over each of `chunks` (rows of the head), the first on this thread and the others on
    the head threads at once, in the caller's grad mode (a thread's own setting), joined in order; None once the
    interpreter is shutting down."""
    global _SPLIT_POOL
    if _SPLIT_POOL is None:
        _SPLIT_POOL = ThreadPoolExecutor(SPLIT_PARTS - 1, thread_name_prefix="nesa-head")
    inference = torch.is_inference_mode_enabled()

    def part(chunk: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(inference), torch.no_grad():
            return head_part(normed, chunk)

    try:
        pending = [_SPLIT_POOL.submit(part, chunk) for chunk in chunks[1:]]
    except RuntimeError:  # the interpreter is shutting down: no new work for threads
        return None
    first = part(chunks[0])
    return torch.cat([first] + [future.result() for future in pending], dim=-1)


# the threads one row's split head product runs on, one product at a time in the process (`_split_scores`)
_SPLIT_POOL: ThreadPoolExecutor | None = None
_SPLIT_LOCK = threading.Lock()


def _forget_split_threads() -> None:
    """In a forked child: the parent's head threads do not exist there (work queued for them would never run)."""
    global _SPLIT_POOL, _SPLIT_LOCK
    _SPLIT_POOL, _SPLIT_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_split_threads)

SPLIT_PARTS = 4  # the most parts one row's head product is split into (threads: `split_parts`)
SPLIT_MIN_ELEMENTS = 1 << 22  # heads smaller than this (16 MB in float32) are not worth the threads' hand-offs


def head_part(normed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The logits of some rows of the head: the head's own product (nn.Linear's), over those rows."""
    return nn.functional.linear(normed, rows)


def split_parts(weight: torch.Tensor) -> int:
    """How many parts one row's product with a head `weight` on the CPU is split into: torch's threads, at most
    SPLIT_PARTS, none (1) for a small head."""
    if weight.numel() < SPLIT_MIN_ELEMENTS or weight.dim() != 2:
        return 1
    return max(1, min(SPLIT_PARTS, torch.get_num_threads(), weight.shape[0] // 1024))


def reads_host_copy(weight: torch.Tensor) -> bool:
    """Whether ClientEdges.lookup reads a host copy of this embedding table: one off the CPU."""
    return weight.device.type != "cpu"


def load_client_edges(
    model_path: str | Path, *, dtype: str = "float32", device: str = "cpu", config=None
) -> ClientEdges:
    """Read only the embeddings, final norm and LM head (tied to the embeddings when the model ties them), in
    `dtype` on `device` (DeviceUnavailableError when this machine has no such device)."""
    if dtype not in DTYPES:
        raise ValueError(f"client dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_device(device)
    config = config if config is not None else load_config(model_path)
    index = SafetensorsIndex(model_path)
    tied = getattr(config, "tie_word_embeddings", False) or HEAD_WEIGHT not in index.weight_map
    tensors = index.read([EMBED_WEIGHT, NORM_WEIGHT] + ([] if tied else [HEAD_WEIGHT]))
    torch_dtype = DTYPES[dtype]
    embed = nn.Embedding(config.vocab_size, config.hidden_size, device="meta")
    embed.weight = nn.Parameter(tensors[EMBED_WEIGHT].to(torch_dtype), requires_grad=False)
    norm = family_class(config, "RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
    norm.weight = nn.Parameter(tensors[NORM_WEIGHT].to(torch_dtype), requires_grad=False)
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
    lm_head.weight = embed.weight if tied else nn.Parameter(tensors[HEAD_WEIGHT].to(torch_dtype), requires_grad=False)
    return ClientEdges(embed, norm, lm_head).to(device).eval()
