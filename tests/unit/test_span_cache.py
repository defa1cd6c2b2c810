"""The node's session cache (sharding/span_cache.py): the same outputs as transformers' DynamicCache, bit for bit,
written in place into buffers that grow only to what the owner reserved."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from nesa_node.client.private_edges import EdgeBlocks, EdgeSession
from nesa_node.errors import PeerUnavailableError
from nesa_node.sharding.blocks import SpanSpec, load_block_span, load_config
from nesa_node.sharding.span_cache import MIN_CAPACITY, ReservedLayer, SpanCache
from tests.support.models import ARCHES


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHES)
def test_outputs_equal_a_dynamic_cache_bit_for_bit(tiny_models, arch, dtype):
    span = load_block_span(tiny_models[arch], SpanSpec(0, 4, dtype=dtype))
    hidden = torch.randn(2, 40, span.hidden_size, generator=torch.Generator().manual_seed(3))
    reference, cache = DynamicCache(config=span.sub_config), span.new_cache()
    cache.reserve(24)  # the prefill fits; the decode steps then pass the reservation and the buffers double
    with torch.inference_mode():
        # a prefill, a 5-token step after cached tokens (a causal mask over the cache), then one-token steps
        for start, end in [(0, 20), (20, 25), *((t, t + 1) for t in range(25, 40))]:
            expected = span(hidden[:, start:end], reference, start)
            got = span(hidden[:, start:end], cache, start)
            assert torch.equal(got, expected), (start, end)
    assert cache.get_seq_length() == reference.get_seq_length() == 40
    for ours, theirs in zip(cache.layers, reference.layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_keys_and_values_view_the_filled_part_of_the_buffers_whatever_moved_them():
    """The views are made when read: after a step, a length moved without them (a replayed pass), a crop, a new
    buffer and a reset, each is the filled part of the buffer held then (the same memory, not a copy)."""
    layer = ReservedLayer()
    assert layer.keys is None and layer.values is None
    keys, values = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    got = layer.update(keys, values)
    assert got[0].shape[-2] == 3 and torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    layer._keys[..., 3, :] = 5.0
    layer._view(4)  # what a replayed pass does: the length moves, nothing is sliced
    assert layer.keys.shape[-2] == layer.values.shape[-2] == 4 and bool((layer.keys[..., 3, :] == 5).all())
    assert layer.keys.data_ptr() == layer._keys.data_ptr() and layer.values.data_ptr() == layer._values.data_ptr()
    layer.crop(-2)
    assert layer.keys.shape[-2] == 2 and torch.equal(layer.keys, keys[..., :2, :])
    layer.update(torch.randn(1, 2, 2 * MIN_CAPACITY, 4), torch.randn(1, 2, 2 * MIN_CAPACITY, 4))  # a new buffer
    assert layer.keys.shape[-2] == 2 + 2 * MIN_CAPACITY and layer.keys.data_ptr() == layer._keys.data_ptr()
    assert torch.equal(layer.values[..., :2, :], values[..., :2, :])
    layer.batch_repeat_interleave(2)  # new buffers of the same length
    assert layer.keys.shape[0] == layer.values.shape[0] == 2 and layer.keys.data_ptr() == layer._keys.data_ptr()
    layer.reset()
    assert layer.keys is None and layer.values is None and layer.get_seq_length() == 0


def test_sliding_window_layers_keep_transformers_layer(tiny_models):
    span = load_block_span(tiny_models["mistral"], SpanSpec(0, 4))  # the tiny mistral's layers are all sliding
    assert all(isinstance(layer, DynamicSlidingWindowLayer) for layer in span.new_cache().layers)
    span = load_block_span(tiny_models["llama"], SpanSpec(1, 3))
    assert [type(layer) for layer in span.new_cache().layers] == [ReservedLayer, ReservedLayer]


def test_steps_write_in_place_and_buffers_grow_only_to_the_reservation(tiny_llama):
    span = load_block_span(tiny_llama, SpanSpec(0, 2))
    cache = span.new_cache()
    cache.reserve(16)
    hidden = torch.randn(1, 40, span.hidden_size, generator=torch.Generator().manual_seed(4))
    layer = cache.layers[0]
    with torch.inference_mode():
        span(hidden[:, :3], cache, 0)
        buffer = layer._keys.data_ptr()
        assert layer.capacity == 16
        for position in range(3, 16):
            span(hidden[:, position : position + 1], cache, position)
        assert layer._keys.data_ptr() == buffer and layer.capacity == 16  # 13 steps, no new buffer
        per_token = 2 * layer._keys[0, :, 0].numel() * layer._keys.element_size() * len(cache.layers)
        assert cache.held_bytes() == 16 * per_token  # what was reserved, and no more
        cache.reserve(32)  # the owner reserved more: the next step that needs room grows to it
        span(hidden[:, 16:17], cache, 16)
        assert layer.capacity == 32 and layer._keys.data_ptr() != buffer
        # nothing reserved past 32: the buffers double
        span(hidden[:, 17:34], cache, 17)
        assert layer.capacity == 64 and cache.get_seq_length() == 34


def test_without_a_reservation_buffers_double_from_a_minimum():
    layer = ReservedLayer()
    keys = torch.randn(1, 2, 1, 4)
    for step in range(MIN_CAPACITY + 1):
        got_keys, got_values = layer.update(keys + step, keys - step)
    assert layer.capacity == 2 * MIN_CAPACITY and layer.get_seq_length() == MIN_CAPACITY + 1
    assert torch.equal(got_keys[0, 0, :, 0], keys[0, 0, 0, 0] + torch.arange(MIN_CAPACITY + 1.0))
    assert torch.equal(got_values[0, 1, :, 3], keys[0, 1, 0, 3] - torch.arange(MIN_CAPACITY + 1.0))


def test_crop_forgets_the_last_tokens_and_the_next_step_overwrites_them(tiny_llama):
    """What a client's private front blocks do when the chain refuses a step: crop, then the step again."""
    span = load_block_span(tiny_llama, SpanSpec(0, 4))
    hidden = torch.randn(1, 12, span.hidden_size, generator=torch.Generator().manual_seed(5))
    other = torch.randn(1, 2, span.hidden_size, generator=torch.Generator().manual_seed(6))
    reference, cache = DynamicCache(config=span.sub_config), span.new_cache()
    with torch.inference_mode():
        for held in (reference, cache):
            span(hidden[:, :8], held, 0)
            span(other, held, 8)  # refused downstream: forgotten
            held.crop(-2)
        assert cache.get_seq_length() == 8
        for start in range(8, 12):
            assert torch.equal(span(hidden[:, start : start + 1], cache, start),
                               span(hidden[:, start : start + 1], reference, start))  # fmt: skip
    with pytest.raises(ValueError, match="negative"):
        cache.layers[0].crop(3)


def test_keys_of_another_batch_are_refused():
    layer = ReservedLayer()
    layer.update(torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))
    with pytest.raises(ValueError, match="do not match"):
        layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert layer.get_seq_length() == 3  # nothing written


@pytest.mark.parametrize("attention", ["per_session", "padded"])
def test_a_batched_pass_over_span_caches_equals_each_sessions_own_steps(tiny_llama, attention):
    """decode_batch reads each session's view (attention a session) or pads every session's view to the longest:
    the zeroed buffers and the views give what separate steps give."""
    span = load_block_span(tiny_llama, SpanSpec(0, 4))
    assert span._rotate is not None  # attention a session at a time, unless told otherwise
    if attention == "padded":
        span._rotate = None  # a GPU's pass
    generator = torch.Generator().manual_seed(7)
    # 62: a buffer of MIN_CAPACITY filled and grown during the steps; the last session holds a DynamicCache (no
    # buffer: its own update)
    lengths = [5, 11, 2, MIN_CAPACITY - 2, 4]
    prompts = [torch.randn(1, n, span.hidden_size, generator=generator) for n in lengths]
    ours = [span.new_cache() for _ in lengths[:-1]] + [DynamicCache(config=span.sub_config)]
    alone = [SpanCache(span.sub_config) for _ in lengths]
    with torch.inference_mode():
        for prompt, a, b in zip(prompts, ours, alone, strict=True):
            span(prompt, a, 0)
            span(prompt, b, 0)
        for _ in range(3):
            steps = [torch.randn(1, 1, span.hidden_size, generator=generator) for _ in lengths]
            batched = span.decode_batch(
                [(step, cache, cache.get_seq_length()) for step, cache in zip(steps, ours, strict=True)], (0, 4)
            )
            for step, cache, got in zip(steps, alone, batched, strict=True):
                torch.testing.assert_close(got, span(step, cache, cache.get_seq_length()), atol=1e-5, rtol=0)


def test_a_batched_pass_through_a_block_replaced_since_loading_runs_every_block_whole(tiny_llama):
    """A block replaced after the span was loaded (a cheating node's pass-through, devtools/malicious.py) is not the
    family's layer that attention a session at a time runs part by part: such a pass runs the blocks whole (the
    padded path), and gives what each session's own step gives."""

    class PassThrough(torch.nn.Module):
        def forward(self, hidden_states, *args, **kwargs):
            return hidden_states

    span = load_block_span(tiny_llama, SpanSpec(0, 4))
    span.layers[2] = PassThrough()
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randn(1, n, span.hidden_size, generator=generator) for n in (3, 6)]
    ours, alone = [span.new_cache() for _ in prompts], [span.new_cache() for _ in prompts]
    with torch.inference_mode():
        for prompt, a, b in zip(prompts, ours, alone, strict=True):
            span(prompt, a, 0)
            span(prompt, b, 0)
        steps = [torch.randn(1, 1, span.hidden_size, generator=generator) for _ in prompts]
        batched = span.decode_batch(
            [(step, cache, cache.get_seq_length()) for step, cache in zip(steps, ours, strict=True)], (0, 4)
        )
        for step, cache, got in zip(steps, alone, batched, strict=True):
            torch.testing.assert_close(got, span(step, cache, cache.get_seq_length()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["per_session", "padded"])
def test_a_batched_pass_reads_buffers_past_a_sessions_end_as_if_zero_padded(tiny_llama, attention):
    """A padded pass reads each session's buffer as it is up to the longest session (one copy for all): rows a
    session no longer holds (cropped, or never written) are masked, so its outputs and caches equal, bit for bit,
    those of sessions whose buffers hold zeros there. One session's buffer is shorter than the longest (it is padded),
    one grows during the pass (its own update). A pass attending a session at a time reads its rows only: the same."""
    span = load_block_span(tiny_llama, SpanSpec(0, 4))
    assert span._rotate is not None
    if attention == "padded":
        span._rotate = None  # a GPU's pass
    generator = torch.Generator().manual_seed(8)
    # 5: a first buffer of MIN_CAPACITY (64), shorter than the longest session (padded); 70: a buffer of exactly 70,
    # grown by its own update at the first pass; 63: a buffer of 64, filled at the first pass, grown at the second
    lengths = [5, 70, 63]
    assert lengths[1] > MIN_CAPACITY and lengths[2] == MIN_CAPACITY - 1
    prompts = [torch.randn(1, n, span.hidden_size, generator=generator) for n in lengths]
    stale = torch.randn(1, MIN_CAPACITY, span.hidden_size, generator=generator) * 30
    clean, cropped = [span.new_cache() for _ in lengths], [span.new_cache() for _ in lengths]
    with torch.inference_mode():
        for prompt, a, b in zip(prompts, clean, cropped, strict=True):
            span(prompt, a, 0)
            span(prompt, b, 0)
        span(stale[:, : MIN_CAPACITY - 1 - lengths[0]], cropped[0], lengths[0])  # written, then forgotten
        cropped[0].crop(-(MIN_CAPACITY - 1 - lengths[0]))
        assert (
            cropped[0].layers[0]._keys[0, 0, lengths[0] :].abs().sum()
            > 0
            == clean[0].layers[0]._keys[0, 0, lengths[0] :].abs().sum()
        )
        for _ in range(3):
            steps = [torch.randn(1, 1, span.hidden_size, generator=generator) for _ in lengths]
            outputs = [
                span.decode_batch([(s, c, c.get_seq_length()) for s, c in zip(steps, caches, strict=True)], (0, 4))
                for caches in (clean, cropped)
            ]
            for ours, theirs in zip(*outputs, strict=True):
                assert torch.equal(ours, theirs)
        for a, b in zip(clean, cropped, strict=True):
            assert a.get_seq_length() == b.get_seq_length()
            for ours, theirs in zip(a.layers, b.layers, strict=True):
                assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert [cache.layers[0].capacity for cache in clean] == [MIN_CAPACITY, 140, 2 * MIN_CAPACITY]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_passes_on_cuda_give_each_sessions_own_steps(tiny_llama, dtype):
    """On CUDA: a pass of prompts (one after cached tokens) with one-token steps (`run_batch`, --batch-prompts), then
    one-token passes over the caches padded to the longest (`decode_batch`'s GPU path), each against the same
    session's own steps on a cache of its own. Tight in float32; bfloat16 within its rounding."""
    span = load_block_span(tiny_llama, SpanSpec(0, 4, dtype=dtype, device="cuda"))
    assert span.batches_prompts and not torch.backends.cuda.cudnn_sdp_enabled()  # no per-length cuDNN plans
    generator = torch.Generator().manual_seed(12)
    lengths = [5, 11, MIN_CAPACITY - 1]  # the last fills its first buffer at the first one-token pass, then grows
    prompts = [torch.randn(1, n, span.hidden_size, generator=generator) for n in lengths]
    ours, alone = [span.new_cache() for _ in lengths], [span.new_cache() for _ in lengths]
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == "float32" else {"atol": 5e-2, "rtol": 5e-2}
    with torch.inference_mode():
        span(prompts[0], ours[0], 0)
        span(prompts[0], alone[0], 0)
        # session 0: 3 tokens after its cached 5; session 1: its prompt; session 2: its prompt, in one pass
        first = [torch.randn(1, 3, span.hidden_size, generator=generator), prompts[1], prompts[2]]
        batched = span.run_batch([(h, c, c.get_seq_length()) for h, c in zip(first, ours, strict=True)], (0, 4))
        for hidden, cache, got in zip(first, alone, batched, strict=True):
            expected = span(hidden, cache, cache.get_seq_length())
            torch.testing.assert_close(got.float(), expected.float(), **tolerance)
        for _ in range(4):
            steps = [torch.randn(1, 1, span.hidden_size, generator=generator) for _ in lengths]
            batched = span.decode_batch([(s, c, c.get_seq_length()) for s, c in zip(steps, ours, strict=True)], (0, 4))
            for step, cache, got in zip(steps, alone, batched, strict=True):
                expected = span(step, cache, cache.get_seq_length())
                assert got.device.type == "cuda"
                torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    assert [c.get_seq_length() for c in ours] == [c.get_seq_length() for c in alone] == [12, 15, MIN_CAPACITY + 3]


class _RefusingChain:
    """The inner session of an EdgeSession: its chain hands a step's hidden states back as they came, and refuses
    the steps whose numbers (from 0) are in `refused`."""

    max_length = 64

    def __init__(self, refused=(1,)):
        self.position = 0
        self.steps = 0
        self.refused = set(refused)

    async def step(self, hidden):
        self.steps += 1
        if self.steps - 1 in self.refused:
            raise PeerUnavailableError("every replacement failed")
        self.position += hidden.shape[1]
        return hidden


async def test_a_step_the_chain_refuses_leaves_the_private_front_blocks_cache_as_before(tiny_llama):
    span = load_block_span(tiny_llama, SpanSpec(0, 1))
    edges = EdgeSession(_RefusingChain(refused=(1,)), EdgeBlocks(span, None, num_blocks=4))
    hidden = torch.randn(1, 6, span.hidden_size, generator=torch.Generator().manual_seed(8))
    await edges.step(hidden[:, :4])
    with pytest.raises(PeerUnavailableError, match="every replacement"):  # the chain's own error, typed
        await edges.step(hidden[:, 4:6])
    assert edges.front_cache.get_seq_length() == 4


async def test_a_refused_step_past_a_sliding_window_is_rolled_back_too(tiny_models):
    """Sliding-window front blocks (a window of 4 here) past their window: the refused step is cropped away, and the
    next steps give what blocks that never saw it give."""
    config = load_config(tiny_models["mistral"])
    config.sliding_window = 4
    span = load_block_span(tiny_models["mistral"], SpanSpec(0, 1), config=config)
    edges = EdgeSession(_RefusingChain(refused=(2,)), EdgeBlocks(span, None, num_blocks=4))
    hidden = torch.randn(1, 10, span.hidden_size, generator=torch.Generator().manual_seed(9))
    refused = torch.randn(1, 1, span.hidden_size, generator=torch.Generator().manual_seed(10))
    reference = DynamicCache(config=span.sub_config)
    with torch.inference_mode():
        expected = [span(hidden[:, :6], reference, 0)]
        expected += [span(hidden[:, t : t + 1], reference, t) for t in range(6, 10)]
    got = [await edges.step(hidden[:, :6]), await edges.step(hidden[:, 6:7])]
    with pytest.raises(PeerUnavailableError):
        await edges.step(refused)
    got += [await edges.step(hidden[:, t : t + 1]) for t in range(7, 10)]
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert edges.front_cache.get_seq_length() == 10
    assert edges.front_cache.layers[0].keys.shape[-2] == 3  # trimmed to the window after each step
