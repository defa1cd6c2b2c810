"""Tags on pushed steps: evidence of what a node of a direct chain handed its next node.

In a direct chain node i pushes its output straight to node i+1, and the client sees neither. When node i+1 refuses
that input (NaN, another shape), the client would have only i+1's word against i's. So at open the client gives each
node a key of its own (OpenSession.push_key; no other node learns it), the node tags each step it pushes with
HMAC-SHA256 over the step and its tensor under that key (Step.tag), and a node refusing a tagged push returns it with
its refusal (ErrorReply.evidence and the frame's tensor). The client checks the tag with the key it gave the pusher:
a valid tag proves the pusher sent exactly that, so the client can look at the input itself and tell which of the
two is at fault (client/failover.py). Nobody but the pusher and the client can make a valid tag, so a refusing node
cannot forge evidence, nor a pusher deny it.

The tag covers the step id, position and codec, and the tensor's dtype, shape, compression and bytes, each
length-prefixed, so no two different pushes share the bytes under the MAC.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os

from hivemind.proto import runtime_pb2

CONTEXT = b"nesa-node push tag v1"
KEY_BYTES = 32


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


@functools.lru_cache(maxsize=64)
def _codec_bytes(codec) -> bytes:
    """A codec (a WireCodec: frozen, hashable) as the tag covers it; the few a node sends are worked out once."""
    return json.dumps(codec.to_metadata(), sort_keys=True).encode()


def push_tag(key: bytes, step, tensor: runtime_pb2.Tensor) -> str:
    """HMAC-SHA256 (hex) under `key` of a pushed step (messages.Step: its id, position and codec) and its one
    tensor."""
    return tag_of(key, step.step_id, step.position, step.codec, tensor)


def tag_of(key: bytes, step_id: str, position: int, codec, tensor: runtime_pb2.Tensor) -> str:
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
    ):
        mac.update(len(part).to_bytes(8, "big"))  # each part length-prefixed (no copy of the tensor's bytes)
        mac.update(part)
    return mac.hexdigest()


def tag_matches(key: bytes, step, tensor: runtime_pb2.Tensor) -> bool:
    """Whether `step.tag` is the push tag of `step` and `tensor` under `key` (constant time)."""
    return step.tag is not None and hmac.compare_digest(push_tag(key, step, tensor), step.tag)


__all__ = ["KEY_BYTES", "new_key", "push_tag", "tag_matches", "tag_of"]
