"""The leakage meter (nesa_node/privacy/leakage.py) and `nesa-node privacy-check` on a tiny random Llama."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model
from nesa_node.privacy.leakage import (
    EdgeSetting,
    check_edges,
    client_pass,
    invert_first_node,
    leakage_grid,
    load_leakage_model,
    measure,
    perplexity,
)

SPEC = TinyModelSpec(layers=3, hidden=64, vocab=512, seed=3)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(init_tiny_model(tmp_path_factory.mktemp("leakage") / "tiny", SPEC))


@pytest.fixture(scope="module")
def model(model_path):
    return load_leakage_model(model_path)


@pytest.fixture(scope="module")
def ids(model) -> torch.Tensor:
    return torch.randint(3, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))  # (batch, seq)


@pytest.mark.parametrize("front", [0, 1, 2])
def test_without_noise_the_first_node_recovers_every_token(model, ids, front):
    """With public weights an edge block hides nothing: decoding through it is exact at sigma 0."""
    row = measure(model, ids, EdgeSetting(front, 0), 0.0)
    assert row.recovery == 1.0
    assert row.tokens == ids.numel()


def test_inversion_decodes_through_the_front_blocks(model, ids):
    """The guesses are the tokens themselves, not a lucky count: and a wrong prefix would be caught by a shuffled
    target (the states of other tokens decode to those tokens)."""
    received = client_pass(model, ids, EdgeSetting(2, 0), 0.0, None).received
    torch.testing.assert_close(invert_first_node(model, received, 2), ids, rtol=0, atol=0)
    swapped = client_pass(model, ids.flip(0), EdgeSetting(2, 0), 0.0, None).received
    torch.testing.assert_close(invert_first_node(model, swapped, 2), ids.flip(0), rtol=0, atol=0)


@pytest.mark.parametrize("front", [0, 1])
def test_large_noise_hides_tokens(model, ids, front):
    rows = leakage_grid(model, ids, [EdgeSetting(front, 0)], [0.0, 3.0, 10.0], seed=1)
    recovery = [row.recovery for row in rows]
    assert recovery[0] == 1.0
    assert recovery[1] < 0.5  # measured 0.41 (front 0) and 0.28 (front 1); chance is 1/512
    assert recovery[2] <= recovery[1]


def test_the_logit_lens_at_no_back_blocks_is_the_client_output(model, ids):
    """With b = 0 the last node sends the final hidden state: the public norm and head give the output exactly,
    noise or not (it was added before that node)."""
    for sigma in (0.0, 1.0):
        row = measure(model, ids, EdgeSetting(1, 0), sigma, seed=2)
        assert row.lens_output == 1.0
        assert row.lens_next == row.model_next


def test_noise_zero_leaves_perplexity_unchanged(model_path, model, ids):
    rows = leakage_grid(model, ids, [EdgeSetting(0, 0), EdgeSetting(0, 2), EdgeSetting(1, 1)], [0.0, 0.5])
    clean = [row for row in rows if row.sigma == 0]
    assert {row.perplexity for row in clean} == {clean[0].perplexity}  # the same pass, however it is split
    assert all(row.perplexity_ratio == 1.0 for row in clean)
    assert all(row.perplexity != clean[0].perplexity for row in rows if row.sigma > 0)
    with torch.inference_mode():
        reference = AutoModelForCausalLM.from_pretrained(model_path)(ids).logits
    assert math.isclose(clean[0].perplexity, perplexity(reference, ids), rel_tol=1e-5)


def test_rows_are_deterministic_and_independent_of_the_grid(model, ids):
    settings, sigmas = [EdgeSetting(0, 0), EdgeSetting(1, 1)], [0.0, 1.0, 3.0]
    first = leakage_grid(model, ids, settings, sigmas, seed=7)
    assert leakage_grid(model, ids, settings, sigmas, seed=7) == first
    assert measure(model, ids, EdgeSetting(1, 1), 3.0, seed=7) == first[-1]
    other = leakage_grid(model, ids, settings[1:], sigmas[1:], seed=8)
    assert [row.perplexity for row in other] != [row.perplexity for row in first[-2:]]


def test_bad_settings_are_refused(model, ids):
    for front, back in [(-1, 0), (0, -1), (2, 1), (3, 0)]:
        with pytest.raises(ValueError, match="edges"):
            check_edges(front, back, model.num_layers)
    with pytest.raises(ValueError, match="sigma"):
        measure(model, ids, EdgeSetting(0, 0), -0.1)
    with pytest.raises(ValueError, match="seq >= 2"):
        measure(model, ids[:, :1], EdgeSetting(0, 0), 0.0)


def _cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "nesa_node.cli", "privacy-check", *args]
    if code is not None:  # the same command, in an interpreter that `code` prepared first
        argv = ["privacy-check", *args]
        command = [
            sys.executable,
            "-c",
            f"import sys\n{code}\nfrom nesa_node.cli import main\nsys.exit(main({argv!r}))",
        ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.cli
def test_privacy_check_command(model_path, tmp_path):
    png = tmp_path / "leak.png"
    args = ["--model", model_path, "--edges", "0,0", "1,1", "--noise", "0", "3", "--prompts", "2", "--tokens", "12"]
    result = _cli(*args, "--png", str(png))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("edges"))
    assert "tokens recovered" in lines[header] and "vs sigma 0" in lines[header]
    rows = [line.split() for line in lines[header + 1 :]]
    assert [row[:2] for row in rows] == [["0,0", "0"], ["0,0", "3"], ["1,1", "0"], ["1,1", "3"]]
    assert rows[0][2] == rows[2][2] == "100.0%" and rows[0][-1] == "x1.000"
    assert "row 4/4" in result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    as_json = _cli("--model", model_path, "--edges", "1,0", "--prompts", "1", "--tokens", "8", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert [row["recovery"] for row in json.loads(as_json.stdout)["rows"]] == [1.0]

    for bad in (["--edges", "2,1"], ["--noise", "-1"]):
        refused = _cli("--model", model_path, *bad)
        assert refused.returncode == 2, refused.stderr
        assert "Traceback" not in refused.stderr and refused.stderr.startswith("error: [")
    missing = _cli("--model", str(tmp_path / "absent"))
    assert missing.returncode == 2 and "[model_load]" in missing.stderr and "Traceback" not in missing.stderr

    # without matplotlib (the `plots` extra), --png fails at once with the install line, before any work
    no_plots = _cli("--model", model_path, "--png", str(tmp_path / "x.png"), code="sys.modules['matplotlib'] = None")
    assert no_plots.returncode == 2 and "Traceback" not in no_plots.stderr
    assert "[plots_unavailable]" in no_plots.stderr and "nesa-node[plots]" in no_plots.stderr
    assert "loading" not in no_plots.stderr
