import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model
from nesa_node.errors import DeviceUnavailableError, ModelLoadError
from nesa_node.sharding.blocks import (
    SafetensorsIndex,
    SpanSpec,
    check_device,
    load_block_span,
    load_config,
)
from nesa_node.sharding.client_edges import load_client_edges
from tests.support.models import ARCHES


@pytest.mark.parametrize("arch", ARCHES)
def test_chained_spans_equal_the_full_model(tiny_models, arch):
    path = tiny_models[arch]
    reference = AutoModelForCausalLM.from_pretrained(path)
    edges = load_client_edges(path)
    spans = [load_block_span(path, SpanSpec(start, end)) for start, end in [(0, 1), (1, 3), (3, 4)]]
    input_ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = reference(input_ids).logits
        # prefill 8 tokens, then 4 one-token steps with each span's cache
        caches = [span.new_cache() for span in spans]
        logits = []
        for start, end in [(0, 8), (8, 9), (9, 10), (10, 11), (11, 12)]:
            hidden = edges.embed_tokens(input_ids[:, start:end])
            for span, cache in zip(spans, caches, strict=True):
                hidden = span(hidden, cache, start)
            logits.append(edges.lm_head(edges.norm(hidden)))
    torch.testing.assert_close(torch.cat(logits, dim=1), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHES)
def test_a_part_of_a_span_equals_a_span_of_that_part(tiny_models, arch):
    """A node serving 0:4 used for blocks 1:3 (a chain using part of its range) computes what a 1:3 node does,
    prefill and cached decode steps alike."""
    path = tiny_models[arch]
    config = load_config(path)
    config._attn_implementation = "eager"  # eager attention reads the mask whole (sdpa may skip a causal one)
    whole = load_block_span(path, SpanSpec(0, 4), config=config)
    part = load_block_span(path, SpanSpec(1, 3), config=config)
    hidden = torch.randn(2, 10, whole.hidden_size, generator=torch.Generator().manual_seed(1))  # (batch, seq, hidden)
    whole_cache, part_cache = whole.new_cache(), part.new_cache()
    with torch.inference_mode():
        # a prefill, a 3-token step on top of a cache (its mask must see the cached length), then one-token steps
        for start, end in [(0, 5), (5, 8), (8, 9), (9, 10)]:
            expected = part(hidden[:, start:end], part_cache, start)
            got = whole(hidden[:, start:end], whole_cache, start, blocks=(1, 3))
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert whole_cache.get_seq_length(1) == 10 and whole_cache.get_seq_length(0) == 0  # blocks 1 and 0 of 0:4
    with pytest.raises(ValueError, match="not a part of this span"):
        part(hidden[:, :1], None, 0, blocks=(0, 2))


def test_a_span_holds_only_its_blocks(tiny_llama):
    span = load_block_span(tiny_llama, SpanSpec(1, 3))
    index = SafetensorsIndex(tiny_llama)
    expected = len(index.names_with_prefix("model.layers.1.")) + len(index.names_with_prefix("model.layers.2."))
    assert len(span.layers.state_dict()) == expected
    assert len(span.layers) == 2


def test_bad_ranges_and_folders_raise_model_load_error(tiny_llama, tmp_path):
    with pytest.raises(ModelLoadError, match="outside"):
        load_block_span(tiny_llama, SpanSpec(2, 9))
    with pytest.raises(ModelLoadError, match="outside"):
        load_block_span(tiny_llama, SpanSpec(3, 3))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_block_span(tmp_path, SpanSpec(0, 1))
    with pytest.raises(ModelLoadError, match="dtype"):
        load_block_span(tiny_llama, SpanSpec(0, 1, dtype="int8"))


def test_a_model_folder_that_needs_its_own_code_is_refused_without_running_it(tmp_path):
    import json

    (tmp_path / "configuration_custom.py").write_text("raise SystemExit('custom code ran')\n")
    config = {"model_type": "custom-llm", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="custom code") as caught:
        load_config(tmp_path)
    assert caught.value.code == "unsupported_model"


def test_devices_torch_cannot_use_are_refused_with_advice():
    check_device("cpu")
    with pytest.raises(DeviceUnavailableError, match="not a device name"):
        check_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="use --device cpu") as caught:
            check_device("cuda")
        assert caught.value.code == "device" and isinstance(caught.value, ModelLoadError)
    else:
        with pytest.raises(DeviceUnavailableError, match="numbered from 0"):
            check_device(f"cuda:{torch.cuda.device_count()}")


def test_the_client_head_scores_several_rows_as_its_own_product_up_to_rounding_and_one_row_exactly(tiny_llama):
    edges = load_client_edges(tiny_llama)
    normed = torch.randn(8, 1, edges.lm_head.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        alone = edges.scores(normed[:1])
        assert edges._head_t is None  # one row: the head's own product, no copy made
        assert torch.equal(alone, edges.lm_head(normed[:1]))
        together = edges.scores(normed)
        assert edges._head_t is not None
        torch.testing.assert_close(together, edges.lm_head(normed), atol=1e-5, rtol=0)
        torch.testing.assert_close(together[:1], alone, atol=1e-5, rtol=0)
    # the copy follows the head's weight when it changes in place (a user editing the output embeddings)
    with torch.no_grad():
        edges.lm_head.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(edges.scores(normed), 2 * together, atol=2e-5, rtol=0)
    # and when the weight's storage is replaced (`.data`, no version change)
    edges.lm_head.weight.data = edges.lm_head.weight.data * 0.5
    with torch.inference_mode():
        torch.testing.assert_close(edges.scores(normed), together, atol=2e-5, rtol=0)
    # weights made in inference mode (no version counter) keep the head's own product
    with torch.inference_mode():
        frozen = load_client_edges(tiny_llama)
        assert torch.equal(frozen.scores(normed), frozen.lm_head(normed)) and frozen._head_t is None
    # bfloat16 keeps the head's own product (the transposed one is slower there)
    half = load_client_edges(tiny_llama, dtype="bfloat16")
    with torch.inference_mode():
        assert torch.equal(half.scores(normed.bfloat16()), half.lm_head(normed.bfloat16()))
    assert half._head_t is None


def test_bfloat16_span_runs(tiny_llama):
    span = load_block_span(tiny_llama, SpanSpec(0, 2, dtype="bfloat16"))
    output = span(torch.randn(1, 3, 64))
    assert output.dtype == torch.bfloat16 and output.shape == (1, 3, 64)


def test_the_caller_chooses_the_grad_mode(tiny_llama):
    """The span's forward takes the grad mode of its caller: inference mode for serving, autograd for a training
    pass, whose gradients reach the input and any weight that asks for them (the span's own weights are frozen)."""
    span = load_block_span(tiny_llama, SpanSpec(0, 2))
    assert not any(parameter.requires_grad for parameter in span.parameters())
    hidden = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        served = span(hidden)
    assert served.is_inference() and not served.requires_grad

    trainable = hidden.clone().requires_grad_(True)
    output = span(trainable)  # autograd on, as a training service runs it
    assert output.requires_grad and not output.is_inference()
    output.square().mean().backward()
    assert trainable.grad is not None and trainable.grad.abs().sum() > 0
    torch.testing.assert_close(output.detach(), served, atol=1e-6, rtol=0)

    weight = span.layers[0].mlp.down_proj.weight
    weight.requires_grad_(True)  # an adapter or fine-tuned weight would ask the same
    try:
        span(hidden).sum().backward()
        assert weight.grad is not None and weight.grad.abs().sum() > 0
    finally:
        weight.requires_grad_(False)
        weight.grad = None


@pytest.mark.serial  # compares two throughput measurements: run alone (Makefile)
def test_throughput_is_measured_warm_and_per_block(tmp_path):
    """A one-block span runs a step faster than a four-block span of the same model, and the per-block figures
    of the two, which leave out the per-call part, are of the same order (a cold, single-shot measurement gave
    10-25 tokens/s whatever the span)."""
    from nesa_node.server.throughput import measure

    path = init_tiny_model(tmp_path / "m", TinyModelSpec(layers=4, hidden=128, heads=4, kv_heads=4, intermediate=256))
    one = measure(load_block_span(path, SpanSpec(0, 1)))
    four = measure(load_block_span(path, SpanSpec(0, 4)))
    assert one["inference_tps"] > 1.5 * four["inference_tps"]
    assert one["forward_tps"] > 1.5 * four["forward_tps"]
    assert 0.2 < four["block_ms"] / one["block_ms"] < 5.0
    assert all(value > 0 for value in (*one.values(), *four.values()))


def test_warm_up_runs_steps_up_to_its_length_and_leaves_the_span_as_it_was(tiny_llama):
    """The start-up warm-up (GPU nodes by default) runs one-token steps up to the cache length asked for, through
    a cache of its own: the span's answers afterwards are the ones a fresh span gives."""
    from nesa_node.server.throughput import GPU_WARMUP_TOKENS, WARMUP_PROMPTS, warm_up, warmup_tokens

    assert warmup_tokens(None, "cpu") == 0 and warmup_tokens(None, "cuda") == warmup_tokens(None, "cuda:1") > 0
    assert warmup_tokens(None, "cuda") == GPU_WARMUP_TOKENS and warmup_tokens(7, "cuda") == 7
    span = load_block_span(tiny_llama, SpanSpec(0, 2))
    hidden = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        before = span(hidden, span.new_cache(), 0)
    calls = []  # (tokens, position) of each call of the span's forward
    span.register_forward_hook(lambda module, args, output: calls.append((args[0].shape[1], args[2])))
    batched, decode_batch = [], span.decode_batch
    span.decode_batch = lambda steps, blocks: (
        batched.append([position for *_, position in steps]) or decode_batch(steps, blocks)
    )
    assert warm_up(span, 12) == 12 and warm_up(span, 0) == 0
    steps = [(1, position) for position in range(12)]  # every cache length up to 12 once
    prompts = [(length, 0) for length in WARMUP_PROMPTS if length <= 12]  # then the prompts that fit
    assert prompts == [(2, 0), (8, 0)]
    assert calls == steps + prompts + [(1, 0), (1, 0)] and batched == [[1, 1]]  # two sessions, then their steps
    with torch.inference_mode():
        assert torch.equal(span(hidden, span.new_cache(), 0), before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHES)
def test_the_rotary_table_holds_what_the_rotary_embedding_computes(tiny_models, arch, dtype):
    """Steps read cos and sin from a table of positions (grown as sequences get longer): bit for bit what the
    family's rotary embedding gives for the same positions, one at a time, in ranges, and one per row."""
    span = load_block_span(tiny_models[arch], SpanSpec(0, 2, dtype=dtype))
    longest = span.config.max_position_embeddings
    hidden = torch.zeros(1, 1, span.hidden_size, dtype=span.dtype_)
    with torch.inference_mode():
        for start, stop in [
            (0, 1),
            (5, 6),
            (0, 17),
            (250, 260),
            (255, 256),
            (1000, 1001),
            (3, 700),
            (longest, longest + 1),
        ]:
            expected = span.rotary(hidden, position_ids=torch.arange(start, stop).unsqueeze(0))
            got = span.rope(hidden, start, stop)
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), (start, stop)
        position_ids = torch.tensor([[7], [0], [999], [3]])
        expected = span.rotary(hidden.expand(4, 1, -1), position_ids=position_ids)
        got = span.rope_rows(hidden, position_ids, 1000)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        table = span._rope_table
        for position in range(longest + 1, longest + 40):  # past the model's length the table is not rebuilt per step
            span.rope(hidden, position, position + 1)
        assert span._rope_table is table and table[0].shape[1] >= longest + 40


def test_a_rotary_type_that_depends_on_the_length_is_not_tabulated(tiny_llama):
    config = load_config(tiny_llama)
    config.rope_parameters = {**config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    span = load_block_span(tiny_llama, SpanSpec(0, 2), config=config)
    hidden = torch.randn(1, 3, span.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cos, _ = span.rope(hidden, 0, 3)
        assert torch.equal(cos, span.rotary(hidden, position_ids=torch.arange(3).unsqueeze(0))[0])
    assert span._rope_table is None


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_rotary_that_depends_on_the_length_is_never_batched_and_each_row_gets_its_own(tiny_llama, rope_type):
    """A `dynamic` or `longrope` rotary scales a call's positions by its longest: in one call, a session at position
    200 would change the embedding of a batch-mate at position 5. Such spans step one session at a time, and a pass
    of several rows still gives each row what a call of its own gives."""
    config = load_config(tiny_llama)
    config.max_position_embeddings = 64  # positions past it are scaled
    half = config.hidden_size // config.num_attention_heads // 2
    extra = (
        {"factor": 2.0}
        if rope_type == "dynamic"
        else {"long_factor": [4.0] * half, "short_factor": [1.0] * half, "original_max_position_embeddings": 64}
    )
    config.rope_parameters = {**config.rope_parameters, "rope_type": rope_type, **extra}
    span = load_block_span(tiny_llama, SpanSpec(0, 2), config=config)
    assert not span.batches_decode and not span.batches_prompts
    hidden = torch.zeros(2, 1, span.hidden_size)
    with torch.inference_mode():
        cos, sin = span.rope_rows(hidden, torch.tensor([[5], [200]]), 201)
        for row, position in enumerate((5, 200)):
            alone_cos, alone_sin = span.rope(hidden[:1], position, position + 1)
            assert torch.equal(cos[row], alone_cos[0]) and torch.equal(sin[row], alone_sin[0]), (rope_type, position)


def test_a_dynamic_rotary_scales_each_call_by_its_own_positions_whatever_came_before(tiny_llama):
    """Past the model's length a `dynamic` rotary scales by the longest length it was called with, and transformers'
    module keeps that length: a session's step at 300 would change the embedding of another session's later step at
    100. Each call gives what a fresh module gives it (a session's own run: its positions only grow)."""
    config = load_config(tiny_llama)
    config.max_position_embeddings = 64
    config.rope_parameters = {**config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    hidden = torch.zeros(1, 1, config.hidden_size)

    def fresh(position: int):
        return load_block_span(tiny_llama, SpanSpec(0, 1), config=config).rope(hidden, position, position + 1)

    span = load_block_span(tiny_llama, SpanSpec(0, 1), config=config)
    with torch.inference_mode():
        expected = {position: fresh(position) for position in (100, 300, 10)}
        for position in (100, 300, 100, 10, 300, 100):
            got = span.rope(hidden, position, position + 1)
            assert all(torch.equal(g, e) for g, e in zip(got, expected[position], strict=True)), position
            rows = span.rope_rows(hidden, torch.tensor([[position]]), position + 1)
            assert all(torch.equal(g[0], e[0]) for g, e in zip(rows, expected[position], strict=True)), position
        module = load_block_span(tiny_llama, SpanSpec(0, 1), config=config).rotary  # transformers' own, called so
        module(hidden, position_ids=torch.tensor([[300]]))
        assert not torch.equal(module(hidden, position_ids=torch.tensor([[100]]))[0], expected[100][0])
