"""Known-answer canary files (nesa_node.verification.canaries): every block boundary equals what the model computes,
any span's answer is the span run on its input, the file round-trips and a file that is not one (or of another
model) is refused with a typed error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from nesa_node.client.config import VerifyPolicy
from nesa_node.errors import CanaryFileError
from nesa_node.sharding.blocks import SpanSpec, load_block_span, load_config
from nesa_node.verification.canaries import (
    ERROR_MARGIN,
    FORMAT,
    MAX_BOUND,
    CanarySet,
    build_canaries,
    canary_token_ids,
)
from nesa_node.verification.commitment import commit_window, compare, tolerance_for


@pytest.fixture(scope="module")
def canaries(tiny_llama) -> CanarySet:
    return build_canaries(tiny_llama, count=3, tokens=10, seed=7)


def test_every_boundary_is_the_models_own_hidden_states(tiny_llama, canaries):
    config = load_config(tiny_llama)
    ids = canary_token_ids(tiny_llama, config, 3, 10, torch.Generator().manual_seed(7))
    assert int(ids.max()) < config.vocab_size and len(set(ids.flatten().tolist())) > 20
    with torch.inference_mode():
        hidden_states = AutoModelForCausalLM.from_pretrained(tiny_llama).model(ids, output_hidden_states=True)
    assert canaries.states.shape == (3, 5, 10, 64) and canaries.states.dtype == torch.float32
    for block in range(4):  # transformers' last entry is after the final norm: the span test below covers block 4
        torch.testing.assert_close(canaries.states[:, block], hidden_states.hidden_states[block], rtol=0, atol=1e-5)


def test_a_canary_starts_as_the_tokenizer_starts_a_prompt(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    config = load_config(tiny_llama)
    plain = canary_token_ids(tiny_llama, config, 4, 6, torch.Generator().manual_seed(2))
    assert not (plain[:, 0] == config.bos_token_id).all()  # this tokenizer puts nothing in front: neither do they
    with_bos = tmp_path / "with-bos"
    with_bos.mkdir()
    for item in Path(tiny_llama).iterdir():
        if not item.name.startswith("tokenizer"):
            (with_bos / item.name).symlink_to(item)
    AutoTokenizer.from_pretrained(tiny_llama, add_bos_token=True).save_pretrained(with_bos)
    assert AutoTokenizer.from_pretrained(with_bos)("a").input_ids[0] == config.bos_token_id
    ids = canary_token_ids(with_bos, config, 4, 6, torch.Generator().manual_seed(2))
    assert (ids[:, 0] == config.bos_token_id).all() and ids.shape == (4, 6)
    assert len(set(ids[:, 1:].flatten().tolist())) > 10
    with pytest.raises(ValueError, match="leave none"):
        canary_token_ids(with_bos, config, 1, 1, torch.Generator())


def test_canaries_built_from_text_are_windows_of_it(tiny_llama):
    from transformers import AutoTokenizer

    text = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. " * 4
    config = load_config(tiny_llama)
    ids = canary_token_ids(tiny_llama, config, 4, 8, torch.Generator().manual_seed(1), [text])
    stream = AutoTokenizer.from_pretrained(tiny_llama)(text, add_special_tokens=False).input_ids
    for row in ids.tolist():  # this tokenizer puts nothing in front of a prompt: each row is a window
        assert any(stream[start : start + 8] == row for start in range(len(stream) - 7)), row
    with pytest.raises(ValueError, match="fewer than"):
        canary_token_ids(tiny_llama, config, 1, 4096, torch.Generator(), ["short"])


def test_each_blocks_honest_error_in_low_precision_is_measured_and_widens_long_spans(canaries):
    for dtype in ("bfloat16", "float16"):
        errors = canaries.honest_error[dtype]
        assert len(errors) == 4 and all(0 < error < 0.05 for error in errors), errors
    assert max(canaries.honest_error["bfloat16"]) > max(canaries.honest_error["float16"])  # 8 bits of mantissa vs 11
    exact = canaries.tolerance(0, 4, "float32", "float32")
    assert exact == tolerance_for("float32", "float32")  # float32 on both sides: the audits' calibration as it is
    bounds = [canaries.tolerance(0, end, "bfloat16", "float32").sketch for end in (1, 2, 3, 4)]
    assert bounds == sorted(bounds) and bounds[0] >= tolerance_for("bfloat16", "float32").sketch
    summed = ERROR_MARGIN * math.sqrt(sum(error**2 for error in canaries.honest_error["bfloat16"]))
    assert bounds[-1] == pytest.approx(max(summed, tolerance_for("bfloat16", "float32").sketch))
    # a client sending bfloat16 to a float32 node is held to bfloat16's bound too
    assert canaries.tolerance(0, 4, "float32", "bfloat16") == canaries.tolerance(0, 4, "bfloat16", "float32")
    # a span rounding past MAX_BOUND is not a check worth making
    coarse = CanarySet(canaries.states, {"bfloat16": (MAX_BOUND / 5,) * 4})
    assert coarse.tolerance(0, 1, "bfloat16", "float32") is not None
    assert coarse.tolerance(0, 4, "bfloat16", "float32") is None
    assert coarse.tolerance(0, 4, "float32", "float32") == tolerance_for("float32", "float32")


@pytest.mark.parametrize("start,end", [(0, 4), (1, 3), (3, 4), (0, 1)])
def test_any_span_maps_its_input_to_its_answer(tiny_llama, canaries, start, end):
    span = load_block_span(tiny_llama, SpanSpec(start, end))
    for index in range(canaries.count):
        given, answer = canaries.case(index, start, end)
        with torch.inference_mode():
            output = span(given)
        assert compare(commit_window(answer), output, tolerance_for("float32", "float32")).matches
        torch.testing.assert_close(output, answer, rtol=1e-4, atol=1e-5)
    noisy = output + 0.02 * output.pow(2).mean().sqrt() * torch.randn(output.shape, generator=torch.Generator())
    assert not compare(commit_window(answer), noisy, tolerance_for("float32", "float32")).matches


def test_the_seed_decides_the_canaries(tiny_llama, canaries):
    assert torch.equal(build_canaries(tiny_llama, count=3, tokens=10, seed=7).states, canaries.states)
    assert not torch.equal(build_canaries(tiny_llama, count=3, tokens=10, seed=8).states, canaries.states)
    assert not torch.equal(build_canaries(tiny_llama, count=3, tokens=10).states, canaries.states)  # random seed
    with pytest.raises(ValueError, match="count"):
        build_canaries(tiny_llama, count=0)
    with pytest.raises(ValueError, match="span"):
        canaries.case(0, 2, 9)


def test_a_file_round_trips_owner_only_and_fits_its_model(tmp_path, canaries):
    path = canaries.write(tmp_path / "c.safetensors")
    assert path.stat().st_mode & 0o077 == 0 and [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]
    read = CanarySet.read(path, num_blocks=4, hidden_size=64)
    assert torch.equal(read.states, canaries.states) and read.honest_error == canaries.honest_error
    with pytest.raises(CanaryFileError, match="of a model of 4 blocks, not 8"):
        CanarySet.read(path, num_blocks=8)
    with pytest.raises(CanaryFileError, match="hidden size 64, not 128"):
        CanarySet.read(path, hidden_size=128)
    with pytest.raises(CanaryFileError, match="no canary file"):
        CanarySet.read(tmp_path / "absent.safetensors")


def _saved(tmp_path, tensors: dict, metadata: dict):
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize(
    "case",
    [
        "garbage",
        "other format",
        "two tensors",
        "rank 3",
        "metadata disagrees",
        "float16",
        "nan",
        "errors not json",
        "errors of another dtype",
        "errors too few",
        "errors negative",
    ],
)
def test_a_file_that_is_not_a_canary_file_is_refused(tmp_path, case):
    states = torch.zeros(2, 5, 4, 8)
    metadata = {"format": FORMAT, "num_blocks": "4", "hidden_size": "8"}
    if case == "garbage":
        path = tmp_path / "bad.safetensors"
        path.write_bytes(b"\xff" * 64)
    elif case == "other format":
        path = _saved(tmp_path, {"states": states}, {**metadata, "format": "nesa-canaries/9"})
    elif case == "two tensors":
        path = _saved(tmp_path, {"states": states, "ids": torch.zeros(2)}, metadata)
    elif case == "rank 3":
        path = _saved(tmp_path, {"states": states[0]}, metadata)
    elif case == "metadata disagrees":
        path = _saved(tmp_path, {"states": states}, {**metadata, "num_blocks": "3"})
    elif case == "float16":
        path = _saved(tmp_path, {"states": states.half()}, metadata)
    elif case.startswith("errors"):
        errors = {
            "errors not json": "{",
            "errors of another dtype": '{"int8": [0, 0, 0, 0]}',
            "errors too few": '{"bfloat16": [0.01]}',
            "errors negative": '{"float16": [0.01, -1, 0, 0]}',
        }[case]
        path = _saved(tmp_path, {"states": states}, {**metadata, "honest_error": errors})
    else:
        states[1, 2, 3, 4] = float("nan")
        path = _saved(tmp_path, {"states": states}, metadata)
    with pytest.raises(CanaryFileError) as refused:
        CanarySet.read(path)
    assert refused.value.code == "canaries" and str(path) in str(refused.value)


def test_the_canary_policy_parses_like_audits():
    policy = VerifyPolicy.parse("canary:0.25")
    assert (policy.mode, policy.rate, str(policy)) == ("canary", 0.25, "canary:0.25")
    for text in ("canary:0", "canary:1.5", "canary:", "canary:x"):
        with pytest.raises(ValueError, match="canary:P"):
            VerifyPolicy.parse(text)


def test_the_command_writes_a_file_the_client_reads(tiny_llama, tmp_path, capsys):
    from nesa_node.cli import main

    out = tmp_path / "known.safetensors"
    assert main(["model", "canaries", tiny_llama, "--out", str(out), "--count", "2", "--tokens", "6"]) == 0
    assert f"wrote {out}: 2 canaries of 6 tokens over 4 blocks" in capsys.readouterr().out
    assert CanarySet.read(out, num_blocks=4, hidden_size=64).states.shape == (2, 5, 6, 64)
    assert main(["model", "canaries", str(tmp_path / "nowhere")]) != 0  # a typed error, told plainly
    assert "Traceback" not in capsys.readouterr().err


def test_a_tokenizer_adding_bos_and_eos_gives_canaries_its_bos_only(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    config = load_config(tiny_llama)
    folder = tmp_path / "bos-and-eos"
    folder.mkdir()
    for item in Path(tiny_llama).iterdir():
        if not item.name.startswith("tokenizer"):
            (folder / item.name).symlink_to(item)
    AutoTokenizer.from_pretrained(tiny_llama, add_bos_token=True, add_eos_token=True).save_pretrained(folder)
    marked = AutoTokenizer.from_pretrained(folder)("a").input_ids
    assert marked[0] == config.bos_token_id and marked[-1] == config.eos_token_id
    ids = canary_token_ids(folder, config, 3, 5, torch.Generator().manual_seed(1))
    assert (ids[:, 0] == config.bos_token_id).all() and not (ids[:, -1] == config.eos_token_id).all()


def test_a_span_rounding_past_the_bound_is_checked_on_a_part_that_does_not(canaries):
    import random
    from types import SimpleNamespace

    from nesa_node.client.canaries import CanaryChecker
    from nesa_node.routing.snapshot import Hop

    per_block = MAX_BOUND / (ERROR_MARGIN * math.sqrt(2.5))  # two blocks fit the bound, three do not
    coarse = CanarySet(canaries.states, {"bfloat16": (per_block,) * 4})
    checker = CanaryChecker(SimpleNamespace(dtype=torch.bfloat16), 1.0, coarse, random.Random(0))
    parts = {checker._checkable(Hop("node", 0, 4), "bfloat16") for _ in range(40)}
    assert {(hop.start_block, hop.end_block) for hop in parts} == {(0, 2), (1, 3), (2, 4)}
    assert checker._checkable(Hop("node", 1, 3), "bfloat16") == Hop("node", 1, 3)  # fits whole: checked whole
    assert checker._checkable(Hop("node", 0, 4), "float32") is not None  # a bfloat16 client is held to bfloat16
    hopeless = CanaryChecker(
        SimpleNamespace(dtype=torch.bfloat16), 1.0, CanarySet(canaries.states, {"bfloat16": (1.0,) * 4})
    )
    assert hopeless._checkable(Hop("node", 0, 4), "bfloat16") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_bfloat16_span_passes_the_bound_calibrated_on_the_cpu(tiny_llama, canaries):
    """The file is calibrated on the CPU that builds it; a GPU's bfloat16 kernels round otherwise. An honest span on
    CUDA in bfloat16 is within the widened bound on every canary, and a span missing its last block is not."""
    bound = canaries.tolerance(0, 4, "bfloat16", "bfloat16")
    assert bound is not None
    honest = load_block_span(tiny_llama, SpanSpec(0, 4, dtype="bfloat16", device="cuda"))
    short = load_block_span(tiny_llama, SpanSpec(0, 3, dtype="bfloat16", device="cuda"))
    errors = []
    with torch.inference_mode():
        for index in range(canaries.count):
            given, answer = canaries.case(index, 0, 4)
            on_device = given.to("cuda", torch.bfloat16)
            report = compare(commit_window(answer), honest(on_device).float().cpu(), bound)
            assert report.matches, report
            errors.append(report.sketch_error)
            assert not compare(commit_window(answer), short(on_device).float().cpu(), bound).matches
    print(f"cuda bfloat16 sketch error {max(errors):.4f} of a bound of {bound.sketch:.4f}")
