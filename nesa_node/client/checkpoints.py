"""Checkpoints of a LoRA training session: each node's slice and AdamW state at one step, as the node signed them.

The client keeps them, not the nodes: a node replacing a dead one runs on another machine and cannot read the dead
node's disk, while the client outlives every node of its chain. The nodes' signatures keep each slice attributable
to the node that produced it wherever the files travel.

A checkpoint folder holds one subfolder per kept checkpoint and a pointer to the newest:

    DIR/latest.json                       {"step": N, "folder": "step-0000000N"}  (replaced atomically; a step written
                                          again goes to step-0000000N.1, ...: the current folder is never touched)
    DIR/step-0000000N/manifest.json       the session, spec, optimizer settings and, per span: blocks, step, the
                                          sha256 of both files, the signing node's peer id, public key, signature
    DIR/step-0000000N/blocks-S-E.slice.safetensors       the slice's canonical bytes (sharding/lora.py)
    DIR/step-0000000N/blocks-S-E.adamw.safetensors       AdamW's state (sharding/lora_train.py OptimizerState)
    DIR/step-0000000N/client-edges.safetensors   the edge layers the client trains, with their AdamW state
                                          (sharding/lora_edges.py EdgeState; only when the adapter trains some; the
                                          client's own, so unsigned, named in the manifest by its sha256)
    DIR/step-0000000N/adapter/            the whole adapter as a PEFT folder (PeftModel and nodes load it as it is)

A checkpoint is written into a temporary folder, renamed into place, and only then named by latest.json: a crash at
any point leaves the previous checkpoint whole and current, never a half-written one. Reading checks every file
against its hash and every signature against the node's key and peer id (CheckpointError otherwise), so a corrupted
or edited checkpoint is refused instead of trained on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from hivemind.utils.crypto import RSAPublicKey

from nesa_node.errors import AdapterError, CheckpointError
from nesa_node.protocol.channel import Frame
from nesa_node.protocol.identity import peer_id_of_public_key
from nesa_node.protocol.messages import TrainState
from nesa_node.protocol.tensors import bytes_from_proto
from nesa_node.sharding.lora import AdapterSlice, merge_slices
from nesa_node.sharding.lora_edges import EdgeState, check_edge_state
from nesa_node.sharding.lora_train import LoraSpec, OptimizerState, merge_optimizer_states, save_peft_adapter

FORMAT = "nesa-finetune-checkpoint/1"
_FOLDER = re.compile(r"step-\d{8}(\.\d+)?")


@dataclasses.dataclass(frozen=True)
class SpanState:
    """One node's slice and AdamW state at one step, with its signature (TrainState)."""

    slice: AdapterSlice
    optimizer: OptimizerState
    peer_id: str  # the node that produced and signed it
    public_key: bytes
    signature: bytes

    @property
    def step(self) -> int:
        return self.optimizer.step


def check_signature(message: TrainState, session_id: str, peer_id: str) -> None:
    """CheckpointError unless `message` is signed by the RSA key of `peer_id`."""
    if not message.public_key or not message.signature:
        raise CheckpointError(f"node {peer_id[:12]}… sent an unsigned training state")
    try:
        key = RSAPublicKey.from_bytes(message.public_key)
        valid = key.verify(message.signed_bytes(session_id), message.signature)
        signer = peer_id_of_public_key(key).to_base58()
    except Exception as exc:  # a malformed key: the node's fault
        raise CheckpointError(f"node {peer_id[:12]}… sent an unreadable key ({type(exc).__name__})") from None
    if not valid or signer != peer_id:
        raise CheckpointError(f"training state from {peer_id[:12]}… is not signed by that node")


def span_state_of(
    message: TrainState,
    answer: Frame,
    blocks: tuple[int, int],
    step: int,
    session_id: str,
    peer_id: str,
    *,
    max_bytes: int,
) -> SpanState:
    """The SpanState in a node's TrainState answer, once it is of `blocks` at `step`, both byte tensors hold at most
    `max_bytes` (client/train_link.py state_tensor_bytes) and match their hashes, and the node `peer_id` signed it
    for `session_id`; CheckpointError or BadRequestError otherwise."""
    if (message.start_block, message.end_block) != blocks:
        raise CheckpointError("answered another span's state")
    if message.step != step or len(answer.tensors) != 2:
        raise CheckpointError(f"answered the state of step {message.step} in {len(answer.tensors)} tensors, not {step}")
    check_signature(message, session_id, peer_id)
    piece = AdapterSlice.from_bytes(bytes_from_proto(answer.tensors[0], max_bytes=max_bytes), message.slice_sha256)
    adam = OptimizerState.from_bytes(bytes_from_proto(answer.tensors[1], max_bytes=max_bytes), message.optimizer_sha256)
    if (piece.start, piece.end) != (adam.start, adam.end) or adam.step not in (0, message.step):
        raise CheckpointError("the optimizer state does not match the slice")
    if not adam.tensors:  # before any update AdamW holds nothing; the state is still of this step
        adam = OptimizerState(adam.start, adam.end, message.step, adam.tensors)
    return SpanState(piece, adam, peer_id, message.public_key, message.signature)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A whole adapter and its AdamW state at `step` (from every span's SpanState)."""

    step: int
    session_id: str
    spec: LoraSpec
    optimizer: dict  # OptimizerSettings fields
    adapter: AdapterSlice
    adam: OptimizerState
    spans: tuple[SpanState, ...] = ()
    edges: EdgeState | None = None  # the client's trained edge layers (spec.edges), at the same step


EDGES_FILE = "client-edges.safetensors"


def assemble(
    step: int,
    session_id: str,
    spec: LoraSpec,
    optimizer: dict,
    spans: list[SpanState],
    edges: EdgeState | None = None,
) -> Checkpoint:
    if any(span.step != step for span in spans):
        raise CheckpointError(f"span states of steps {sorted({span.step for span in spans})}, not all {step}")
    expected_edges = (step, set(spec.edges)) if spec.edges else None
    if expected_edges != ((edges.step, set(edges.weights)) if edges is not None else None):
        raise CheckpointError(
            f"the client's edge state does not match an adapter training {list(spec.edges)} at {step}"
        )
    try:
        adapter = merge_slices([span.slice for span in spans])
        adam = merge_optimizer_states([span.optimizer for span in spans])
    except AdapterError as exc:
        raise CheckpointError(f"span states do not make one adapter: {exc.message}") from None
    return Checkpoint(step, session_id, spec, dict(optimizer), adapter, adam, tuple(spans), edges)


def check_checkpoint_edges(checkpoint: Checkpoint, model_config, where: str) -> None:
    """CheckpointError unless the checkpoint's edge state (when its spec trains edges) is finite and of this model."""
    if checkpoint.edges is None:
        return
    try:
        check_edge_state(checkpoint.edges, checkpoint.spec.edges, model_config, where)
    except AdapterError as exc:
        raise CheckpointError(exc.message) from None


def write_checkpoint(folder: str | Path, checkpoint: Checkpoint) -> Path:
    """Write `checkpoint` (module docstring) and make it the latest; returns its subfolder. Every other step folder but
    the previous latest is removed: two checkpoints are kept."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    previous = _latest_folder(root)
    name = f"step-{checkpoint.step:08d}"
    for again in range(1, 1 << 16):  # the current checkpoint's folder is never touched: a rewrite gets a new name
        if name != previous:
            break
        name = f"step-{checkpoint.step:08d}.{again}"
    for partial in root.glob(".step-*.partial"):  # what a crash mid-write left
        shutil.rmtree(partial, ignore_errors=True)
    staging = root / f".{name}.partial"
    staging.mkdir()
    spans = []
    for span in checkpoint.spans:
        stem = f"blocks-{span.slice.start}-{span.slice.end}"
        slice_bytes, adam_bytes = span.slice.to_bytes(), span.optimizer.to_bytes()
        _write(staging / f"{stem}.slice.safetensors", slice_bytes)
        _write(staging / f"{stem}.adamw.safetensors", adam_bytes)
        spans.append(
            {
                "start": span.slice.start,
                "end": span.slice.end,
                "step": span.step,
                "slice_sha256": span.slice.sha256,
                "optimizer_sha256": hashlib.sha256(adam_bytes).hexdigest(),
                "signer": span.peer_id,
                "public_key": span.public_key.hex(),
                "signature": span.signature.hex(),
            }
        )
    manifest = {
        "format": FORMAT,
        "step": checkpoint.step,
        "session_id": checkpoint.session_id,
        "spec": dataclasses.asdict(checkpoint.spec),
        "optimizer": checkpoint.optimizer,
        "spans": spans,
    }
    edges = checkpoint.edges
    if edges is not None:
        edge_bytes = edges.to_bytes()
        _write(staging / EDGES_FILE, edge_bytes)
        manifest["edges_sha256"] = hashlib.sha256(edge_bytes).hexdigest()
    _write(staging / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
    save_peft_adapter(  # servable as it is
        checkpoint.adapter, checkpoint.spec, staging / "adapter", edges=edges.weights if edges is not None else None
    )
    final = root / name
    shutil.rmtree(final, ignore_errors=True)  # not the current one (above): what an earlier run or crash left
    os.replace(staging, final)
    _sync_folder(root)  # the rename is on disk before latest.json names it
    _write(root / "latest.json", json.dumps({"step": checkpoint.step, "folder": name}).encode())
    _sync_folder(root)
    for old in root.glob("step-*"):  # this one and the one before it
        if old.is_dir() and old.name not in (name, previous):
            shutil.rmtree(old, ignore_errors=True)
    return final


def _sync_folder(path: Path) -> None:
    """fsync a folder, so the renames in it survive a power cut (where the OS allows opening a folder)."""
    with contextlib.suppress(OSError):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _latest_folder(root: Path) -> str | None:
    """The folder name latest.json points at, when it is one this module writes."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, RecursionError):
        name = json.loads((root / "latest.json").read_text())["folder"]
        if isinstance(name, str) and _FOLDER.fullmatch(name):
            return name
    return None


def _write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename (never a half-written file under that name)."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def latest_step(folder: str | Path) -> int | None:
    """The step of the newest checkpoint in `folder`, None when it holds none."""
    pointer = Path(folder) / "latest.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return int(json.loads(pointer.read_text())["step"])
    return None


def read_checkpoint(folder: str | Path, num_blocks: int) -> Checkpoint:
    """The newest checkpoint in `folder`, every file checked against its hash and every signature against its node;
    CheckpointError when there is none or anything does not check out."""
    root = Path(folder)
    try:
        name = _latest_folder(root)
        if name is None:
            raise ValueError("latest.json is missing or does not name a checkpoint folder")
        where = root / name
        manifest = json.loads((where / "manifest.json").read_text())
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"no readable checkpoint in {root} ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where / 'manifest.json'} is not a {FORMAT} manifest")
    try:
        step, session_id = int(manifest["step"]), str(manifest["session_id"])
        described = manifest["spec"]
        spec = LoraSpec(
            **{**described, "targets": tuple(described["targets"]), "edges": tuple(described.get("edges", ()))}
        )
        spans = [_read_span(where, entry, session_id) for entry in manifest["spans"]]
        edges = None
        if spec.edges:
            edges = EdgeState.from_bytes((where / EDGES_FILE).read_bytes(), str(manifest["edges_sha256"]))
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AdapterError) as exc:
        raise CheckpointError(f"checkpoint {where} is damaged ({type(exc).__name__}: {exc})") from None
    checkpoint = assemble(step, session_id, spec, manifest.get("optimizer", {}), spans, edges)
    if (checkpoint.adapter.start, checkpoint.adapter.end) != (0, num_blocks):
        raise CheckpointError(f"checkpoint {where} covers blocks {checkpoint.adapter.start}:{checkpoint.adapter.end}")
    return checkpoint


def _read_span(where: Path, entry: dict, session_id: str) -> SpanState:
    stem = f"blocks-{int(entry['start'])}-{int(entry['end'])}"
    piece = AdapterSlice.from_bytes((where / f"{stem}.slice.safetensors").read_bytes(), entry["slice_sha256"])
    adam = OptimizerState.from_bytes((where / f"{stem}.adamw.safetensors").read_bytes(), entry["optimizer_sha256"])
    message = TrainState(
        start_block=piece.start,
        end_block=piece.end,
        step=int(entry["step"]),
        slice_sha256=piece.sha256,
        optimizer_sha256=entry["optimizer_sha256"],
        public_key=bytes.fromhex(entry["public_key"]),
        signature=bytes.fromhex(entry["signature"]),
    )
    check_signature(message, session_id, str(entry["signer"]))
    if adam.step != message.step or (adam.start, adam.end) != (piece.start, piece.end):
        raise CheckpointError(f"{stem}: the optimizer state is of another step or span than its slice")
    return SpanState(piece, adam, str(entry["signer"]), message.public_key, message.signature)


__all__ = [
    "check_checkpoint_edges",
    "Checkpoint",
    "SpanState",
    "assemble",
    "check_signature",
    "latest_step",
    "read_checkpoint",
    "span_state_of",
    "write_checkpoint",
]
