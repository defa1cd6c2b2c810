"""Tensor codecs for the wire and weight quantization wrappers.

Pure: may import numpy and torch only; no sockets, clocks, global RNG or hivemind.
"""

from nesa_node.compression.codec import CodecError, EncodedTensor, decode, encode

__all__ = ["CodecError", "EncodedTensor", "decode", "encode"]
