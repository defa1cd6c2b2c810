"""Names of the hidden-state codecs, importable without torch (the command line builds its choices from them)."""

CODECS: tuple[str, ...] = ("none", "fp16", "bf16", "blockwise8", "dynamic8")

# Default for hidden states. On the trained tiny model through 3 nodes (tests/swarm/test_codec_accuracy.py)
# blockwise8 and dynamic8 tie: 99.5% top-1 agreement, perplexity within 0.03% of lossless, 2.45x fewer bytes per
# token; bench/compression.py measures blockwise8's round trip at about 4.4x a clone against dynamic8's 19-24x on a
# large tensor (2 threads), so blockwise8 wins on time for the same accuracy and bytes.
DEFAULT_CODEC = "blockwise8"
