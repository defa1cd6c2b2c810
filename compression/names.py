"""Names of the hidden-state codecs, importable without torch (the command line builds its choices from them)."""

CODECS: tuple[str, ...] = ("none", "fp16", "bf16", "blockwise8", "dynamic8")

# The codec "auto" compresses with. On the trained tiny model through 3 nodes (tests/swarm/test_codec_accuracy.py)
# blockwise8 and dynamic8 tie: 99.5% top-1 agreement, perplexity within 0.03% of lossless, 2.45x fewer bytes per
# token; bench/compression.py measures blockwise8's round trip at about 4.4x a clone against dynamic8's 19-24x on a
# large tensor (2 threads), so blockwise8 wins on time for the same accuracy and bytes.
AUTO_CODEC = "blockwise8"

# What a client asks for by default: "auto" chooses per hop and per message between lossless and AUTO_CODEC, by
# whether the 8-bit codec saves time on that link for that message size (compression/auto.py). A lossy codec on
# every hop changed tokens against one process (first divergence at token 7-12 on random models) and cost 13-16%
# of decode speed on loopback, where it saves nothing.
AUTO = "auto"
DEFAULT_CODEC = AUTO
CLIENT_CODECS: tuple[str, ...] = (AUTO, *CODECS)  # what a client may name: a wire codec, or auto
