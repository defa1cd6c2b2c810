"""The "auto" codec choice: lossless unless the 8-bit codec saves time for this message on this link.

Sending n float32 elements over a link of B Mbit/s takes 32 n / B microseconds (16 n / B in bfloat16 or float16,
the dtype nodes send their outputs in); AUTO_CODEC sends about 8.5 bits an element instead, and costs an encode on one end and a decode on the other. Measured for blockwise8 on one core of
the 2-core development host (encode + decode): about 80 us per message plus 1.2 ns per element. Compression pays
when the bits saved take longer to send than the codec takes, with a margin for the estimate; links measured at
LOSSLESS_FROM_MBPS or faster (loopback, a LAN) always stay lossless, since the saving there is under the codec's
own error budget: a lossless swarm gives exactly the tokens of one process. An unknown bandwidth is lossless too.
"""

from __future__ import annotations

import math

from nesa_node.compression.names import AUTO_CODEC

LOSSLESS_FROM_MBPS = 300.0  # below every loopback or LAN figure the link probe gives, above home uplinks (guess)
CODEC_FIXED_S = 80e-6  # encode + decode of one message (blockwise8, measured on the development host)
CODEC_PER_ELEMENT_S = 1.2e-9
MARGIN = 2.0  # the saving must be this many times the codec's cost
LOSSLESS_BITS = 32.0  # float32 on the wire (the default: a 16-bit sender passes its own width)
CODEC_BITS = 8.0 + 32.0 / 64  # an 8-bit code per element and a float32 scale per block of 64


def compression_pays(elements: int, bandwidth_mbps: float | None, lossless_bits: float = LOSSLESS_BITS) -> bool:
    """Whether AUTO_CODEC beats a lossless message of `elements` values of `lossless_bits` each (32: float32, 16:
    bfloat16 or float16) over a link of `bandwidth_mbps`."""
    if bandwidth_mbps is None or not math.isfinite(bandwidth_mbps) or bandwidth_mbps <= 0:
        return False
    if bandwidth_mbps >= LOSSLESS_FROM_MBPS or elements <= 0 or lossless_bits <= CODEC_BITS:
        return False
    saved_s = elements * (lossless_bits - CODEC_BITS) / (bandwidth_mbps * 1e6)
    return saved_s > MARGIN * (CODEC_FIXED_S + CODEC_PER_ELEMENT_S * elements)


__all__ = ["AUTO_CODEC", "LOSSLESS_FROM_MBPS", "compression_pays"]
