"""A process-wide bound on hivemind's msgpack decoding, which peers reach before anything is validated.

hivemind's MSGPackSerializer decodes its extension types (tuples, DHT dictionaries) by calling the msgpack decoder
again from inside the decoder, with no limit: each level holds a C decoder context of tens of KiB on the stack, so a
DHT store request of about 1 KiB with a few hundred nested tuples overflows the stack and kills the process
(SIGSEGV, no log line). That decoding runs in `rpc_store` (the value and subkey of a store, before validation), in
`rpc_find` answers a peer reads, and in DHT values every reader decodes: nodes, bootstrap peers and clients alike.

`install()` (called when nesa_node.peer is imported, so by every process that starts a peer) wraps the extension
decoder with a depth count: more than MAX_EXT_DEPTH nested extension values raise ValueError, which hivemind turns
into a failed request for that peer. hivemind's own values nest three deep at most (a dictionary of values with
expirations, tuples inside). The messages of nesa-node's own protocol never reach this decoder: they refuse
extension types outright (nesa_node.protocol.messages.decode).
"""

from __future__ import annotations

import threading

from hivemind.utils.serializer import MSGPackSerializer

MAX_EXT_DEPTH = 8

_depth = threading.local()


class ExtensionNestingError(ValueError):
    """msgpack extension values nested deeper than MAX_EXT_DEPTH."""


def _bounded(original):
    def decode_ext_types(cls, type_code: int, data: bytes):
        depth = getattr(_depth, "value", 0)
        if depth >= MAX_EXT_DEPTH:
            raise ExtensionNestingError(f"msgpack extension values nested deeper than {MAX_EXT_DEPTH}")
        _depth.value = depth + 1
        try:
            return original(cls, type_code, data)
        finally:
            _depth.value = depth

    decode_ext_types.nesa_bounded = True
    return decode_ext_types


def install() -> None:
    """Bound MSGPackSerializer's extension decoding in this process (idempotent)."""
    current = MSGPackSerializer.__dict__["_decode_ext_types"]
    if getattr(current.__func__, "nesa_bounded", False):
        return
    MSGPackSerializer._decode_ext_types = classmethod(_bounded(current.__func__))


def installed() -> bool:
    return getattr(MSGPackSerializer.__dict__["_decode_ext_types"].__func__, "nesa_bounded", False)


__all__ = ["MAX_EXT_DEPTH", "ExtensionNestingError", "install", "installed"]
