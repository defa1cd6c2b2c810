"""Weight quantization of block spans with bitsandbytes: int8 (LLM.int8 mixed decomposition) and nf4.

Bounds come from what bitsandbytes 0.50 does on CPU with the tiny model below (hidden 128, 2 blocks, seed 3):
- bytes of the blocks after / before, float32: int8 0.258 (one byte per weight plus a float32 scale per output row,
  4/128 of a byte per weight here), nf4 0.135 (half a byte per weight plus absmax); asserted within [0.25, 0.27] and
  [0.125, 0.15]. In bfloat16 the same bytes are held against half the original: int8 0.515, nf4 0.269.
- error of what the span adds to its input (output - input; the residual stream passes through untouched, so the
  error on the whole output would look 30-100x smaller): int8 1.4%, nf4 13%; asserted below 5% and 25%. int8 rounds
  each weight to 1/127 of its row's absmax (about 1% of a Gaussian weight's spread, RMS); nf4 to one of 16 levels.
"""

import subprocess
import sys

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from nesa_node.compression import weights
from nesa_node.compression.weights import (
    QuantizationReport,
    check_quantization_supported,
    module_weight_bytes,
    quantize_linear_layers,
    quantized_state_digest,
)
from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model
from nesa_node.errors import (
    DeviceUnavailableError,
    ModelLoadError,
    QuantizationUnsupportedError,
    RequestError,
    error_from_code,
)
from nesa_node.sharding.blocks import SpanSpec, load_block_span

HIDDEN = 128
LINEAR_PER_BLOCK = 7  # q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    spec = TinyModelSpec(arch="llama", layers=2, hidden=HIDDEN, intermediate=256, vocab=256, seed=3)
    return str(init_tiny_model(tmp_path_factory.mktemp("quant") / "tiny", spec))


@pytest.fixture
def hidden() -> torch.Tensor:
    return torch.randn(2, 16, HIDDEN, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def fresh_support_cache(monkeypatch):
    monkeypatch.setattr(weights, "_SUPPORT_CACHE", {})


def _added_error(output: torch.Tensor, expected: torch.Tensor, hidden: torch.Tensor) -> float:
    """Relative error of what the span adds to its input."""
    return ((output.float() - expected.float()).norm() / (expected.float() - hidden).norm()).item()


@pytest.mark.parametrize("mode, ratio_bounds, max_error", [("int8", (0.25, 0.27), 0.05), ("nf4", (0.125, 0.15), 0.25)])
def test_quantized_span_is_smaller_and_close(model, hidden, mode, ratio_bounds, max_error):
    reference = load_block_span(model, SpanSpec(0, 2))
    span = load_block_span(model, SpanSpec(0, 2, quant=mode))
    report = span.quantization
    assert report.mode == mode and report.layers == 2 * LINEAR_PER_BLOCK
    assert report.bytes_before == module_weight_bytes(reference.layers)
    assert report.bytes_after == module_weight_bytes(span.layers)
    assert ratio_bounds[0] <= report.ratio <= ratio_bounds[1]
    expected, output = reference(hidden), span(hidden)
    assert output.dtype == torch.float32 and output.shape == hidden.shape
    error = _added_error(output, expected, hidden)
    print(f"{mode}: {report.bytes_before} -> {report.bytes_after} bytes ({report.ratio:.3f}), error {error:.4f}")
    assert error < max_error


@pytest.mark.parametrize("mode, ratio_bounds", [("int8", (0.5, 0.53)), ("nf4", (0.25, 0.3))])
def test_bfloat16_quantized_span_runs(model, hidden, mode, ratio_bounds):
    reference = load_block_span(model, SpanSpec(0, 2, dtype="bfloat16"))
    span = load_block_span(model, SpanSpec(0, 2, dtype="bfloat16", quant=mode))
    assert ratio_bounds[0] <= span.quantization.ratio <= ratio_bounds[1]
    output, expected = span(hidden), reference(hidden)
    assert output.dtype == torch.bfloat16
    # bfloat16 rounding of the output alone is ~0.5% of what the span adds, so bound the whole output instead
    assert ((output.float() - expected.float()).norm() / expected.float().norm()).item() < 0.02


def test_weights_hash_covers_the_quantized_weights(model, hidden):
    plain = load_block_span(model, SpanSpec(0, 2))
    int8 = load_block_span(model, SpanSpec(0, 2, quant="int8"))
    int8_again = load_block_span(model, SpanSpec(0, 2, quant="int8"))
    nf4 = load_block_span(model, SpanSpec(0, 2, quant="nf4"))
    assert plain.quantization is None
    assert int8.weights_hash == int8_again.weights_hash
    assert len({plain.weights_hash, int8.weights_hash, nf4.weights_hash}) == 3
    assert len(int8.weights_hash) == 16
    for span in (int8, nf4):  # serving does not change what the digest covers
        before = quantized_state_digest(span.layers)
        span(hidden)
        assert quantized_state_digest(span.layers) == before
    assert quantized_state_digest(int8.layers) == quantized_state_digest(int8_again.layers)


@pytest.mark.parametrize("layout", ["native", "generic"])
def test_nf4_layers_of_any_shape_run(monkeypatch, layout):
    if layout == "generic":  # the layout CPUs without AVX512-BF16 use (double-quantized absmax)
        monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: False)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(128, 96), nn.GELU(), nn.Linear(96, 40), nn.Linear(40, 8))
    reference = [layer.weight.detach().clone() for layer in module if isinstance(layer, nn.Linear)]
    inputs = torch.randn(3, 128)
    with torch.no_grad():
        expected = module(inputs)
    report = quantize_linear_layers(module, "nf4", device="cpu", dtype=torch.float32, skip=("3",))
    assert report.layers == 2 and isinstance(module[0], bnb.nn.Linear4bit) and module[3].weight.equal(reference[2])
    digest = quantized_state_digest(module)
    with torch.no_grad():
        output = module(inputs)
    assert quantized_state_digest(module) == digest
    assert ((output - expected).norm() / expected.norm()).item() < 0.25


def test_none_changes_nothing():
    module = nn.Sequential(nn.Linear(64, 32))
    report = quantize_linear_layers(module, "none", device="cpu", dtype=torch.float32)
    assert report == QuantizationReport("none", 0, 64 * 32 * 4 + 32 * 4, 64 * 32 * 4 + 32 * 4)
    assert type(module[0]) is nn.Linear
    with pytest.raises(ValueError, match="container"):
        quantize_linear_layers(nn.Linear(64, 32), "int8", device="cpu", dtype=torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_without_cuda_is_refused(model, fresh_support_cache):
    with pytest.raises(QuantizationUnsupportedError, match="no CUDA device") as caught:
        check_quantization_supported("int8", "cuda", torch.float32)
    assert caught.value.code == "unsupported_quantization"
    assert "use --device cpu" in str(caught.value)
    with pytest.raises(DeviceUnavailableError, match="use --device cpu"):  # the device is refused before its quant
        load_block_span(model, SpanSpec(0, 1, device="cuda", quant="nf4"))
    assert isinstance(caught.value, ModelLoadError)
    rebuilt = error_from_code(caught.value.code, caught.value.message)  # as a peer's: not this process's model error
    assert type(rebuilt) is RequestError and rebuilt.code == "unsupported_quantization"


def test_a_failing_kernel_is_refused_at_start(model, monkeypatch, fresh_support_cache):
    def broken(self, x):
        raise RuntimeError("no 4-bit kernel for this device")

    monkeypatch.setattr(bnb.nn.Linear4bit, "forward", broken)
    with pytest.raises(QuantizationUnsupportedError, match="no 4-bit kernel") as caught:
        load_block_span(model, SpanSpec(0, 1, quant="nf4"))
    assert caught.value.code == "unsupported_quantization"
    assert "use --quant int8 or --quant none" in caught.value.message
    check_quantization_supported("int8", "cpu", "float32")  # the other mode still runs


def test_wrong_results_are_refused(monkeypatch, fresh_support_cache):
    monkeypatch.setattr(bnb.nn.Linear8bitLt, "forward", lambda self, x: torch.zeros(*x.shape[:-1], self.out_features))
    with pytest.raises(QuantizationUnsupportedError, match="wrong results"):
        check_quantization_supported("int8", "cpu", torch.float32)


def test_missing_bitsandbytes_is_refused(monkeypatch, fresh_support_cache):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what `import bitsandbytes` sees when it is not installed
    with pytest.raises(QuantizationUnsupportedError, match="pip install bitsandbytes") as caught:
        check_quantization_supported("nf4", "cpu", torch.bfloat16)
    assert caught.value.message.endswith("or use --quant none")


def test_unknown_mode_is_refused(model):
    with pytest.raises(QuantizationUnsupportedError, match="int4"):
        check_quantization_supported("int4", "cpu", torch.float32)
    with pytest.raises(QuantizationUnsupportedError, match="none, int8, nf4"):
        load_block_span(model, SpanSpec(0, 1, quant="int4"))


def test_importing_the_package_does_not_load_bitsandbytes():
    code = (
        "import sys, nesa_node; assert 'bitsandbytes' not in sys.modules; "
        "import nesa_node.sharding.blocks, nesa_node.compression.weights; print('bitsandbytes' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
