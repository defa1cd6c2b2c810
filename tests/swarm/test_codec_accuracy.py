"""Accuracy cost of each hidden-state codec on a trained model through a 3-node swarm (Table 1 of the Nesa paper,
measured): top-1 agreement with the lossless swarm and held-out perplexity."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from nesa_node import DistributedModelForCausalLM
from nesa_node.compression.codec import CODECS
from nesa_node.devtools.evaluation import accuracy_table, format_table
from nesa_node.devtools.tiny_train import evaluate_perplexity, heldout_token_windows
from tests.support.swarm import wait_for_chain

pytestmark = pytest.mark.once  # a measurement or pure data: `make test` runs it in its first pass only

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 20, 24, 32
WINDOWS, WINDOW_TOKENS = 32, 128
SPANS = [(0, 1), (1, 3), (3, 4)]


@pytest.fixture(scope="module")
def trained_swarm(module_swarm, trained_model):
    for start, end in SPANS:
        module_swarm.start_node(trained_model, start, end, dht_prefix="trained")
    return module_swarm


def test_codec_accuracy_table(trained_swarm, trained_model):
    tokenizer = AutoTokenizer.from_pretrained(trained_model)
    prompts = heldout_token_windows(tokenizer, PROMPT_TOKENS, PROMPTS)  # (20, 24)
    windows = heldout_token_windows(tokenizer, WINDOW_TOKENS, WINDOWS)  # (32, 128)
    local = evaluate_perplexity(AutoModelForCausalLM.from_pretrained(trained_model), windows).perplexity

    def opener(codec: str):
        return lambda: DistributedModelForCausalLM.from_pretrained(
            trained_model, initial_peers=trained_swarm.initial_peers, dht_prefix="trained", compression=codec
        )

    rows = accuracy_table(  # "none" first: it is the reference
        [(codec, opener(codec)) for codec in CODECS],
        prompts,
        windows,
        NEW_TOKENS,
        ready=lambda model: wait_for_chain(model, hops=len(SPANS)),
    )
    print("\n" + format_table(rows))
    by_codec = {row.label: row for row in rows}

    lossless = by_codec["none"]
    assert lossless.agreement == 1.0
    assert abs(lossless.perplexity - local) / local < 1e-4  # the swarm computes what one process does
    for codec in ("blockwise8", "dynamic8"):
        row = by_codec[codec]
        assert row.agreement >= 0.95, row
        assert abs(row.perplexity_ratio - 1) <= 0.01, row
        assert row.bytes_per_token < 0.5 * lossless.bytes_per_token, row
    for codec in ("fp16", "bf16"):
        assert by_codec[codec].agreement >= 0.95, by_codec[codec]
