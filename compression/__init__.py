"""Tensor codecs for the wire and weight quantization wrappers.

Pure: may import numpy and torch only; no sockets, clocks, global RNG or hivemind (bitsandbytes only inside
`weights`, lazily). Importing the package itself loads nothing heavy: `names` lists the codecs without torch, and
the codec API is loaded on first use.
"""

from nesa_node.compression.names import CODECS, DEFAULT_CODEC

_CODEC_API = ("CodecError", "EncodedTensor", "decode", "encode", "encode_on_device", "wire_bytes")


def __getattr__(name: str):
    if name in _CODEC_API:
        from nesa_node.compression import codec

        return getattr(codec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CODECS", "DEFAULT_CODEC", *_CODEC_API]
