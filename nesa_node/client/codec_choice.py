"""Which codec hidden states take on a hop: what the sender prefers where both ends accept it, and for "auto" the
8-bit codec only where it saves time for that message on that link (compression/auto.py)."""

from __future__ import annotations

from nesa_node.compression.auto import LOSSLESS_BITS, compression_pays
from nesa_node.compression.names import AUTO, AUTO_CODEC
from nesa_node.protocol.tensors import NO_CODEC, WireCodec
from nesa_node.routing.chain import Hop

AUTO_ELEMENTS = 4096  # hidden size "auto" assumes before the model's is known (a 7B model's)


def codec_for(
    sender: Hop | None,
    receiver: Hop | None,
    preferred: WireCodec,
    *,
    elements: int = AUTO_ELEMENTS,
    bandwidth_mbps: float | None = None,
    lossless_bits: float = LOSSLESS_BITS,
) -> WireCodec:
    """The codec for hidden states going from `sender` to `receiver`: `preferred` when both ends accept it, else
    "none". None stands for the client, which accepts every codec. With "auto" preferred: AUTO_CODEC where it pays
    for a message of `elements` values of `lossless_bits` (the sender's dtype) over a link of `bandwidth_mbps`
    (compression/auto.py), else "none"."""
    if preferred.name == AUTO:
        if not compression_pays(elements, bandwidth_mbps, lossless_bits):
            return NO_CODEC
        preferred = WireCodec.of(AUTO_CODEC)
    for hop in (sender, receiver):
        if hop is not None and preferred.name not in hop.codecs:
            return NO_CODEC
    return preferred


__all__ = ["AUTO_ELEMENTS", "codec_for"]
