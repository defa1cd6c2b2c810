"""Adapter identity across nodes (sharding/lora_identity.py): manifests of per-block hashes, and slices rebuilt from
per-block blobs a peer sends, on adapters peft itself made for the tiny seeded Llama (4 blocks)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from nesa_node.errors import AdapterError, AdapterHashError, error_from_code
from nesa_node.sharding.blocks import load_config
from nesa_node.sharding.lora import (
    AdapterManifest,
    AdapterSlice,
    LoraFactors,
    adapter_manifest,
    check_slice,
    load_adapter_slice,
    merge_slices,
    slice_blobs,
    slice_from_blocks,
)
from nesa_node.sharding.lora_identity import MAX_BLOCKS, MAX_MANIFEST_BYTES

BLOCKS = 4  # the tiny models' blocks
SPANS = [(0, 1), (1, 3), (3, 4)]  # three nodes
ADAPTERS = {
    # blocks 0 and 3 untargeted: their hashes are those of empty slices
    "some_layers": dict(r=2, lora_alpha=2, target_modules=["gate_proj", "k_proj"], layers_to_transform=[1, 2]),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
}
GARBAGE = [b"", b"not json", b"\xff\xfe", b"[]", b"{}", b"null"]


@pytest.fixture(scope="module")
def folders(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """Each ADAPTERS entry saved by peft with random factors (init_lora_weights=False, so B is not zero)."""
    root, made = tmp_path_factory.mktemp("identity"), {}
    for seed, (name, lora) in enumerate(sorted(ADAPTERS.items())):
        base = AutoModelForCausalLM.from_pretrained(tiny_llama)
        with torch.random.fork_rng():
            torch.manual_seed(100 + seed)
            model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora))
        model.save_pretrained(root / name)
        made[name] = root / name
    return made


@pytest.fixture(scope="module")
def config(tiny_llama):
    return load_config(tiny_llama)


@pytest.fixture(scope="module")
def whole(folders, config) -> AdapterSlice:
    return load_adapter_slice(folders["some_layers"], config)


@pytest.fixture(scope="module")
def manifest(whole) -> AdapterManifest:
    return adapter_manifest(whole, BLOCKS)


# ---- the manifest and its id ----------------------------------------------------------------------------------------


def test_the_manifest_lists_each_blocks_own_hash(whole, manifest):
    assert manifest.num_blocks == BLOCKS and manifest.rank == 2
    for block in range(BLOCKS):
        own = whole.narrow(block, block + 1).to_bytes()
        assert manifest.block_hashes[block] == hashlib.sha256(own).hexdigest()
    # blocks 0 and 3 carry no factors, yet their empty slices still name their block: the hashes differ
    assert not whole.narrow(0, 1).factors and not whole.narrow(3, 4).factors
    assert len(set(manifest.block_hashes)) == BLOCKS
    assert manifest.adapter_id == hashlib.sha256(manifest.to_bytes()).hexdigest()
    assert whole.narrow(1, 3).block_hashes() == manifest.block_hashes[1:3]


def test_the_manifest_of_per_span_slices_equals_the_one_of_the_whole_folder(folders, config):
    """Each node loads only its span; the per-block hashes they list together are the whole adapter's, in any
    order of loading, and so is the manifest of their merge."""
    for folder in folders.values():
        expected = adapter_manifest(load_adapter_slice(folder, config), BLOCKS)
        for order in (SPANS, list(reversed(SPANS)), [SPANS[1], SPANS[0], SPANS[2]]):
            pieces = {span: load_adapter_slice(folder, config, *span) for span in order}
            ordered = [pieces[span] for span in SPANS]
            assembled = AdapterManifest(
                tuple(h for piece in ordered for h in piece.block_hashes()), max(p.rank for p in ordered)
            )
            assert assembled == expected and assembled.adapter_id == expected.adapter_id
            assert adapter_manifest(merge_slices(pieces.values()), BLOCKS).adapter_id == expected.adapter_id
            for piece in ordered:
                check_slice(expected, piece)


def test_the_adapter_id_is_the_same_in_another_process(folders, tiny_llama, manifest):
    code = (
        "from nesa_node.sharding.blocks import load_config\n"
        "from nesa_node.sharding.lora_identity import adapter_manifest\n"  # this module first: either import order
        "from nesa_node.sharding.lora import load_adapter_slice\n"
        f"config = load_config({tiny_llama!r})\n"
        f"print(adapter_manifest(load_adapter_slice({str(folders['some_layers'])!r}, config), 4).adapter_id)"
    )
    environment = {**os.environ, "PYTHONHASHSEED": "4242"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == manifest.adapter_id


def test_different_adapters_have_different_ids(folders, config, manifest):
    other = adapter_manifest(load_adapter_slice(folders["qv"], config), BLOCKS)
    assert other.adapter_id != manifest.adapter_id and other.rank == 4
    assert not set(other.block_hashes) & set(manifest.block_hashes)


def test_a_manifest_round_trips_through_its_bytes(manifest):
    data = manifest.to_bytes()
    assert json.loads(data) == {
        "format": "nesa-lora-manifest/1",
        "block_hashes": list(manifest.block_hashes),
        "rank": 2,
    }
    assert AdapterManifest.from_bytes(data, manifest.adapter_id) == manifest
    assert AdapterManifest.from_bytes(data, manifest.adapter_id.upper()) == manifest


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_changing_any_byte_of_a_manifest_is_refused_by_hash(manifest, data):
    good = manifest.to_bytes()
    position = data.draw(st.integers(0, len(good) - 1))
    tampered = bytearray(good)
    tampered[position] ^= data.draw(st.integers(1, 255))
    with pytest.raises(AdapterHashError):
        AdapterManifest.from_bytes(bytes(tampered), manifest.adapter_id)


def _malformed(manifest: AdapterManifest) -> list[bytes]:
    hashes = list(manifest.block_hashes)
    body = {"format": "nesa-lora-manifest/1", "block_hashes": hashes, "rank": 2}

    def compact(value) -> bytes:
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()

    return [
        *GARBAGE,
        json.dumps(body, sort_keys=True).encode(),  # the same content with spaces: not canonical
        json.dumps(body, separators=(",", ":")).encode(),  # keys not sorted
        compact({**body, "format": "nesa-lora-manifest/2"}),
        compact({**body, "extra": 1}),
        compact({**body, "rank": 0}),  # changes no block
        compact({**body, "rank": True}),
        compact({**body, "rank": 2.0}),
        compact({**body, "rank": -1}),
        compact({**body, "rank": 1 << 17}),
        compact({**body, "block_hashes": []}),
        compact({**body, "block_hashes": "0" * 64}),
        compact({**body, "block_hashes": [hashes[0].upper(), *hashes[1:]]}),
        compact({**body, "block_hashes": [hashes[0][:63], *hashes[1:]]}),
        compact({**body, "block_hashes": [1, *hashes[1:]]}),
        compact({**body, "block_hashes": ["0" * 64] * (MAX_BLOCKS + 1)}),
    ]


def test_matching_bytes_must_still_be_a_canonical_bounded_manifest(manifest):
    for bad in _malformed(manifest):
        with pytest.raises(AdapterError) as caught:
            AdapterManifest.from_bytes(bad, hashlib.sha256(bad).hexdigest())
        assert type(caught.value) is AdapterError, bad[:80]
    huge = b" " * (MAX_MANIFEST_BYTES + 1)
    with pytest.raises(AdapterError, match="longer than"):  # refused before it is hashed
        AdapterManifest.from_bytes(huge, "0" * 64)
    largest = AdapterManifest(("a" * 64,) * MAX_BLOCKS, 1 << 16)
    assert len(largest.to_bytes()) <= MAX_MANIFEST_BYTES
    assert AdapterManifest.from_bytes(largest.to_bytes(), largest.adapter_id) == largest


def test_manifests_are_checked_when_built(whole):
    with pytest.raises(AdapterError, match="0:4"):
        adapter_manifest(whole.narrow(0, 3), BLOCKS)
    with pytest.raises(AdapterError, match="0:5"):
        adapter_manifest(whole, 5)
    empty = AdapterSlice(0, BLOCKS, {})
    with pytest.raises(AdapterError, match="changes none"):
        adapter_manifest(empty, BLOCKS)
    with pytest.raises(AdapterError, match="in a tuple"):
        AdapterManifest(list(whole.block_hashes()), 2)


# ---- slices checked against a manifest ------------------------------------------------------------------------------


@pytest.mark.parametrize("span", SPANS + [(0, 4), (2, 3)])
def test_blobs_round_trip_to_the_same_slice(folders, config, manifest, span):
    piece = load_adapter_slice(folders["some_layers"], config, *span)
    blobs = slice_blobs(piece)
    assert len(blobs) == span[1] - span[0]
    assert [hashlib.sha256(blob).hexdigest() for blob in blobs] == list(manifest.block_hashes[span[0] : span[1]])
    rebuilt = slice_from_blocks(manifest, *span, blobs)
    assert rebuilt.sha256 == piece.sha256 and rebuilt.to_bytes() == piece.to_bytes()
    assert (rebuilt.start, rebuilt.end, rebuilt.rank) == (piece.start, piece.end, piece.rank)
    check_slice(manifest, rebuilt)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_changing_any_byte_of_any_blob_is_refused_by_hash(whole, manifest, data):
    start = data.draw(st.integers(0, BLOCKS - 1))
    end = data.draw(st.integers(start + 1, BLOCKS))
    blobs = slice_blobs(whole.narrow(start, end))
    which = data.draw(st.integers(0, len(blobs) - 1))
    position = data.draw(st.integers(0, len(blobs[which]) - 1))
    tampered = bytearray(blobs[which])
    tampered[position] ^= data.draw(st.integers(1, 255))
    blobs[which] = bytes(tampered)
    with pytest.raises(AdapterHashError) as caught:
        slice_from_blocks(manifest, start, end, blobs)
    assert f"not the {manifest.block_hashes[start + which][:16]}" in caught.value.message
    rebuilt = error_from_code(caught.value.code, caught.value.message)
    assert type(rebuilt) is AdapterHashError and rebuilt.code == "adapter_hash"


def test_a_slice_of_another_adapter_is_refused(folders, config, manifest):
    other = load_adapter_slice(folders["qv"], config, 1, 3)
    with pytest.raises(AdapterHashError, match="block 1"):
        check_slice(manifest, other)
    with pytest.raises(AdapterHashError):
        slice_from_blocks(manifest, 1, 3, slice_blobs(other))
    # one block of the right adapter and one of the wrong: the wrong one is found
    mine = load_adapter_slice(folders["some_layers"], config, 1, 3)
    mixed = [slice_blobs(mine)[0], slice_blobs(other)[1]]
    with pytest.raises(AdapterHashError, match="not the"):
        slice_from_blocks(manifest, 1, 3, mixed)
    # the right bytes in the wrong place (block 2's blob offered for block 1)
    with pytest.raises(AdapterHashError):
        slice_from_blocks(manifest, 1, 2, slice_blobs(mine)[1:])


def test_a_changed_factor_is_refused_even_when_built_in_process(whole, manifest):
    factors = dict(whole.factors)
    key = next(iter(factors))
    changed = factors[key].lora_a.clone()
    changed[0, 0] += 1e-3
    factors[key] = LoraFactors(changed, factors[key].lora_b, factors[key].scale)
    with pytest.raises(AdapterHashError, match=f"block {key[0]}"):
        check_slice(manifest, AdapterSlice(0, BLOCKS, factors))


def test_ranges_and_counts_outside_the_manifest_are_refused(whole, manifest):
    blobs = slice_blobs(whole)
    with pytest.raises(AdapterError, match="outside"):
        slice_from_blocks(manifest, 2, 5, blobs[2:] + [blobs[0]])
    with pytest.raises(AdapterError, match="need 2"):
        slice_from_blocks(manifest, 1, 3, blobs[1:2])
    with pytest.raises(AdapterError):
        slice_from_blocks(manifest, 2, 2, [])
    beyond = AdapterSlice(2, 6, {})
    with pytest.raises(AdapterHashError, match="another model"):
        check_slice(manifest, beyond)


def test_a_manifest_that_understates_the_rank_is_refused(whole, manifest):
    understated = AdapterManifest(manifest.block_hashes, 1)
    with pytest.raises(AdapterError, match="above its manifest's rank"):
        check_slice(understated, whole)
    with pytest.raises(AdapterError, match="above its manifest's rank"):
        slice_from_blocks(understated, 0, BLOCKS, slice_blobs(whole))


@pytest.mark.parametrize("first", ["lora_rows", "lora_identity"])
def test_each_part_of_lora_imports_first(first):
    """lora.py re-exports lora_rows and lora_identity, which import lora.py only inside functions: no import cycle
    whichever module a caller names first."""
    code = (
        f"import nesa_node.sharding.{first}\n"
        "from nesa_node.sharding.lora import adapters_for_rows, slice_from_blocks, AdapterSlice\n"
        "from nesa_node.sharding.lora_rows import enable_lora\n"
        "from nesa_node.sharding.lora_identity import AdapterManifest\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_deeply_nested_manifest_bytes_are_a_typed_refusal():
    """Bytes that hash to the id asked for (anyone can compute it) but nest deeper than the JSON parser goes."""
    data = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(AdapterError, match="not an adapter manifest"):
        AdapterManifest.from_bytes(data, hashlib.sha256(data).hexdigest())
