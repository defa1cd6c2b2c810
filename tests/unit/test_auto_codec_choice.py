"""The "auto" codec choice (compression/auto.py): lossless unless the 8-bit codec saves time on the link."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nesa_node.client.codec_choice import codec_for
from nesa_node.client.config import ClientConfig, client_codec
from nesa_node.compression.auto import LOSSLESS_FROM_MBPS, compression_pays
from nesa_node.compression.names import AUTO_CODEC, DEFAULT_CODEC
from nesa_node.protocol.records import bandwidth_from_pings
from nesa_node.routing.chain import Hop

PREFILL = 128 * 4096  # a 128-token prompt of a 4096-wide model, elements
DECODE = 4096


def test_fast_or_unknown_links_stay_lossless():
    for bandwidth in (None, 0.0, float("nan"), LOSSLESS_FROM_MBPS, 1600.0, 20_000.0):
        assert not compression_pays(PREFILL, bandwidth)


def test_a_slow_link_compresses_big_messages_and_not_tiny_ones():
    assert compression_pays(PREFILL, 50.0)  # 16 MiB at 50 Mbit/s: 2.7 s, against ms of codec work
    assert compression_pays(DECODE, 50.0)  # 16 KiB: 2.0 ms saved against 0.09 ms
    assert not compression_pays(64, 50.0)  # 256 bytes: the codec's fixed cost is more than the saving


@given(st.integers(1, 1 << 24), st.floats(0.1, 10_000.0))
def test_compressing_pays_more_on_slower_links_and_for_bigger_messages(elements, bandwidth):
    if compression_pays(elements, bandwidth):
        assert compression_pays(elements, bandwidth / 2)
        assert compression_pays(elements * 2, bandwidth)


def test_auto_is_the_default_and_resolves_per_hop_and_message():
    config = ClientConfig()
    assert config.compression.name == DEFAULT_CODEC == "auto"
    assert ClientConfig(compression="none").compression.name == "none"
    hop = Hop("node", 0, 4, codecs=("none", AUTO_CODEC))
    lossless_only = Hop("old", 0, 4, codecs=("none",))
    auto = client_codec("auto")
    assert codec_for(None, hop, auto, elements=PREFILL, bandwidth_mbps=2000.0).name == "none"
    assert codec_for(None, hop, auto, elements=PREFILL, bandwidth_mbps=None).name == "none"
    assert codec_for(None, hop, auto, elements=PREFILL, bandwidth_mbps=50.0).name == AUTO_CODEC
    assert codec_for(None, lossless_only, auto, elements=PREFILL, bandwidth_mbps=50.0).name == "none"
    assert codec_for(None, hop, client_codec("fp16"), elements=1, bandwidth_mbps=1e6).name == "none"  # not accepted


def test_a_fast_link_far_away_is_not_rated_by_its_latency():
    """A 256 KiB ping adds 2 ms to a 50 ms round trip at 1 Gbit/s: lost in the pings' noise, so the figure is the
    bound the measurement supports (the payload took at most a tenth of the loaded trip), and the link stays
    lossless; a slow link, whose payload shows, is measured as it is."""
    payload = 256 * 1024
    far_and_fast = bandwidth_from_pings(payload, 0.050, 0.050 + payload * 8 / 1e9)
    assert far_and_fast >= LOSSLESS_FROM_MBPS and not compression_pays(DECODE, far_and_fast)
    assert not compression_pays(PREFILL, far_and_fast)
    slow = bandwidth_from_pings(payload, 0.001, 0.001 + payload * 8 / 50e6)
    assert abs(slow - 50.0) < 1e-6 and compression_pays(DECODE, slow)
    busy = bandwidth_from_pings(payload, 0.030, 0.020)  # the empty pings met a busy moment: still a finite figure
    assert 0 < busy < float("inf")


@given(
    st.integers(1, 1 << 24),
    st.floats(1e-5, 10.0, allow_nan=False),
    st.floats(1e-5, 10.0, allow_nan=False),
    st.floats(1e-5, 10.0, allow_nan=False),
)
def test_a_slower_loaded_trip_never_rates_a_link_faster(payload, rtt, loaded, extra):
    assert 0 < bandwidth_from_pings(payload, rtt, loaded + extra) <= bandwidth_from_pings(payload, rtt, loaded)


def test_a_16_bit_sender_saves_half_as_much_and_compresses_on_slower_links_only():
    """Nodes in bfloat16 send 16 bits a value, not 32: the 8-bit codec saves 7.5 bits a value, not 23.5, so a
    one-token step that pays for float32 at 250 Mbit/s does not for bfloat16 there; at 50 Mbit/s both pay."""
    assert compression_pays(DECODE, 250.0) and not compression_pays(DECODE, 250.0, lossless_bits=16)
    assert compression_pays(DECODE, 50.0, lossless_bits=16)
    assert not compression_pays(PREFILL, 50.0, lossless_bits=8)  # nothing to save over an 8-bit dtype
    hop = Hop("node", 0, 4, codecs=("none", AUTO_CODEC))
    auto = client_codec("auto")
    assert codec_for(None, hop, auto, elements=DECODE, bandwidth_mbps=250.0).name == AUTO_CODEC
    assert codec_for(None, hop, auto, elements=DECODE, bandwidth_mbps=250.0, lossless_bits=16).name == "none"
