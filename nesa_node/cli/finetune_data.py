"""The data of `nesa-node finetune`: JSON lines, tokenized, packed into fixed windows, and the batch of each step.

- `read_records(path)`: one object a line, {"text": ...} (every token is learnt) or {"prompt": ..., "completion": ...}
  (only the completion's tokens are learnt: the prompt's labels are -100); blank lines are skipped.
- `hold_out(records, fraction, seed)`: records apart for held-out evaluation, chosen by `seed`.
- `tokenize(records, tokenizer)` and `pack(examples, seq_len, pad_id)`: records end with the tokenizer's end-of-text
  token and run on into one stream, cut into windows of `seq_len` tokens; the last is right-padded with labels -100.
  A window with nothing to predict (every label after its first -100) is dropped: its loss would be 0 / 0.
- `batch_rows(windows, batch_size, step, seed)`: the windows of step `step`. Epochs are permutations of the windows
  drawn from a generator seeded with (seed, epoch) and read one after another, so a step's batch depends only on
  its number: a resumed session, or one whose step went back after a failover, replays the same batches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nesa_node.errors import TrainingDataError

# labels that take no part in the loss: transformers' convention, as nesa_node.client.finetune.IGNORE_INDEX (not
# imported from there: the client takes seconds to import, and bad data should be told at once)
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Record:
    """One line of a data file: `prompt` is not learnt, `completion` is (a "text" line has prompt "")."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # the token, or IGNORE_INDEX where nothing is learnt


@dataclass(frozen=True)
class Windows:
    input_ids: torch.Tensor  # (windows, seq_len) int64
    labels: torch.Tensor  # (windows, seq_len) int64, IGNORE_INDEX on prompts and padding
    tokens: int  # tokens of the data in these windows, padding excluded

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def read_records(path: str | Path, *, option: str = "--data") -> list[Record]:
    """The records of JSON-lines file `path`. Raises TrainingDataError naming `option`, the file and the line for a
    missing or unreadable file, a line that is not an object with "text" or "prompt" and "completion" strings, or
    a file with no records."""
    file = Path(path)
    if not file.is_file():
        raise TrainingDataError(f'{option} {path}: no such file (JSON lines, each with a "text" field)')
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainingDataError(f"{option} {path}: cannot be read as UTF-8 text ({exc})") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            records.append(_record(line, f"{option} {path} line {number}"))
    if not records:
        raise TrainingDataError(f'{option} {path} is empty: give one JSON object a line, with a "text" field')
    return records


def _record(line: str, where: str) -> Record:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TrainingDataError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise TrainingDataError(f"{where}: expected a JSON object, got {type(value).__name__}")
    if "text" in value:
        if "prompt" in value or "completion" in value:
            raise TrainingDataError(f'{where}: give "text", or "prompt" and "completion", not both')
        text = value["text"]
        if not isinstance(text, str) or not text.strip():
            raise TrainingDataError(f'{where}: "text" must be a string that is not blank')
        return Record("", text)
    if "completion" not in value:
        raise TrainingDataError(f'{where}: expected a "text" field, or "prompt" and "completion"')
    prompt, completion = value.get("prompt", ""), value["completion"]
    if not isinstance(prompt, str) or not isinstance(completion, str) or not completion.strip():
        raise TrainingDataError(f'{where}: "prompt" and "completion" must be strings, the completion not blank')
    return Record(prompt, completion)


def hold_out(records: list[Record], fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    """(training records, held-out records): round(fraction * count) records, at least one, chosen by `seed`; the
    rest keep their order. Whole records are held out, so no held-out text is trained on. TrainingDataError when
    fewer than two records leave nothing on one side."""
    if not 0 < fraction < 1:
        raise ValueError(f"the held-out fraction must be between 0 and 1, got {fraction}")
    if len(records) < 2:
        raise TrainingDataError(
            f"cannot hold out a fraction of {len(records)} record: give --eval-data, or --eval-fraction 0 for none"
        )
    count = min(max(round(fraction * len(records)), 1), len(records) - 1)
    chosen = set(np.random.default_rng(seed).choice(len(records), size=count, replace=False).tolist())
    train = [record for index, record in enumerate(records) if index not in chosen]
    held_out = [record for index, record in enumerate(records) if index in chosen]
    return train, held_out


def tokenize(records: list[Record], tokenizer) -> list[Example]:
    """Each record's tokens, the tokenizer's special tokens first (its BOS, if it adds one) and its end-of-text token
    last, so packed records are told apart; the prompt's labels are IGNORE_INDEX."""
    prompts = tokenizer([record.prompt for record in records], add_special_tokens=True).input_ids
    completions = tokenizer([record.completion for record in records], add_special_tokens=False).input_ids
    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    examples = []
    for prompt, completion in zip(prompts, completions, strict=True):
        learnt = completion + end
        examples.append(Example(prompt + learnt, [IGNORE_INDEX] * len(prompt) + learnt))
    return examples


def pack(examples: list[Example], seq_len: int, pad_id: int) -> Windows:
    """The examples as one stream cut into windows of `seq_len` tokens (the last right-padded with `pad_id`, labels
    IGNORE_INDEX); windows with nothing to predict are dropped. TrainingDataError when none is left."""
    if seq_len < 2:
        raise ValueError(f"a window needs 2 tokens or more, got {seq_len}")
    input_ids = [token for example in examples for token in example.input_ids]
    labels = [label for example in examples for label in example.labels]
    padding = -len(input_ids) % seq_len
    ids = torch.tensor(input_ids + [pad_id] * padding, dtype=torch.int64).view(-1, seq_len)  # (windows, seq_len)
    targets = torch.tensor(labels + [IGNORE_INDEX] * padding, dtype=torch.int64).view(-1, seq_len)
    real = (torch.arange(ids.numel()) < len(input_ids)).view(-1, seq_len)  # (windows, seq_len): not padding
    keep = (targets[:, 1:] != IGNORE_INDEX).any(dim=1)  # the loss predicts labels 1.. from positions ..-1
    if not bool(keep.any()):
        raise TrainingDataError(f"no window of {seq_len} tokens has a token to learn")
    return Windows(ids[keep], targets[keep], int(real[keep].sum()))


def predicted(labels: torch.Tensor) -> int:
    """How many labels of a (batch, seq_len) batch the causal loss averages over."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def batch_rows(windows: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The window indices of step `step`'s batch (module docstring); a batch larger than the data repeats windows
    from the next epochs."""
    if windows < 1 or batch_size < 1 or step < 0:
        raise ValueError(f"need windows >= 1, batch_size >= 1 and step >= 0, got {windows}, {batch_size}, {step}")
    first = step * batch_size
    rows, orders = [], {}
    for position in range(first, first + batch_size):
        epoch = position // windows
        if epoch not in orders:
            orders[epoch] = np.random.default_rng((seed, epoch)).permutation(windows)
        rows.append(int(orders[epoch][position % windows]))
    return rows


def batch_of(data: Windows, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of the windows `rows`, each (len(rows), seq_len)."""
    index = torch.tensor(rows, dtype=torch.int64)
    return data.input_ids[index], data.labels[index]


__all__ = [
    "Example",
    "Record",
    "Windows",
    "batch_of",
    "batch_rows",
    "hold_out",
    "pack",
    "predicted",
    "read_records",
    "tokenize",
]
