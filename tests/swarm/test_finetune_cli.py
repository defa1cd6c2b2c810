"""`nesa-node finetune` as an operator runs it: a subprocess training a LoRA adapter on a swarm of node processes
(bootstrap and two nodes of the trained tiny Llama), writing a PEFT folder that peft loads and metrics whose
held-out losses peft reproduces in one process, then resuming from its checkpoint with the adapter it stopped with;
mistakes print one `error: [code] ...` line and exit 2 before the swarm is joined."""

from __future__ import annotations

import argparse
import json

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nesa_node.cli import build_parser
from nesa_node.cli.finetune_data import pack, predicted, read_records, tokenize
from nesa_node.client.finetune import causal_lm_loss
from nesa_node.devtools.launcher import ProcessGroup

pytestmark = pytest.mark.cli

PREFIX = "finetune-cli"
SEQ_LEN = 32
SILENT_PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmVjXs6BHfUPfdE6yhUMEKBo6YFxUWnDhSSfWHDDWDHeQW"  # nothing is dialled


def write_jsonl(path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def pattern_records(count: int, offset: int = 0) -> list[dict]:
    """Sentences of one pattern (something an adapter learns in a few steps) and question/answer pairs."""
    colours = ["red", "green", "blue", "yellow", "black", "white", "brown"]
    records = []
    for index in range(offset, offset + count):
        colour = colours[index % len(colours)]
        if index % 3 == 0:
            records.append({"prompt": f"What colour is box {index}? ", "completion": f"Box {index} is {colour}."})
        else:
            records.append({"text": f"The box {index} is {colour}. The {colour} box is number {index}."})
    return records


@pytest.fixture(scope="module")
def swarm(trained_model):
    with ProcessGroup() as group:
        peers = group.wait_address(*group.start("boot", ["dht"]), timeout_s=60)
        nodes = [
            group.start(f"node{span}", ["run", "--model", trained_model, "--blocks", span, "--initial-peers", *peers,
                                        "--dht-prefix", PREFIX, "--no-measure", "--announce-period", "1",
                                        "--torch-threads", "1"])
            for span in ("0:2", "2:4")
        ]  # fmt: skip
        for process, address_file in nodes:
            group.wait_address(process, address_file, timeout_s=120)
        yield peers


def finetune_args(model: str, peers: list[str], *extra: str) -> list[str]:
    return ["finetune", "--model", model, "--initial-peers", *peers, "--dht-prefix", PREFIX, "--data", "train.jsonl",
            "--seq-len", str(SEQ_LEN), "--batch-size", "4", "--rank", "4", "--alpha", "8", "--targets",
            "q_proj,v_proj,o_proj", "--lr", "1e-2", "--seed", "3", "--out", "run", "--no-progress", *extra]  # fmt: skip


def one_error_line(result) -> str:
    """The failure's stderr is exactly one line (no traceback) and the status 2; returns the line."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr)
    return lines[0]


def peft_held_out_loss(model, tokenizer, path: str) -> float:
    """The held-out loss as the command defines it (mean per predicted token over every window), in one process."""
    windows = pack(tokenize(read_records(path), tokenizer), SEQ_LEN, tokenizer.pad_token_id)
    total, count = 0.0, 0
    with torch.inference_mode():
        for first in range(0, len(windows), 4):
            ids, labels = windows.input_ids[first : first + 4], windows.labels[first : first + 4]
            total += causal_lm_loss(model(ids).logits, labels).item() * predicted(labels)
            count += predicted(labels)
    return total / count


def test_finetune_trains_an_adapter_peft_loads_and_resumes(swarm, trained_model, operator, tmp_path):
    write_jsonl(tmp_path / "train.jsonl", pattern_records(60))
    held_out = write_jsonl(tmp_path / "eval.jsonl", pattern_records(12, offset=100))
    options = ("--eval-data", "eval.jsonl", "--eval-every", "2", "--checkpoint-every", "3")
    result = operator.run(*finetune_args(trained_model, swarm, "--steps", "4", *options), timeout_s=120)
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert "--adapters run/adapter" in result.stdout and "--adapter run/adapter" in result.stdout, result.stdout

    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["start_step"] == 0 and metrics["failovers"] == 0
    assert [entry["step"] for entry in metrics["losses"]] == [0, 1, 2, 3]
    assert [entry["step"] for entry in metrics["eval"]] == [0, 2, 4]
    before, after = metrics["eval_before"], metrics["eval_after"]
    assert (before["step"], after["step"]) == (0, 4)
    assert after["loss"] < before["loss"] - 0.1, metrics["eval"]  # it learnt the pattern, on text it never saw
    assert metrics["tokens_per_s"] > 0 and metrics["train_tokens"] == 4 * 4 * SEQ_LEN
    assert metrics["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "o_proj"], "edges": []}
    latest = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 4  # the session's at step 3, then the command's own at the end

    # a standard PEFT folder; the held-out losses of the metrics are peft's own on the base model and the adapter
    tokenizer = AutoTokenizer.from_pretrained(trained_model)
    base = AutoModelForCausalLM.from_pretrained(trained_model)
    assert peft_held_out_loss(base, tokenizer, held_out) == pytest.approx(before["loss"], abs=1e-4)
    model = peft.PeftModel.from_pretrained(base, tmp_path / "run" / "adapter")
    assert peft_held_out_loss(model, tokenizer, held_out) == pytest.approx(after["loss"], abs=1e-4)
    trained_b = [parameter for name, parameter in model.named_parameters() if "lora_B" in name]
    assert len(trained_b) == 4 * 3 and all(bool(parameter.abs().sum() > 0) for parameter in trained_b)

    # the same --out again: refused without --resume, and with settings that would change the batches
    again = operator.run(*finetune_args(trained_model, swarm, "--steps", "6", *options), timeout_s=60)
    assert one_error_line(again).startswith("error: [checkpoint] ") and "add --resume" in again.stderr
    other = operator.run(*finetune_args(trained_model, swarm, "--steps", "6", *options, "--resume", "--batch-size",
                                        "2"), timeout_s=60)  # fmt: skip
    line = one_error_line(other)
    assert line.startswith("error: [checkpoint] --resume with other settings") and "batch_size" in line

    resumed = operator.run(*finetune_args(trained_model, swarm, "--steps", "6", *options, "--resume"), timeout_s=120)
    assert resumed.returncode == 0, (resumed.stdout, resumed.stderr)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["start_step"] == 4 and metrics["steps"] == 6
    assert [entry["step"] for entry in metrics["losses"]] == [4, 5]
    assert [entry["step"] for entry in metrics["eval"]] == [4, 6]
    assert metrics["eval_before"]["loss"] == pytest.approx(after["loss"], abs=1e-5)  # the adapter it stopped with


def test_finetune_with_trained_edges_writes_modules_to_save_peft_evaluates_alike(
    swarm, trained_model, operator, tmp_path
):
    write_jsonl(tmp_path / "train.jsonl", pattern_records(30))
    held_out = write_jsonl(tmp_path / "eval.jsonl", pattern_records(8, offset=100))
    result = operator.run(*finetune_args(trained_model, swarm, "--steps", "2", "--train-edges", "norm,lm_head",
                                         "--eval-data", "eval.jsonl"), timeout_s=120)  # fmt: skip
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert "--adapter run/adapter" in result.stdout and "--adapters" not in result.stdout, result.stdout
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["lora"]["edges"] == ["norm", "lm_head"]
    tokenizer = AutoTokenizer.from_pretrained(trained_model)
    model = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(trained_model), tmp_path / "run" / "adapter"
    )
    head = model.base_model.model.lm_head
    assert not torch.equal(head.modules_to_save["default"].weight, head.original_module.weight)  # trained
    assert peft_held_out_loss(model, tokenizer, held_out) == pytest.approx(metrics["eval_after"]["loss"], abs=1e-4)


@pytest.mark.parametrize(
    ("extra", "data", "expected"),
    [
        (["--data", "missing.jsonl"], None, "error: [training_data] --data missing.jsonl: no such file"),
        (["--targets", "q_proj,qq_proj"], [{"text": "a"}], "error: [usage] argument --targets: unknown projection 'qq_proj'"),
        (["--steps", "0"], [{"text": "a"}], "error: [usage] argument --steps: expected a whole number above 0"),
        (["--train-edges", "norm,head"], [{"text": "a"}], "error: [usage] argument --train-edges: expected some of embed_tokens,norm,lm_head, got 'norm,head'"),
        ([], [], "error: [training_data] --data train.jsonl is empty"),
        ([], '{"text": "fine"}\n{"text": \n', "error: [training_data] --data train.jsonl line 2: not JSON"),
        (["--batch-size", "2", "--data-parallel", "2", "--micro-batches", "2"], [{"text": "a"}], "error: [bad_value] --batch-size 2 cannot be split into 2 chains of 2 micro-batches"),
    ],
    ids=["missing-data", "unknown-target", "zero-steps", "unknown-edge", "empty-data", "malformed-line", "unsplittable-batch"],
)  # fmt: skip
def test_mistakes_print_one_error_line(trained_model, operator, tmp_path, extra, data, expected):
    if data is not None:
        if isinstance(data, str):
            (tmp_path / "train.jsonl").write_text(data)
        else:
            write_jsonl(tmp_path / "train.jsonl", data)
    result = operator.run(*finetune_args(trained_model, [SILENT_PEER], "--steps", "3", *extra), timeout_s=60)
    assert one_error_line(result).startswith(expected), result.stderr
    assert not (tmp_path / "run").exists()  # nothing written before the input is known good


def test_help_explains_every_option(capsys):
    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    finetune = commands.choices["finetune"]
    undocumented = [action.option_strings for action in finetune._actions if not action.help]
    assert undocumented == []
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["finetune", "--help"])
    assert exit_.value.code == 0 and "PeftModel.from_pretrained" in capsys.readouterr().out
