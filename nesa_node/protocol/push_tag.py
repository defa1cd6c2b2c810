"""Tags on pushed steps: evidence of what a node of a direct chain handed its next node.

In a direct chain node i pushes its output straight to node i+1, and the client sees neither. When node i+1 refuses
that input (NaN, another shape), the client would have only i+1's word against i's. So at open the client gives each
node a key of its own (OpenSession.push_key; no other node learns it), the node tags each step it pushes with
HMAC-SHA256 over the step and its tensor under that key (Step.tag), and a node refusing a tagged push returns it with
its refusal (ErrorReply.evidence and the frame's tensor). The client checks the tag with the key it gave the pusher:
a valid tag proves the pusher sent exactly that, so the client can look at the input itself and tell which of the
two is at fault (client/failover.py). Nobody but the pusher and the client can make a valid tag, so a refusing node
cannot forge evidence, nor a pusher deny it.

The tag covers the step id, position and codec, the tensor's dtype, shape, compression and bytes, and the step's
seals (below) when it has any, each length-prefixed, so no two different pushes share the bytes under the MAC.

Seals tell each pushed-to node what the client sent: its step's position and tokens a row. A node cannot otherwise
know how many tokens a step holds, so a pusher adding or dropping tokens would have the honest node after it compute
them, and the client would blame that node for its answer's shape. The client gives the first node, with its step,
one seal for each later node (Step.seals), an HMAC under that node's key over the step id, position and tokens and
every seal after it (`seal_chain`). Each node checks the first seal against its key and the input it was pushed
(`seal_matches`), refuses a mismatch as its input's fault, and pushes the rest on. No node can forge a seal of
another's, and one altering the seals after its own is refused by the next node, its own tag on what it pushed.
A step sent again after a failover (same id) is sealed anew; the client keeps every attempt's seals, and a refused
push carrying an earlier attempt's is stale, not proof (client/session.py `_raise_step_error`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os

from hivemind.proto import runtime_pb2

CONTEXT = b"nesa-node push tag v1"
SEAL_CONTEXT = b"nesa-node step seal v1"
KEY_BYTES = 32


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


@functools.lru_cache(maxsize=64)
def _codec_bytes(codec) -> bytes:
    """A codec (a WireCodec: frozen, hashable) as the tag covers it; the few a node sends are worked out once."""
    return json.dumps(codec.to_metadata(), sort_keys=True).encode()


def push_tag(key: bytes, step, tensor: runtime_pb2.Tensor) -> str:
    """HMAC-SHA256 (hex) under `key` of a pushed step (messages.Step: its id, position, codec and seals) and its one
    tensor."""
    return tag_of(key, step.step_id, step.position, step.codec, tensor, step.seals)


def tag_of(
    key: bytes, step_id: str, position: int, codec, tensor: runtime_pb2.Tensor, seals: tuple[str, ...] = ()
) -> str:
    """`push_tag` of a step with these fields, before the step is made (the node makes its pushed step once, tag
    included)."""
    mac = hmac.new(key, CONTEXT, hashlib.sha256)
    for part in (
        step_id.encode(),
        int(position).to_bytes(8, "big"),
        _codec_bytes(codec),
        tensor.dtype.encode(),
        b"".join(int(size).to_bytes(8, "big", signed=True) for size in tensor.size),
        int(tensor.compression).to_bytes(4, "big", signed=True),
        tensor.buffer,
        # then the seals, when there are any: an unsealed step's tag is as it always was
        *((" ".join(seals).encode(),) if seals else ()),  # seals are hex: no space inside one
    ):
        mac.update(len(part).to_bytes(8, "big"))  # each part length-prefixed (no copy of the tensor's bytes)
        mac.update(part)
    return mac.hexdigest()


def tag_matches(key: bytes, step, tensor: runtime_pb2.Tensor) -> bool:
    """Whether `step.tag` is the push tag of `step` and `tensor` under `key` (constant time)."""
    return step.tag is not None and hmac.compare_digest(push_tag(key, step, tensor), step.tag)


def seal_of(key: bytes, step_id: str, position: int, tokens: int, rest: tuple[str, ...]) -> str:
    """The seal (HMAC-SHA256, hex) under a node's `key` of a step of `tokens` tokens a row at `position`, with the
    seals `rest` of the nodes after it."""
    mac = hmac.new(key, SEAL_CONTEXT, hashlib.sha256)
    for part in (step_id.encode(), int(position).to_bytes(8, "big"), int(tokens).to_bytes(8, "big"), *rest):
        part = part.encode() if isinstance(part, str) else part
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.hexdigest()


def seal_chain(keys: list[bytes], step_id: str, position: int, tokens: int) -> tuple[str, ...]:
    """The seals of a step for the nodes holding `keys`, in chain order (the nodes after the first)."""
    seals: tuple[str, ...] = ()
    for key in reversed(keys):
        seals = (seal_of(key, step_id, position, tokens, seals), *seals)
    return seals


def seal_matches(key: bytes, step, tokens: int) -> bool:
    """Whether `step.seals` starts with this node's seal (under `key`) of `step` holding `tokens` tokens a row and
    the seals after it (constant time)."""
    if not step.seals:
        return False
    own = seal_of(key, step.step_id, step.position, tokens, step.seals[1:])
    return hmac.compare_digest(own, step.seals[0])


__all__ = ["KEY_BYTES", "new_key", "push_tag", "seal_chain", "seal_matches", "seal_of", "tag_matches", "tag_of"]
