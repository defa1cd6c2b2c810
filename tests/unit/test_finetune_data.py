"""The data of `nesa-node finetune` (nesa_node/cli/finetune_data.py): records read or refused with their line, labels
only on what is learnt, windows packed and padded, held-out records apart, and the batch of a step fixed by its
number (what makes a resumed or failed-over run replay the same data)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nesa_node.cli.finetune_data import (
    IGNORE_INDEX,
    Example,
    Record,
    batch_rows,
    hold_out,
    pack,
    predicted,
    read_records,
    tokenize,
)
from nesa_node.errors import TrainingDataError

BOS, EOS, PAD = 1, 2, 0


class CharTokenizer:
    """One token per character (its code point), BOS first with special tokens, as a Llama tokenizer."""

    eos_token_id = EOS

    def __call__(self, texts: list[str], add_special_tokens: bool = True):
        prefix = [BOS] if add_special_tokens else []
        return SimpleNamespace(input_ids=[prefix + [ord(char) for char in text] for text in texts])


def write(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_text_and_prompt_completion_records_are_read_and_blank_lines_skipped(tmp_path):
    path = write(
        tmp_path / "data.jsonl", [json.dumps({"text": "ab"}), "", json.dumps({"prompt": "q", "completion": "c"})]
    )
    assert read_records(path) == [Record("", "ab"), Record("q", "c")]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "line 2: not JSON"),
        ("[1, 2]", "line 2: expected a JSON object, got list"),
        ('{"body": "x"}', 'line 2: expected a "text" field'),
        ('{"text": "  "}', 'line 2: "text" must be a string that is not blank'),
        ('{"text": "a", "prompt": "b"}', 'line 2: give "text", or'),
        ('{"prompt": "a", "completion": 3}', 'line 2: "prompt" and "completion" must be strings'),
    ],
)
def test_a_bad_line_is_refused_with_its_number(tmp_path, line, expected):
    path = write(tmp_path / "data.jsonl", [json.dumps({"text": "fine"}), line])
    with pytest.raises(TrainingDataError, match=expected.replace("[", r"\[")):
        read_records(path)


def test_a_missing_or_empty_file_is_refused(tmp_path):
    with pytest.raises(TrainingDataError, match="--data .*missing.jsonl: no such file"):
        read_records(tmp_path / "missing.jsonl")
    with pytest.raises(TrainingDataError, match="--eval-data .* is empty"):
        read_records(write(tmp_path / "empty.jsonl", ["", "  "]), option="--eval-data")


def test_only_completions_are_learnt_and_records_end_with_eos():
    (text, pair) = tokenize([Record("", "ab"), Record("q", "c")], CharTokenizer())
    assert text.input_ids == [BOS, ord("a"), ord("b"), EOS] and text.labels == [IGNORE_INDEX, ord("a"), ord("b"), EOS]
    assert pair.input_ids == [BOS, ord("q"), ord("c"), EOS]
    assert pair.labels == [IGNORE_INDEX, IGNORE_INDEX, ord("c"), EOS]


def test_packing_cuts_windows_and_pads_the_last():
    windows = pack(tokenize([Record("", "abcdef"), Record("", "g")], CharTokenizer()), seq_len=4, pad_id=PAD)
    # the stream: B a b c | d e f E | B g E + 1 pad
    assert windows.input_ids.tolist() == [
        [BOS, ord("a"), ord("b"), ord("c")],
        [ord("d"), ord("e"), ord("f"), EOS],
        [BOS, ord("g"), EOS, PAD],
    ]
    assert windows.labels[-1].tolist() == [IGNORE_INDEX, ord("g"), EOS, IGNORE_INDEX] and windows.tokens == 11
    assert predicted(windows.labels) == 3 + 3 + 2  # the causal loss never predicts a window's first label


def test_windows_with_nothing_to_learn_are_dropped():
    examples = tokenize([Record("", "abcde"), Record("x" * 7, "y")], CharTokenizer())  # 7 + 10 tokens
    windows = pack(examples, seq_len=4, pad_id=PAD)
    # B a b c | d e E B | x x x x (a prompt: dropped) | x x x y | E + 3 pad (only its first label: dropped)
    assert windows.input_ids.shape == (3, 4) and windows.tokens == 12
    assert windows.labels[-1].tolist() == [IGNORE_INDEX] * 3 + [ord("y")]
    assert predicted(windows.labels) == 3 + 2 + 1
    with pytest.raises(TrainingDataError, match="no window of 4 tokens"):
        pack([Example([BOS, 5, 6], [IGNORE_INDEX] * 3)], seq_len=4, pad_id=PAD)


def test_held_out_records_are_apart_chosen_by_seed():
    records = [Record("", str(index)) for index in range(20)]
    train, held = hold_out(records, 0.1, seed=5)
    assert len(held) == 2 and len(train) == 18 and set(train).isdisjoint(held)
    assert hold_out(records, 0.1, seed=5) == (train, held)
    assert hold_out(records, 0.1, seed=6)[1] != held
    assert len(hold_out(records[:2], 0.01, seed=0)[1]) == 1  # at least one record, and one left to train on
    with pytest.raises(TrainingDataError, match="--eval-data"):
        hold_out(records[:1], 0.5, seed=0)


@given(windows=st.integers(1, 40), batch_size=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_each_epoch_uses_every_window_once_and_a_step_needs_only_its_number(windows, batch_size, seed):
    steps = -(-2 * windows // batch_size)  # two epochs at least
    order = [row for step in range(steps) for row in batch_rows(windows, batch_size, step, seed)]
    assert sorted(order[:windows]) == list(range(windows)) == sorted(order[windows : 2 * windows])
    last = steps - 1
    assert batch_rows(windows, batch_size, last, seed) == order[last * batch_size :]  # no state between steps


def test_the_order_depends_on_the_seed():
    assert batch_rows(100, 8, 0, seed=1) != batch_rows(100, 8, 0, seed=2)
    assert torch.tensor(batch_rows(100, 8, 3, seed=1)).unique().numel() == 8
