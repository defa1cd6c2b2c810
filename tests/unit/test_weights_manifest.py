"""Weight commitments (sharding/weights_manifest.py): the manifest of a model's block digests gives the source hash
every span of that checkpoint announces, a changed tensor changes exactly the spans that hold its block, quantized
spans keep their source hash, and a manifest file that is anything else is a typed error naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from nesa_node.errors import WeightsManifestError
from nesa_node.sharding.blocks import SpanSpec, load_block_span, weights_manifest_of
from nesa_node.sharding.weights_manifest import FORMAT, WeightsManifest, block_digest, span_hash

SPANS = [(start, end) for start in range(4) for end in range(start + 1, 5)]


@pytest.fixture(scope="module")
def manifest(tiny_llama) -> WeightsManifest:
    return weights_manifest_of(tiny_llama)


def test_every_span_announces_the_hash_the_manifest_gives(tiny_llama, manifest):
    assert manifest.num_blocks == 4 and len(set(manifest.blocks)) == 4
    for start, end in SPANS:
        span = load_block_span(tiny_llama, SpanSpec(start, end))
        assert span.source_hash == manifest.span_hash(start, end) == span.weights_hash, (start, end)
    assert len({manifest.span_hash(start, end) for start, end in SPANS}) == len(SPANS)


def test_a_changed_tensor_changes_exactly_the_spans_that_hold_its_block(tiny_llama, manifest, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(tiny_llama, changed)
    weights = load_file(changed / "model.safetensors")
    name = "model.layers.2.self_attn.q_proj.weight"
    weights[name] = weights[name] * 1.01
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    other = weights_manifest_of(changed)
    assert [a == b for a, b in zip(manifest.blocks, other.blocks, strict=True)] == [True, True, False, True]
    for start, end in SPANS:
        assert (manifest.span_hash(start, end) == other.span_hash(start, end)) == (not start <= 2 < end)
    assert load_block_span(changed, SpanSpec(2, 4)).source_hash == other.span_hash(2, 4)


def test_a_quantized_span_keeps_its_source_hash_and_announces_another_weights_hash(tiny_llama, manifest):
    pytest.importorskip("bitsandbytes")
    span = load_block_span(tiny_llama, SpanSpec(0, 2, quant="int8"))
    assert span.source_hash == manifest.span_hash(0, 2)
    assert span.weights_hash != span.source_hash and len(span.weights_hash) == 16


def test_block_digests_take_tensors_in_name_order_and_see_every_byte():
    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)
    assert block_digest([("x", a), ("y", b)]) == block_digest([("y", b), ("x", a)])
    assert block_digest([("x", a), ("y", b)]) != block_digest([("x", a), ("z", b)])
    flipped = a.clone()
    flipped.view(torch.uint8)[0] ^= 1
    assert block_digest([("x", a)]) != block_digest([("x", flipped)])
    assert block_digest([("x", a.t())]) == block_digest([("x", a.t().contiguous())])
    assert span_hash(["0" * 64, "1" * 64]) != span_hash(["1" * 64, "0" * 64])


def test_the_manifest_file_round_trips_and_a_bad_one_is_refused_naming_it(manifest, tmp_path):
    path = tmp_path / "weights-manifest.json"
    manifest.write(path)
    assert WeightsManifest.read(path) == manifest
    bad = {
        "not json": "{",
        "other format": json.dumps({"format": "x", "num_blocks": 1, "blocks": ["0" * 64]}),
        "count": json.dumps({"format": FORMAT, "num_blocks": 2, "blocks": ["0" * 64]}),
        "digest": json.dumps({"format": FORMAT, "num_blocks": 1, "blocks": ["XYZ"]}),
        "empty": json.dumps({"format": FORMAT, "num_blocks": 0, "blocks": []}),
    }
    for what, text in bad.items():
        path.write_text(text)
        with pytest.raises(WeightsManifestError, match=str(path)):
            WeightsManifest.read(path)
            pytest.fail(f"the {what} manifest was read")
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(WeightsManifestError, match="UTF-8"):
        WeightsManifest.read(path)
    with pytest.raises(WeightsManifestError, match="No such file"):
        WeightsManifest.read(tmp_path / "absent.json")
    with pytest.raises(WeightsManifestError, match="outside"):
        manifest.span_hash(2, 5)


@settings(max_examples=200)
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda data: data.decode("latin-1")))
def test_any_text_is_a_manifest_or_a_typed_refusal(text):
    try:
        WeightsManifest.from_json(text)
    except WeightsManifestError:
        pass
