"""LoRA adapter slices (sharding/lora.py) against peft's own PeftModel on the tiny seeded models.

Adapters are random (`init_lora_weights=False`, so B is not zero) and made by peft itself with `get_peft_model` and
`save_pretrained`. A chain of spans (blocks 0:1, 1:3, 3:4), each with its own slice, must give the logits
`PeftModel.from_pretrained(base, folder)` gives, prefill and cached one-token steps alike, to the tolerance the base
chain already meets against the whole model (tests/unit/test_blocks.py, float32).
"""

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

from nesa_node.errors import (
    AdapterError,
    AdapterHashError,
    RequestError,
    UnsupportedAdapterError,
    error_from_code,
)
from nesa_node.sharding.blocks import SpanSpec, load_block_span, load_config
from nesa_node.sharding.client_edges import load_client_edges
from nesa_node.sharding.lora import (
    AdapterSlice,
    adapters_for_rows,
    disable_lora,
    enable_lora,
    load_adapter_slice,
    merge_slices,
    read_adapter_config,
)
from nesa_node.sharding.lora_train import spec_of_folder
from tests.support.adapters import save_random_adapter
from tests.support.models import ARCHES

SPLITS = [(0, 1), (1, 3), (3, 4)]  # three nodes over the 4 blocks of the tiny models
STEPS = [(0, 6), (6, 7), (7, 8), (8, 9)]  # a 6-token prefill, then one-token steps over each span's cache
TOLERANCE = dict(atol=1e-5, rtol=1e-5)  # float32; the base chain meets atol 1e-5 against the whole model
PROJECTION_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# different ranks, targets, alphas and scalings; each seeds its own random factors
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all_rslora_patterns": dict(
        r=8,
        lora_alpha=4,
        use_rslora=True,
        target_modules=PROJECTION_NAMES,
        rank_pattern={"down_proj": 2, "layers.1.self_attn.q_proj": 3},
        alpha_pattern={"o_proj": 16},
    ),
    "some_layers": dict(r=2, lora_alpha=2, target_modules=["gate_proj", "k_proj"], layers_to_transform=[1, 2]),
    "regex": dict(r=6, lora_alpha=12, target_modules=r"model\.layers\.[03]\.(self_attn\.o_proj|mlp\.up_proj)"),
}


@pytest.fixture(scope="module")
def adapter(tiny_models, tmp_path_factory):
    """adapter(arch, name) -> folder of the ADAPTERS[name] adapter for that tiny model, made once."""
    root, made = tmp_path_factory.mktemp("adapters"), {}

    def make(arch: str, name: str) -> Path:
        if (arch, name) not in made:
            seed = sorted(ADAPTERS).index(name) + 10
            made[arch, name] = save_random_adapter(tiny_models[arch], root / f"{arch}-{name}", seed, **ADAPTERS[name])
        return made[arch, name]

    return make


@pytest.fixture(scope="module")
def whole(tiny_llama, adapter) -> AdapterSlice:
    """All 4 blocks of the "some_layers" adapter of the tiny Llama."""
    return load_adapter_slice(adapter("llama", "some_layers"), load_config(tiny_llama))


def _reference_logits(model_path: str, folder: Path | None, input_ids: torch.Tensor) -> torch.Tensor:
    base = AutoModelForCausalLM.from_pretrained(model_path)
    model = base if folder is None else peft.PeftModel.from_pretrained(base, folder)
    with torch.inference_mode():
        return model(input_ids).logits


def _chain(model_path: str):
    edges = load_client_edges(model_path)
    spans = [load_block_span(model_path, SpanSpec(start, end)) for start, end in SPLITS]
    return edges, spans


def _chain_logits(edges, spans, input_ids: torch.Tensor, rows: list[Path | None]) -> torch.Tensor:
    """Logits of a chain of spans, row i with the slices of adapter rows[i] (None: the base model)."""
    slices = {}
    for folder in {row for row in rows if row is not None}:
        for span in spans:
            slices[folder, span.start] = load_adapter_slice(folder, span.config, span.start, span.end)
    caches = [span.new_cache() for span in spans]
    pieces = []
    with torch.inference_mode():
        for first, last in STEPS:
            hidden = edges.embed_tokens(input_ids[:, first:last])  # (rows, seq, hidden)
            for span, cache in zip(spans, caches, strict=True):
                span_rows = [None if row is None else slices[row, span.start] for row in rows]
                with adapters_for_rows(span, span_rows):
                    hidden = span(hidden, cache, first)
            pieces.append(edges.lm_head(edges.norm(hidden)))
    return torch.cat(pieces, dim=1)


def _input_ids(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 1000, (rows, STEPS[-1][1]), generator=torch.Generator().manual_seed(seed))


# ---- the chain with slices equals PeftModel -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_spans_with_their_slices_equal_peft_model(tiny_models, adapter, arch, name):
    folder = adapter(arch, name)
    input_ids = _input_ids(2)
    expected = _reference_logits(tiny_models[arch], folder, input_ids)
    base = _reference_logits(tiny_models[arch], None, input_ids)
    assert (expected - base).abs().max() > 1e-2  # the adapter changes the output: the comparison below can fail
    edges, spans = _chain(tiny_models[arch])
    got = _chain_logits(edges, spans, input_ids, [folder, folder])
    torch.testing.assert_close(got, expected, **TOLERANCE)


@pytest.mark.parametrize("arch", ARCHES)
def test_a_mixed_batch_gives_each_row_its_own_reference(tiny_models, adapter, arch):
    """Row 0 with adapter X, row 1 with none, row 2 with adapter Y, in one batch through the same spans."""
    x, y = adapter(arch, "all_rslora_patterns"), adapter(arch, "qv")
    input_ids = _input_ids(3, seed=1)
    edges, spans = _chain(tiny_models[arch])
    got = _chain_logits(edges, spans, input_ids, [x, None, y])
    torch.testing.assert_close(got[0], _reference_logits(tiny_models[arch], x, input_ids[:1])[0], **TOLERANCE)
    torch.testing.assert_close(got[1], _reference_logits(tiny_models[arch], None, input_ids[1:2])[0], **TOLERANCE)
    torch.testing.assert_close(got[2], _reference_logits(tiny_models[arch], y, input_ids[2:])[0], **TOLERANCE)
    # the row without an adapter is bit for bit what the same batch gives with no adapter at all
    plain = _chain_logits(edges, spans, input_ids, [None, None, None])
    assert torch.equal(got[1], plain[1])
    assert not torch.equal(got[0], plain[0]) and not torch.equal(got[2], plain[2])


@pytest.mark.parametrize("attention", ["per_session", "padded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # full attention: spans that batch decode steps
def test_a_decode_batch_mixes_sessions_with_different_adapters(tiny_models, adapter, arch, attention):
    """Three sessions (adapter X, 1 row; no adapter, 2 rows; adapter Y, 1 row) prefill alone with their own
    adapter, then run their one-token steps together in `decode_batch`, each at its own position; attention a
    session at a time (the CPU's pass) or over the padded caches (a GPU's)."""
    x, y = adapter(arch, "some_layers"), adapter(arch, "all_rslora_patterns")
    sessions = [(x, _input_ids(1, seed=2), 5), (None, _input_ids(2, seed=3), 6), (y, _input_ids(1, seed=4), 4)]
    edges, spans = _chain(tiny_models[arch])
    assert all(span.batches_decode and span._rotate is not None for span in spans)
    if attention == "padded":
        for span in spans:
            span._rotate = None
    slices = {(f, s.start): load_adapter_slice(f, s.config, s.start, s.end) for f in (x, y) for s in spans}
    caches = [[span.new_cache() for span in spans] for _ in sessions]
    outputs: list[list[torch.Tensor]] = [[] for _ in sessions]
    with torch.inference_mode():
        for index, (folder, input_ids, prompt) in enumerate(sessions):
            hidden = edges.embed_tokens(input_ids[:, :prompt])
            for span, cache in zip(spans, caches[index], strict=True):
                rows = [None if folder is None else slices[folder, span.start]] * input_ids.shape[0]
                with adapters_for_rows(span, rows):
                    hidden = span(hidden, cache, 0)
            outputs[index].append(edges.lm_head(edges.norm(hidden)))
        for step in range(3):
            hiddens = [
                edges.embed_tokens(input_ids[:, prompt + step : prompt + step + 1]) for _, input_ids, prompt in sessions
            ]
            for number, span in enumerate(spans):
                rows = [
                    None if folder is None else slices[folder, span.start]
                    for folder, input_ids, _ in sessions
                    for _ in range(input_ids.shape[0])
                ]
                steps = [
                    (hidden, caches[index][number], prompt + step)
                    for index, (hidden, (_, _, prompt)) in enumerate(zip(hiddens, sessions, strict=True))
                ]
                with adapters_for_rows(span, rows):
                    hiddens = span.decode_batch(steps, (span.start, span.end))
            for index, hidden in enumerate(hiddens):
                outputs[index].append(edges.lm_head(edges.norm(hidden)))
    for index, (folder, input_ids, prompt) in enumerate(sessions):
        expected = _reference_logits(tiny_models[arch], folder, input_ids[:, : prompt + 3])
        torch.testing.assert_close(torch.cat(outputs[index], dim=1), expected, **TOLERANCE)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_pass_of_prompts_mixes_sessions_with_different_adapters(tiny_models, adapter, arch):
    """The same three sessions' prompts in one `run_batch` pass (`nesa-node run --batch-prompts`): the rows the span
    runs are the prompts' tokens one after the other, each token with its session's adapter."""
    x, y = adapter(arch, "some_layers"), adapter(arch, "all_rslora_patterns")
    sessions = [(x, _input_ids(1, seed=2), 5), (None, _input_ids(2, seed=3), 6), (y, _input_ids(1, seed=4), 4)]
    edges, spans = _chain(tiny_models[arch])
    assert all(span.batches_prompts for span in spans)
    slices = {(f, s.start): load_adapter_slice(f, s.config, s.start, s.end) for f in (x, y) for s in spans}
    caches = [[span.new_cache() for span in spans] for _ in sessions]
    with torch.inference_mode():
        hiddens = [edges.embed_tokens(input_ids[:, :prompt]) for _, input_ids, prompt in sessions]
        for number, span in enumerate(spans):
            rows = [
                None if folder is None else slices[folder, span.start]
                for folder, input_ids, prompt in sessions
                for _ in range(input_ids.shape[0] * prompt)
            ]
            steps = [(hidden, caches[index][number], 0) for index, hidden in enumerate(hiddens)]
            with adapters_for_rows(span, rows):
                hiddens = span.run_batch(steps, (span.start, span.end))
        outputs = [edges.lm_head(edges.norm(hidden)) for hidden in hiddens]
    for output, (folder, input_ids, prompt) in zip(outputs, sessions, strict=True):
        expected = _reference_logits(tiny_models[arch], folder, input_ids[:, :prompt])
        torch.testing.assert_close(output, expected, **TOLERANCE)


def test_hooks_without_adapters_leave_the_span_bit_identical(tiny_llama, adapter):
    plain = load_block_span(tiny_llama, SpanSpec(0, 4))
    hooked = load_block_span(tiny_llama, SpanSpec(0, 4))
    enable_lora(hooked)
    enable_lora(hooked)  # idempotent: one hook per projection
    projections = [m for m in hooked.modules() if isinstance(m, torch.nn.Linear)]
    assert len(projections) == 4 * 7 and all(len(m._forward_hooks) == 1 for m in projections)
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(5))  # (batch, seq, hidden)
    with torch.inference_mode():
        expected = plain(hidden)
        assert torch.equal(hooked(hidden), expected)
        with adapters_for_rows(hooked, [None, None]):
            assert torch.equal(hooked(hidden), expected)
        one = load_adapter_slice(adapter("llama", "qv"), hooked.config)
        with adapters_for_rows(hooked, [one, one]):
            assert not torch.equal(hooked(hidden), expected)
        assert torch.equal(hooked(hidden), expected)  # the setting ends with the block
    disable_lora(hooked)
    assert not any(m._forward_hooks for m in hooked.modules())


def test_rows_and_blocks_must_match_what_the_span_runs(tiny_llama, adapter):
    span = load_block_span(tiny_llama, SpanSpec(0, 4))
    part = load_adapter_slice(adapter("llama", "qv"), span.config, 1, 3)
    hidden = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(6))
    with pytest.raises(AdapterError, match="not the 0:4"):
        with adapters_for_rows(span, [part, None]):
            pass
    with torch.inference_mode(), adapters_for_rows(span, [part, None], blocks=(1, 3)):
        span(hidden, blocks=(1, 3))  # a slice that covers the blocks the step runs is enough
        with pytest.raises(ValueError, match="given 2 rows but the span runs 1"):
            span(hidden[:1], blocks=(1, 3))


def test_an_adapter_served_in_inference_mode_still_runs_under_autograd(tiny_llama, adapter):
    """A training pass (autograd on) may follow inference steps with the same slice: its float32 copies, made on the
    first step, are ordinary tensors, and gradients reach the hidden states through the update."""
    from nesa_node.sharding.lora import LoraFactors

    span = load_block_span(tiny_llama, SpanSpec(0, 2))
    stored = load_adapter_slice(adapter("llama", "qv"), span.config, 0, 2)
    # stored in bfloat16 (as adapters often are), so running it needs float32 copies
    one = AdapterSlice(
        0, 2, {k: LoraFactors(f.lora_a.bfloat16(), f.lora_b.bfloat16(), f.scale) for k, f in stored.factors.items()}
    )
    hidden = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode(), adapters_for_rows(span, [one]):
        span(hidden)
    gradients = []
    for rows in ([one], [None]):
        trainable = hidden.clone().requires_grad_(True)
        with adapters_for_rows(span, rows):
            span(trainable).square().sum().backward()
        gradients.append(trainable.grad)
    assert all(torch.isfinite(gradient).all() for gradient in gradients)
    assert not torch.allclose(gradients[0], gradients[1])


# ---- quantized base weights -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_adapters_add_their_update_to_quantized_projections(tiny_llama, adapter, mode):
    """The base projection runs its bitsandbytes kernel untouched; the update scale * B A x is added in float32."""
    pytest.importorskip("bitsandbytes")
    span = load_block_span(tiny_llama, SpanSpec(0, 2, quant=mode))
    full = load_adapter_slice(adapter("llama", "all_rslora_patterns"), span.config, 0, 2)
    hidden = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(7))
    for block, projection in [(0, "self_attn.q_proj"), (1, "mlp.down_proj"), (1, "self_attn.o_proj")]:
        module = span.layers[block].get_submodule(projection)
        assert type(module).__module__.startswith("bitsandbytes")
        inputs = torch.randn(3, 4, module.in_features, generator=torch.Generator().manual_seed(block))
        factor = full.factors[block, projection]
        with torch.inference_mode():
            base = module(inputs)
            with adapters_for_rows(span, [full, None, full]):
                got = module(inputs)
        update = (inputs @ factor.lora_a.T.float()) @ factor.lora_b.T.float() * factor.scale
        torch.testing.assert_close(got[[0, 2]], base[[0, 2]] + update[[0, 2]], atol=1e-5, rtol=1e-5)
        assert torch.equal(got[1], base[1])
    # the whole span: the adapter's effect (about 8x what the blocks add here) survives; what differs from the float
    # span with the same adapter is quantization error (measured: int8 0.6%, nf4 5.5%; bounds of test_weights_quant)
    reference = load_block_span(tiny_llama, SpanSpec(0, 2))
    with torch.inference_mode():
        with adapters_for_rows(span, [full] * 3):
            got = span(hidden)
        with adapters_for_rows(reference, [full] * 3):
            expected = reference(hidden)
    error = ((got - expected).norm() / (expected - hidden).norm()).item()
    assert error < {"int8": 0.05, "nf4": 0.25}[mode]


def test_bfloat16_projections_add_the_update_as_peft_does(tiny_llama, adapter):
    """In a bfloat16 span the update runs in float32 and is added in float32 before the cast back, as peft's
    lora.Linear does with its default autocast_adapter_dtype=True: the same bits as peft's own layer."""
    folder = adapter("llama", "all_rslora_patterns")
    span = load_block_span(tiny_llama, SpanSpec(0, 2, dtype="bfloat16"))
    full = load_adapter_slice(folder, span.config, 0, 2)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    layers = peft.PeftModel.from_pretrained(base, folder).base_model.model.model.layers
    for block, projection in [(0, "self_attn.q_proj"), (1, "mlp.down_proj")]:
        ours, theirs = span.layers[block].get_submodule(projection), layers[block].get_submodule(projection)
        inputs = torch.randn(2, 3, ours.in_features, generator=torch.Generator().manual_seed(8)).bfloat16()
        with torch.inference_mode(), adapters_for_rows(span, [full, full]):
            got = ours(inputs)
        with torch.inference_mode():
            expected = theirs(inputs)
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


# ---- identity: canonical bytes and their hash -------------------------------------------------------------------


def test_a_slice_round_trips_through_its_bytes(tiny_llama, adapter):
    config = load_config(tiny_llama)
    original = load_adapter_slice(adapter("llama", "all_rslora_patterns"), config, 1, 3)
    data = original.to_bytes()
    assert len(data) == original.nbytes and original.rank == 8
    copy = AdapterSlice.from_bytes(data, original.sha256)
    assert copy.sha256 == original.sha256 and copy.to_bytes() == data
    assert set(copy.factors) == set(original.factors) == {(b, p) for b in (1, 2) for p in _projections()}
    for key, factor in original.factors.items():
        assert torch.equal(copy.factors[key].lora_a, factor.lora_a) and copy.factors[key].scale == factor.scale
    assert original.factors[1, "self_attn.q_proj"].rank == 3 and original.factors[2, "mlp.down_proj"].rank == 2
    assert original.factors[2, "self_attn.o_proj"].scale == 16 / 8**0.5  # rsLoRA with alpha_pattern
    # loading the folder again, in another process with another hash seed, names the same bytes
    assert load_adapter_slice(adapter("llama", "all_rslora_patterns"), config, 1, 3).sha256 == original.sha256
    code = (
        "import sys; from nesa_node.sharding import lora\n"
        "if 'peft' in sys.modules: raise SystemExit('importing sharding.lora imported peft')\n"
        "from nesa_node.sharding.blocks import load_config;"
        f"print(lora.load_adapter_slice({str(adapter('llama', 'all_rslora_patterns'))!r}, "
        f"load_config({tiny_llama!r}), 1, 3).sha256)"
    )
    environment = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == original.sha256


def _projections():
    from nesa_node.sharding.lora import PROJECTIONS

    return PROJECTIONS


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_changing_any_byte_is_refused_by_hash(whole, data):
    good = whole.to_bytes()
    position = data.draw(st.integers(0, len(good) - 1))
    flip = data.draw(st.integers(1, 255))
    tampered = bytearray(good)
    tampered[position] ^= flip
    with pytest.raises(AdapterHashError) as caught:
        AdapterSlice.from_bytes(bytes(tampered), whole.sha256)
    assert caught.value.code == "adapter_hash" and isinstance(caught.value, RequestError)
    assert type(error_from_code(caught.value.code, caught.value.message)) is AdapterHashError


def test_bytes_that_match_their_hash_must_still_be_a_canonical_slice(whole):
    import hashlib

    from safetensors.torch import load, save

    data = whole.to_bytes()
    tensors = load(data)
    for bad in [b"not a slice at all", save(tensors, metadata={"nesa_lora": "{}"}), save(tensors)]:
        with pytest.raises(AdapterError) as caught:
            AdapterSlice.from_bytes(bad, hashlib.sha256(bad).hexdigest())
        assert caught.value.code == "adapter"
    header_length = int.from_bytes(data[:8], "little")
    described = json.loads(json.loads(data[8 : 8 + header_length])["__metadata__"]["nesa_lora"])
    spaced = save(tensors, metadata={"nesa_lora": json.dumps(described, indent=1)})  # same content, other bytes
    with pytest.raises(AdapterError, match="canonical"):
        AdapterSlice.from_bytes(spaced, hashlib.sha256(spaced).hexdigest())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.sets(st.integers(1, 3)), name=st.sampled_from(sorted(ADAPTERS)))
def test_slicing_then_merging_gives_back_the_whole_adapter(tiny_llama, adapter, cuts, name):
    config = load_config(tiny_llama)
    folder = adapter("llama", name)
    whole = load_adapter_slice(folder, config)
    bounds = [0, *sorted(cuts), 4]
    ranges = list(zip(bounds, bounds[1:], strict=False))
    from_folder = [load_adapter_slice(folder, config, start, end) for start, end in ranges]
    narrowed = [whole.narrow(start, end) for start, end in ranges]
    assert [s.sha256 for s in from_folder] == [s.sha256 for s in narrowed]
    assert merge_slices(reversed(from_folder)).sha256 == whole.sha256
    assert sum(len(s.factors) for s in from_folder) == len(whole.factors)


def test_merging_refuses_slices_that_do_not_meet(whole):
    with pytest.raises(AdapterError, match="do not meet"):
        merge_slices([whole.narrow(0, 1), whole.narrow(2, 4)])
    with pytest.raises(AdapterError, match="not a part"):
        whole.narrow(2, 5)


def test_a_pickled_weights_file_loads_through_peft_to_the_same_slice(tiny_llama, adapter, tmp_path):
    lora = ADAPTERS["qv"]
    folder = save_random_adapter(tiny_llama, tmp_path / "safe", 30, **lora)
    pickled = tmp_path / "pickled"
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    peft.PeftModel.from_pretrained(base, folder).save_pretrained(pickled, safe_serialization=False)
    assert (pickled / "adapter_model.bin").is_file() and not (pickled / "adapter_model.safetensors").exists()
    config = load_config(tiny_llama)
    assert load_adapter_slice(pickled, config, 0, 2).sha256 == load_adapter_slice(folder, config, 0, 2).sha256


# ---- what is refused ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias='all'"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"lora_bias": True}, "lora_bias"),
        ({"init_lora_weights": "pissa"}, "changes the base weights"),
        ({"init_lora_weights": "olora"}, "changes the base weights"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
        ({"layer_replication": [[0, 2], [1, 4]]}, "layer_replication"),
        ({"target_parameters": ["mlp.down_proj.weight"]}, "target_parameters"),
    ],
)
def test_unsupported_configs_are_refused_with_their_code(tiny_llama, adapter, tmp_path, change, message):
    folder = _copy_adapter(adapter("llama", "qv"), tmp_path, change)
    with pytest.raises(UnsupportedAdapterError, match=message) as caught:
        load_adapter_slice(folder, load_config(tiny_llama), 0, 4)
    assert caught.value.code == "unsupported_adapter" and isinstance(caught.value, AdapterError)
    with pytest.raises(UnsupportedAdapterError):
        read_adapter_config(folder)


def _copy_adapter(folder: Path, into: Path, change: dict) -> Path:
    target = into / "edited"
    target.mkdir()
    config = json.loads((folder / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (target / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
    return target


def test_real_dora_and_non_lora_adapters_are_refused(tiny_llama, tmp_path):
    config = load_config(tiny_llama)
    dora = save_random_adapter(tiny_llama, tmp_path / "dora", 1, r=2, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(UnsupportedAdapterError, match="DoRA"):
        load_adapter_slice(dora, config)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    ia3 = peft.get_peft_model(
        base, peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    )
    ia3.save_pretrained(tmp_path / "ia3")
    with pytest.raises(UnsupportedAdapterError, match="LoRA adapters only"):
        load_adapter_slice(tmp_path / "ia3", config)


def test_saved_modules_inside_the_blocks_are_refused_and_outside_need_consent(tiny_llama, tmp_path):
    config = load_config(tiny_llama)
    inside = save_random_adapter(
        tiny_llama, tmp_path / "inside", 2, r=2, target_modules=["q_proj"], modules_to_save=["post_attention_layernorm"]
    )
    with pytest.raises(UnsupportedAdapterError, match="inside block"):
        load_adapter_slice(inside, config, 0, 1)
    outside = save_random_adapter(
        tiny_llama, tmp_path / "outside", 3, r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    with pytest.raises(UnsupportedAdapterError, match="outside the transformer blocks"):
        load_adapter_slice(outside, config, 0, 1)
    kept = load_adapter_slice(outside, config, 0, 1, outside_allowed={"base_model.model.lm_head.weight"})
    assert set(kept.factors) == {(0, "self_attn.q_proj")}
    lora_head = save_random_adapter(tiny_llama, tmp_path / "lora-head", 4, r=2, target_modules=["q_proj", "lm_head"])
    with pytest.raises(UnsupportedAdapterError, match=r"lm_head\.lora_A.*nothing else"):  # allowing whole edges only
        load_adapter_slice(lora_head, config, 0, 1, outside_allowed={"base_model.model.lm_head.weight"})
    with pytest.raises(UnsupportedAdapterError, match="not projections inside the blocks"):
        spec_of_folder(lora_head)


def test_folders_that_do_not_fit_the_model_are_refused(tiny_llama, adapter, tmp_path):
    folder = adapter("llama", "all_rslora_patterns")
    config = load_config(tiny_llama)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter_slice(tmp_path / "missing", config)
    with pytest.raises(AdapterError, match="outside the model"):
        load_adapter_slice(folder, config, 2, 5)
    other = load_config(tiny_llama)
    other.intermediate_size = 96  # another model's MLP width
    with pytest.raises(AdapterError, match="another model"):
        load_adapter_slice(folder, other, 0, 1)
    disagree = _copy_adapter(adapter("llama", "qv"), tmp_path, {"target_modules": ["q_proj", "v_proj", "k_proj"]})
    with pytest.raises(AdapterError, match="disagree"):
        load_adapter_slice(disagree, config, 0, 1)
    (tmp_path / "broken").mkdir()
    broken = _copy_adapter(adapter("llama", "qv"), tmp_path / "broken", {})
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:8] + b"{not a header")  # safetensors' own error, typed here
    with pytest.raises(AdapterError, match="cannot be read"):
        load_adapter_slice(broken, config, 0, 1)
    # a slice of this model run on a span of another shape is refused before it runs
    span = load_block_span(tiny_llama, SpanSpec(0, 1))
    up = load_adapter_slice(folder, config, 0, 1).factors[0, "mlp.up_proj"]
    narrow = AdapterSlice(0, 1, {(0, "mlp.up_proj"): _resized(up, 32)})  # A (r, 32): made for hidden size 32
    with pytest.raises(AdapterError, match="does not fit"):
        with adapters_for_rows(span, [narrow]):
            pass


def _resized(factor, in_features: int):
    from nesa_node.sharding.lora import LoraFactors

    return LoraFactors(factor.lora_a[:, :in_features].contiguous(), factor.lora_b, factor.scale)


def test_adapter_errors_travel_as_request_errors():
    for cls, code in [(AdapterError, "adapter"), (UnsupportedAdapterError, "unsupported_adapter")]:
        rebuilt = error_from_code(code, "message")
        assert type(rebuilt) is cls and isinstance(rebuilt, RequestError)
