"""What a training session hands out and keeps (no sockets): AdamW's state as canonical bytes (sharding/lora_train.py
OptimizerState), its restore into a fresh optimizer, and checkpoint folders (client/checkpoints.py): written atomically,
read back only when every hash and every node's signature checks out."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey
from safetensors.torch import save

from nesa_node.client.checkpoints import (
    SpanState,
    assemble,
    check_signature,
    latest_step,
    read_checkpoint,
    span_state_of,
    write_checkpoint,
)
from nesa_node.client.train_link import state_answer_bytes, state_tensor_bytes
from nesa_node.errors import AdapterError, AdapterHashError, CheckpointError, RequestError
from nesa_node.protocol.channel import frame
from nesa_node.protocol.identity import peer_id_of_public_key
from nesa_node.protocol.messages import TrainState
from nesa_node.protocol.tensors import bytes_to_proto
from nesa_node.sharding.lora import AdapterSlice, LoraFactors
from nesa_node.sharding.lora_train import (
    OPTIMIZER_FORMAT,
    LoraSpec,
    OptimizerState,
    TrainableSlice,
    init_adapter,
    merge_optimizer_states,
    spec_of_folder,
)

pytestmark = pytest.mark.once  # a measurement or pure data: `make test` runs it in its first pass only

# a Llama-shaped config small enough to build in microseconds: 4 blocks, hidden 16, MLP 24
CONFIG = SimpleNamespace(
    hidden_size=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=24, num_hidden_layers=4
)
SPEC = LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "down_proj"))
ADAMW = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01)
SESSION = "session-0123"


def random_grads(trainable: TrainableSlice, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(parameter.shape, generator=generator) for parameter in trainable.parameters()]


def take_step(trainable: TrainableSlice, optimizer: torch.optim.Optimizer, seed: int) -> None:
    for parameter, grad in zip(trainable.parameters(), random_grads(trainable, seed), strict=True):
        parameter.grad = grad
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trained(steps: int, start: int = 0, end: int = 4) -> tuple[TrainableSlice, torch.optim.Optimizer]:
    """A slice of blocks [start, end) after `steps` AdamW steps on fixed random gradients."""
    trainable = TrainableSlice(init_adapter(CONFIG, SPEC, seed=1).narrow(start, end))
    optimizer = torch.optim.AdamW(trainable.parameters(), foreach=False, **ADAMW)
    for step in range(steps):
        take_step(trainable, optimizer, seed=100 + step)
    return trainable, optimizer


def state_after(steps: int, start: int = 0, end: int = 4) -> OptimizerState:
    trainable, optimizer = trained(steps, start, end)
    return trainable.optimizer_state(optimizer)


def optimizer_bytes(metadata: dict | str, tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    """Safetensors bytes with `metadata` as the optimizer header (a dict is written canonically)."""
    if isinstance(metadata, dict):
        metadata = json.dumps(metadata, sort_keys=True, separators=(",", ":"))
    return save(tensors or {}, metadata={"nesa_optimizer": metadata})


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- OptimizerState bytes ---------------------------------------------------------------------------------------


def test_the_state_round_trips_its_canonical_bytes():
    state = state_after(3)
    assert state.step == 3 and (state.start, state.end) == (0, 4)
    assert len(state.tensors) == 2 * 2 * 3 * 4  # two moments of A and B of three projections in four blocks
    data = state.to_bytes()
    again = OptimizerState.from_bytes(data, state.sha256)
    assert again.sha256 == state.sha256 == sha(data)
    assert again.to_bytes() == data
    assert (again.start, again.end, again.step) == (0, 4, 3)
    assert again.tensors.keys() == state.tensors.keys()
    for name, tensor in state.tensors.items():
        assert torch.equal(again.tensors[name], tensor), name
    assert OptimizerState.from_bytes(data, state.sha256.upper()).sha256 == state.sha256  # hex in either case


def test_the_state_before_any_step_is_empty_and_round_trips():
    trainable, optimizer = trained(0)
    state = trainable.optimizer_state(optimizer)
    assert state.tensors == {} and state.step == 0
    assert OptimizerState.from_bytes(state.to_bytes(), state.sha256).sha256 == state.sha256


def test_bytes_of_another_hash_are_refused():
    state = state_after(1)
    data = bytearray(state.to_bytes())
    data[-3] ^= 0x01  # one bit of one moment
    with pytest.raises(AdapterHashError):
        OptimizerState.from_bytes(bytes(data), state.sha256)
    with pytest.raises(AdapterHashError):
        OptimizerState.from_bytes(state.to_bytes(), "0" * 64)


def _moment(name: str = "1.self_attn.q_proj.lora_A.exp_avg", dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {name: torch.ones(2, 16, dtype=dtype)}


GOOD_HEADER = {"format": OPTIMIZER_FORMAT, "start": 0, "end": 4, "step": 1}
DEEP = "[" * 10_000 + "]" * 10_000


def _deep_safetensors_header() -> bytes:
    header = ('{"__metadata__":{"nesa_optimizer":"{}"},"x":' + DEEP + "}").encode()
    return struct.pack("<Q", len(header)) + header


MALFORMED = {
    "garbage": b"these bytes are not a safetensors file at all",
    "empty": b"",
    "shorter than a header": b"\x07",
    "a header longer than the bytes": struct.pack("<Q", 1 << 62) + b"{}",
    "a header nested 10,000 deep": _deep_safetensors_header(),
    "metadata nested 10,000 deep": optimizer_bytes(DEEP),
    "metadata that is a list": optimizer_bytes("[1, 2]"),
    "metadata that is a number": optimizer_bytes("7"),
    "metadata that is not JSON": optimizer_bytes("{start: 0"),
    "no optimizer metadata": save(_moment()),
    "another format": optimizer_bytes({**GOOD_HEADER, "format": "nesa-lora-sgd/1"}),
    "blocks as text": optimizer_bytes({**GOOD_HEADER, "start": "0"}),
    "step as a boolean": optimizer_bytes({**GOOD_HEADER, "step": True}),
    "a negative step": optimizer_bytes({**GOOD_HEADER, "step": -1}),
    "an empty range": optimizer_bytes({**GOOD_HEADER, "start": 2, "end": 2}),
    "a tensor of another name": optimizer_bytes(GOOD_HEADER, _moment("1.self_attn.q_proj.lora_A.momentum")),
    "a tensor of a projection not trained": optimizer_bytes(GOOD_HEADER, _moment("1.lm_head.lora_A.exp_avg")),
    "a tensor of another dtype": optimizer_bytes(GOOD_HEADER, _moment(dtype=torch.float64)),
    "a half-precision tensor": optimizer_bytes(GOOD_HEADER, _moment(dtype=torch.float16)),
    "metadata not canonical (spaces)": optimizer_bytes(json.dumps(GOOD_HEADER, sort_keys=True)),
    "metadata not canonical (key order)": optimizer_bytes(
        json.dumps(dict(reversed(GOOD_HEADER.items())), separators=(",", ":"))
    ),
    "an extra metadata entry": save({}, metadata={"nesa_optimizer": json.dumps(GOOD_HEADER), "format": "pt"}),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_bytes_that_are_not_a_canonical_state_are_refused(data):
    """Bytes whose hash is the one asked for, so only their content can refuse them: a typed AdapterError (a peer's
    fault), never another exception or a RecursionError."""
    with pytest.raises(AdapterError) as refused:
        OptimizerState.from_bytes(data, sha(data))
    assert not isinstance(refused.value, AdapterHashError)


def test_the_canonical_header_itself_is_accepted():
    """The control for the refusals above: the same construction with nothing wrong decodes."""
    data = optimizer_bytes(GOOD_HEADER, _moment())
    state = OptimizerState.from_bytes(data, sha(data))
    assert state.step == 1 and list(state.tensors) == ["1.self_attn.q_proj.lora_A.exp_avg"]


def test_narrow_and_merge_give_back_the_same_state():
    state = state_after(2)
    first, second = state.narrow(0, 1), state.narrow(1, 4)
    assert (first.start, first.end, first.step) == (0, 1, 2)
    assert all(name.startswith("0.") for name in first.tensors) and len(first.tensors) == 12
    assert all(name.split(".")[0] in {"1", "2", "3"} for name in second.tensors) and len(second.tensors) == 36
    assert merge_optimizer_states([second, first]).sha256 == state.sha256  # in any order
    assert state.narrow(0, 4).sha256 == state.sha256
    # the pieces are canonical states of their own
    assert OptimizerState.from_bytes(second.to_bytes(), second.sha256).sha256 == second.sha256


@pytest.mark.parametrize("blocks", [(2, 5), (3, 3), (3, 2), (-1, 2)])
def test_narrow_refuses_blocks_outside_the_state(blocks):
    with pytest.raises(AdapterError):
        state_after(1).narrow(*blocks)


def test_merge_refuses_states_that_do_not_make_one():
    state = state_after(1)
    with pytest.raises(AdapterError):
        merge_optimizer_states([])
    with pytest.raises(AdapterError, match="do not meet"):
        merge_optimizer_states([state.narrow(0, 1), state.narrow(2, 4)])
    with pytest.raises(AdapterError, match="same step"):
        merge_optimizer_states([state.narrow(0, 2), state_after(2).narrow(2, 4)])


# ---- restoring AdamW ---------------------------------------------------------------------------------------------


def test_a_restored_optimizer_takes_the_same_next_step_bit_for_bit():
    """A replacement node: the slice's values and AdamW's state as bytes, into a fresh slice and a fresh AdamW; the
    next steps of both, on the same gradients, give the same parameters exactly."""
    original, optimizer = trained(3)
    saved = original.optimizer_state(optimizer)
    restored_state = OptimizerState.from_bytes(saved.to_bytes(), saved.sha256)
    fresh = TrainableSlice(original.snapshot())
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), foreach=False, **ADAMW)
    fresh.restore_optimizer(fresh_optimizer, restored_state)
    assert fresh.optimizer_state(fresh_optimizer).sha256 == saved.sha256
    for seed in (7, 8):
        take_step(original, optimizer, seed)
        take_step(fresh, fresh_optimizer, seed)
    for mine, theirs in zip(original.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert fresh.optimizer_state(fresh_optimizer).sha256 == original.optimizer_state(optimizer).sha256
    assert fresh.snapshot().sha256 == original.snapshot().sha256

    # the control: without the restored moments the next step is another one
    blank = TrainableSlice(trained(3)[0].snapshot())
    blank_optimizer = torch.optim.AdamW(blank.parameters(), foreach=False, **ADAMW)
    for seed in (7, 8):
        take_step(blank, blank_optimizer, seed)
    assert blank.snapshot().sha256 != original.snapshot().sha256


def test_an_empty_state_restores_nothing():
    trainable, optimizer = trained(0)
    trainable.restore_optimizer(optimizer, OptimizerState(0, 4, 0, {}))
    assert not optimizer.state


def _changed(state: OptimizerState, name: str, tensor: torch.Tensor | None) -> OptimizerState:
    tensors = dict(state.tensors)
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    return OptimizerState(state.start, state.end, state.step, tensors)


NAME = "2.mlp.down_proj.lora_B.exp_avg"  # (16, 2)


def _with_value(state: OptimizerState, name: str, value: float) -> OptimizerState:
    tensor = state.tensors[name].clone()
    tensor[1, 1] = value
    return _changed(state, name, tensor)


BAD_STATES = {
    "a moment of the wrong shape": lambda state: _changed(state, NAME, state.tensors[NAME].t().contiguous()),
    "a moment with one element more": lambda state: _changed(state, NAME, torch.zeros(17, 2)),
    "a NaN first moment": lambda state: _with_value(state, NAME, float("nan")),
    "an infinite second moment": lambda state: _with_value(state, NAME + "_sq", float("inf")),
    "a negative second moment": lambda state: _with_value(state, NAME + "_sq", -1e-12),
    "a moment missing": lambda state: _changed(state, NAME + "_sq", None),
    "a moment of a parameter not in the slice": lambda state: _changed(
        state, "2.self_attn.k_proj.lora_A.exp_avg", torch.zeros(2, 16)
    ),
    "another range of blocks": lambda state: OptimizerState(0, 3, state.step, state.narrow(0, 3).tensors),
}


@pytest.mark.parametrize("corrupt", BAD_STATES.values(), ids=BAD_STATES.keys())
def test_restore_refuses_moments_that_do_not_fit(corrupt):
    bad = corrupt(state_after(2))
    trainable = TrainableSlice(init_adapter(CONFIG, SPEC, seed=1))
    optimizer = torch.optim.AdamW(trainable.parameters(), foreach=False, **ADAMW)
    with pytest.raises(AdapterError):
        trainable.restore_optimizer(optimizer, bad)


def test_non_finite_moments_travel_as_bytes_but_are_never_restored():
    """from_bytes checks form, restore checks values: a NaN in canonical bytes decodes, and is refused on restore
    (what a node opening a session does with a client's state)."""
    bad = _with_value(state_after(2), NAME, float("nan"))
    decoded = OptimizerState.from_bytes(bad.to_bytes(), bad.sha256)
    trainable = TrainableSlice(init_adapter(CONFIG, SPEC, seed=1))
    optimizer = torch.optim.AdamW(trainable.parameters(), foreach=False, **ADAMW)
    with pytest.raises(AdapterError, match="not finite"):
        trainable.restore_optimizer(optimizer, decoded)


# ---- checkpoints -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys() -> list[RSAPrivateKey]:
    return [RSAPrivateKey() for _ in range(3)]


def peer_of(key: RSAPrivateKey) -> str:
    return peer_id_of_public_key(key.get_public_key()).to_base58()


def signed_message(trainable: TrainableSlice, state: OptimizerState, key: RSAPrivateKey | None) -> TrainState:
    """The TrainState a node answers for its slice: hashes, signed by `key` for SESSION."""
    piece = trainable.snapshot()
    message = TrainState(
        start_block=piece.start,
        end_block=piece.end,
        step=state.step,
        slice_sha256=piece.sha256,
        optimizer_sha256=state.sha256,
    )
    if key is None:
        return message
    return message.model_copy(
        update={"public_key": key.get_public_key().to_bytes(), "signature": key.sign(message.signed_bytes(SESSION))}
    )


def span(step: int, start: int, end: int, key: RSAPrivateKey) -> SpanState:
    trainable, optimizer = trained(step, start, end)
    state = trainable.optimizer_state(optimizer)
    if not state.tensors:
        state = OptimizerState(start, end, step, {})
    message = signed_message(trainable, state, key)
    return SpanState(trainable.snapshot(), state, peer_of(key), message.public_key, message.signature)


def checkpoint_at(step: int, keys: list[RSAPrivateKey]):
    """A whole adapter at `step` from two nodes: blocks 0:1 signed by the first key, 1:4 by the second."""
    spans = [span(step, 0, 1, keys[0]), span(step, 1, 4, keys[1])]
    return assemble(step, SESSION, SPEC, dict(lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"]), spans)


def folders(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if path.is_dir())


def test_a_checkpoint_reads_back_as_written(tmp_path, keys):
    checkpoint = checkpoint_at(3, keys)
    written = write_checkpoint(tmp_path, checkpoint)
    assert written == tmp_path / "step-00000003"
    assert json.loads((tmp_path / "latest.json").read_text()) == {"step": 3, "folder": "step-00000003"}
    assert latest_step(tmp_path) == 3
    assert sorted(path.name for path in written.iterdir()) == [
        "adapter",
        "blocks-0-1.adamw.safetensors",
        "blocks-0-1.slice.safetensors",
        "blocks-1-4.adamw.safetensors",
        "blocks-1-4.slice.safetensors",
        "manifest.json",
    ]
    assert spec_of_folder(written / "adapter") == SPEC  # the whole adapter as a PEFT folder too
    read = read_checkpoint(tmp_path, num_blocks=4)
    assert (read.step, read.session_id, read.spec, read.optimizer) == (3, SESSION, SPEC, checkpoint.optimizer)
    assert read.adapter.sha256 == checkpoint.adapter.sha256
    assert read.adam.sha256 == checkpoint.adam.sha256
    assert [span.peer_id for span in read.spans] == [peer_of(keys[0]), peer_of(keys[1])]
    with pytest.raises(CheckpointError, match="covers blocks 0:4"):
        read_checkpoint(tmp_path, num_blocks=5)


def test_an_empty_folder_holds_no_checkpoint(tmp_path):
    assert latest_step(tmp_path) is None
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        read_checkpoint(tmp_path, num_blocks=4)


def test_only_the_last_two_checkpoints_are_kept(tmp_path, keys):
    for step in (1, 2, 3, 4):
        write_checkpoint(tmp_path, checkpoint_at(step, keys))
    assert folders(tmp_path) == ["step-00000003", "step-00000004"]
    assert not list(tmp_path.rglob("*.partial"))
    assert read_checkpoint(tmp_path, num_blocks=4).step == 4


def _failing_replace(monkeypatch, where: str):
    """os.replace that raises (a crash, a full disk) on one rename of write_checkpoint; returns the calls seen."""
    real = os.replace
    calls = []

    def replace(source, destination):
        source, destination = Path(source), Path(destination)
        calls.append(destination.name)
        crash = {
            "slice file": destination.name.endswith(".slice.safetensors"),
            "manifest": destination.name == "manifest.json",
            "staging folder": source.is_dir() and source.name.endswith(".partial"),
            "latest pointer": destination.name == "latest.json",
        }[where]
        if crash:
            raise OSError(28, f"simulated crash renaming {source.name}")
        real(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    return calls


@pytest.mark.parametrize("where", ["slice file", "manifest", "staging folder", "latest pointer"])
def test_a_crash_mid_write_leaves_the_previous_checkpoint_current(tmp_path, keys, monkeypatch, where):
    first = checkpoint_at(1, keys)
    write_checkpoint(tmp_path, first)
    calls = _failing_replace(monkeypatch, where)
    with pytest.raises(OSError, match="simulated crash"):
        write_checkpoint(tmp_path, checkpoint_at(2, keys))
    assert calls  # the crash happened inside write_checkpoint's renames
    monkeypatch.undo()
    assert json.loads((tmp_path / "latest.json").read_text()) == {"step": 1, "folder": "step-00000001"}
    assert latest_step(tmp_path) == 1
    read = read_checkpoint(tmp_path, num_blocks=4)
    assert read.step == 1 and read.adapter.sha256 == first.adapter.sha256 and read.adam.sha256 == first.adam.sha256

    # the next write (the run goes on) replaces whatever the crash left
    again = write_checkpoint(tmp_path, checkpoint_at(2, keys))
    assert read_checkpoint(tmp_path, num_blocks=4).step == 2 and again.name == "step-00000002"
    assert not list(tmp_path.rglob("*.partial"))


def test_a_crash_rewriting_the_same_step_leaves_that_checkpoint_readable(tmp_path, keys, monkeypatch):
    checkpoint = checkpoint_at(2, keys)
    write_checkpoint(tmp_path, checkpoint)
    _failing_replace(monkeypatch, "staging folder")
    with pytest.raises(OSError, match="simulated crash"):
        write_checkpoint(tmp_path, checkpoint)
    monkeypatch.undo()
    assert read_checkpoint(tmp_path, num_blocks=4).step == 2


def test_writing_a_lower_step_than_older_folders_keeps_the_one_written(tmp_path, keys):
    for step in (8, 12):  # an earlier, longer run left these
        write_checkpoint(tmp_path, checkpoint_at(step, keys))
    written = write_checkpoint(tmp_path, checkpoint_at(4, keys))
    assert latest_step(tmp_path) == 4
    assert read_checkpoint(tmp_path, num_blocks=4).step == 4  # CheckpointError: latest.json names a removed folder
    assert written.is_dir()


def _manifest(tmp_path: Path) -> tuple[Path, dict]:
    path = tmp_path / "step-00000002" / "manifest.json"
    return path, json.loads(path.read_text())


def _edit_manifest(tmp_path: Path, edit) -> None:
    path, manifest = _manifest(tmp_path)
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _flip_byte(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _swap_slice(tmp_path: Path, keys) -> None:
    """Another valid slice of blocks 0:1 in place of the node's, its hash written into the manifest: the bytes and
    the manifest agree, only the node's signature can tell."""
    other = TrainableSlice(init_adapter(CONFIG, SPEC, seed=99).narrow(0, 1)).snapshot()
    (tmp_path / "step-00000002" / "blocks-0-1.slice.safetensors").write_bytes(other.to_bytes())
    _edit_manifest(tmp_path, lambda manifest: manifest["spans"][0].update(slice_sha256=other.sha256))


def _flip_signature(manifest: dict) -> None:
    signature = bytearray(bytes.fromhex(manifest["spans"][1]["signature"]))
    signature[10] = ord("A") if signature[10] != ord("A") else ord("B")  # still base64, another signature
    manifest["spans"][1]["signature"] = signature.hex()


def _other_key(manifest: dict, keys) -> None:
    manifest["spans"][0]["public_key"] = keys[2].get_public_key().to_bytes().hex()


TAMPERING = {
    "a slice file's byte": lambda root, keys: _flip_byte(root / "step-00000002" / "blocks-1-4.slice.safetensors"),
    "an optimizer file's byte": lambda root, keys: _flip_byte(root / "step-00000002" / "blocks-0-1.adamw.safetensors"),
    "a slice file cut short": lambda root, keys: (root / "step-00000002" / "blocks-0-1.slice.safetensors").write_bytes(
        b"\0" * 64
    ),
    "a slice file missing": lambda root, keys: (root / "step-00000002" / "blocks-1-4.slice.safetensors").unlink(),
    "another slice, rehashed": _swap_slice,
    "another node named as signer": lambda root, keys: _edit_manifest(
        root, lambda manifest: manifest["spans"][0].update(signer=peer_of(keys[1]))
    ),
    "a signature byte": lambda root, keys: _edit_manifest(root, _flip_signature),
    "the signatures swapped": lambda root, keys: _edit_manifest(
        root,
        lambda manifest: (
            manifest["spans"][0].update(signature=manifest["spans"][1]["signature"]),
            manifest["spans"][1].update(signature=_manifest(root)[1]["spans"][0]["signature"]),
        ),
    ),
    "another public key": lambda root, keys: _edit_manifest(root, lambda manifest: _other_key(manifest, keys)),
    "a public key that is not one": lambda root, keys: _edit_manifest(
        root, lambda manifest: manifest["spans"][0].update(public_key="00ff")
    ),
    "no signature": lambda root, keys: _edit_manifest(root, lambda manifest: manifest["spans"][1].update(signature="")),
    "another session": lambda root, keys: _edit_manifest(root, lambda manifest: manifest.update(session_id="other")),
    "another step": lambda root, keys: _edit_manifest(root, lambda manifest: manifest.update(step=3)),
    "a span's step": lambda root, keys: _edit_manifest(root, lambda manifest: manifest["spans"][0].update(step=3)),
    "a span left out": lambda root, keys: _edit_manifest(root, lambda manifest: manifest["spans"].pop(0)),
    "no spans": lambda root, keys: _edit_manifest(root, lambda manifest: manifest.update(spans=[])),
    "another format": lambda root, keys: _edit_manifest(root, lambda manifest: manifest.update(format="x/1")),
    "a manifest that is not JSON": lambda root, keys: _manifest(root)[0].write_text("{"),
    "a manifest nested 10,000 deep": lambda root, keys: _manifest(root)[0].write_text(DEEP),
    "latest naming no folder": lambda root, keys: (root / "latest.json").write_text('{"step": 2, "folder": "nope"}'),
}


@pytest.mark.parametrize("tamper", TAMPERING.values(), ids=TAMPERING.keys())
def test_a_damaged_or_edited_checkpoint_is_refused(tmp_path, keys, tamper):
    write_checkpoint(tmp_path, checkpoint_at(2, keys))
    read_checkpoint(tmp_path, num_blocks=4)  # the control: untouched, it reads
    tamper(tmp_path, keys)
    with pytest.raises(CheckpointError):
        read_checkpoint(tmp_path, num_blocks=4)


# ---- a node's signed answer --------------------------------------------------------------------------------------


def test_the_signature_binds_the_node_and_the_session(keys):
    trainable, optimizer = trained(1, 0, 2)
    state = trainable.optimizer_state(optimizer)
    message = signed_message(trainable, state, keys[0])
    check_signature(message, SESSION, peer_of(keys[0]))
    with pytest.raises(CheckpointError, match="not signed by that node"):
        check_signature(message, SESSION, peer_of(keys[1]))
    with pytest.raises(CheckpointError, match="not signed by that node"):
        check_signature(message, "another-session", peer_of(keys[0]))
    with pytest.raises(CheckpointError, match="not signed by that node"):
        check_signature(message.model_copy(update={"step": 2}), SESSION, peer_of(keys[0]))
    with pytest.raises(CheckpointError, match="unsigned"):
        check_signature(signed_message(trainable, state, None), SESSION, peer_of(keys[0]))


LIMIT = 1 << 20  # bytes per tensor of a state answer: more than these spans hold


def test_a_span_state_is_taken_from_an_answer_only_when_it_checks_out(keys):
    trainable, optimizer = trained(2, 1, 3)
    state = trainable.optimizer_state(optimizer)
    message = signed_message(trainable, state, keys[0])
    piece_bytes, adam_bytes = trainable.snapshot().to_bytes(), state.to_bytes()
    answer = frame(message, [bytes_to_proto(piece_bytes), bytes_to_proto(adam_bytes)])
    peer = peer_of(keys[0])
    taken = span_state_of(message, answer, (1, 3), 2, SESSION, peer, max_bytes=LIMIT)
    assert taken.slice.sha256 == trainable.snapshot().sha256 and taken.optimizer.sha256 == state.sha256
    with pytest.raises(CheckpointError):
        span_state_of(message, answer, (0, 3), 2, SESSION, peer, max_bytes=LIMIT)  # another span than asked
    with pytest.raises(CheckpointError):
        span_state_of(message, answer, (1, 3), 3, SESSION, peer, max_bytes=LIMIT)  # another step
    with pytest.raises(CheckpointError):
        span_state_of(message, frame(message, [bytes_to_proto(piece_bytes)]), (1, 3), 2, SESSION, peer, max_bytes=LIMIT)
    with pytest.raises(CheckpointError):
        span_state_of(message, answer, (1, 3), 2, SESSION, peer_of(keys[1]), max_bytes=LIMIT)
    tampered = bytearray(piece_bytes)
    tampered[-2] ^= 1
    with pytest.raises(RequestError):  # AdapterHashError: the bytes are not the ones signed
        span_state_of(
            message,
            frame(message, [bytes_to_proto(bytes(tampered)), bytes_to_proto(adam_bytes)]),
            (1, 3),
            2,
            SESSION,
            peer,
            max_bytes=LIMIT,
        )
    # an optimizer state of another range than the slice, though both hash and sign correctly
    other = state_after(2, 0, 2)
    mismatched = signed_message(trainable, other, keys[0])
    with pytest.raises(CheckpointError, match="does not match"):
        span_state_of(
            mismatched,
            frame(mismatched, [bytes_to_proto(piece_bytes), bytes_to_proto(other.to_bytes())]),
            (1, 3),
            2,
            SESSION,
            peer,
            max_bytes=LIMIT,
        )


def test_a_span_state_is_bounded_by_what_the_clients_own_slice_of_its_blocks_allows(keys):
    """The client bounds a node's TrainState by its own slice of the node's blocks (the one it opened the session
    with): the node's float32 slice and AdamW moments fit the bound even when the client's copy is half as wide,
    and a tensor over it is refused before its bytes are parsed."""
    trainable, optimizer = trained(2, 1, 3)
    state = trainable.optimizer_state(optimizer)
    message = signed_message(trainable, state, keys[0])
    piece_bytes, adam_bytes = trainable.snapshot().to_bytes(), state.to_bytes()
    answer = frame(message, [bytes_to_proto(piece_bytes), bytes_to_proto(adam_bytes)])
    own = init_adapter(CONFIG, SPEC, seed=1).narrow(1, 3)
    narrow = AdapterSlice(1, 3, {key: LoraFactors(f.lora_a.bfloat16(), f.lora_b.bfloat16(), f.scale)
                                 for key, f in own.factors.items()})  # fmt: skip
    for copy in (own, narrow):
        limit = state_tensor_bytes(copy)
        assert max(len(piece_bytes), len(adam_bytes)) <= limit
        assert answer.ByteSize() <= state_answer_bytes(limit)
        span_state_of(message, answer, (1, 3), 2, SESSION, peer_of(keys[0]), max_bytes=limit)
    with pytest.raises(RequestError, match="bytes where at most"):
        span_state_of(message, answer, (1, 3), 2, SESSION, peer_of(keys[0]), max_bytes=len(adam_bytes) - 1)
