"""Weight quantization of a node's linear layers with bitsandbytes (Nesa paper, section 4).

Modes (`QUANT_MODES`):

- "none": the layers stay as loaded.
- "int8": LLM.int8 mixed matrix decomposition (Dettmers et al. 2022), `bnb.nn.Linear8bitLt` with
  `has_fp16_weights=False`: one int8 per weight and one float32 scale per output row. At run time the input columns
  that hold a value above `threshold` are multiplied in float16, the rest in int8; inputs are cast to float16 for it.
- "nf4": 4-bit NormalFloat (QLoRA, Dettmers et al. 2023), `bnb.nn.Linear4bit(quant_type="nf4")`: one 4-bit code per
  weight and one absmax per `NF4_BLOCKSIZE` weights, the absmax themselves stored in 8 bits (double quantization).

bitsandbytes is imported inside the functions that use it, never at module import, so `import nesa_node` and the
default `--quant none` path do not load it.

bitsandbytes 0.50 on CPU runs both modes for float32, bfloat16 and float16 inputs. On a CPU with AVX512-BF16 a
Linear4bit switches, on its first forward, to a CPU weight layout (bfloat16 absmax, no double quantization) that needs
out_features % 32 == 0 and in_features % NF4_BLOCKSIZE == 0; layers of other shapes are kept on the generic kernel.
`quantize_linear_layers` runs one row through every converted layer before it returns, so the module already holds the
layout it serves with: the report's byte counts and `quantized_state_digest` describe what is served, they do not change
on the first request, and a layer that cannot run fails at start. The digest therefore depends on the bitsandbytes
version and on the layout its kernels chose for the device (a GPU, a CPU with AVX512-BF16 and one without differ).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nesa_node.errors import QuantizationUnsupportedError

QUANT_MODES = ("none", "int8", "nf4")
# LLM.int8 (Dettmers et al. 2022, section 3.2): treating input columns with a magnitude >= 6.0 as outliers is enough
# to bring the int8 models' degradation close to zero. bitsandbytes' own default is 0.0 (no decomposition).
DEFAULT_THRESHOLD = 6.0
NF4_BLOCKSIZE = 64  # weights per absmax; QLoRA's choice and bitsandbytes' default
DOUBLE_QUANT = True  # QLoRA double quantization: absmax stored in 8 bits, about 0.37 bits per weight less
_CPU_PACK_ROWS = 32  # bitsandbytes 0.50's AVX512-BF16 4-bit layout packs output rows in groups of 32

# check_quantization_supported runs one layer of this size (in, out features: whole 4-bit blocks and row groups)
_PROBE_FEATURES = (128, 64)
# Relative output error of the probe above which a mode counts as broken. Measured on it: int8 ~0.01, nf4 ~0.1.
_PROBE_MAX_ERROR = 0.5

# Log lines bitsandbytes repeats that say nothing to a node operator: (logger, message prefix).
_QUIET_LOGS = (
    # LLM.int8 quantizes activations through float16 by design; bitsandbytes says so on every forward
    ("bitsandbytes.autograd._functions", "MatMul8bitLt: inputs will be cast"),
    # an optional faster CPU 4-bit kernel from the `kernels` package; the built-in kernel runs without it
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
)

# (mode, device, dtype) -> None when the mode runs there, else (why not, what to do); see check_quantization_supported
_SUPPORT_CACHE: dict[tuple[str, str, torch.dtype], tuple[str, str] | None] = {}
_INSTALL = "pip install bitsandbytes==0.50.0"  # the version constraints.txt pins


@dataclass(frozen=True)
class QuantizationReport:
    """What `quantize_linear_layers` did to a module; reports of the blocks of a span add up with `+`."""

    mode: str
    layers: int  # nn.Linear layers converted
    bytes_before: int  # parameters + buffers held before, bytes
    bytes_after: int  # parameters + buffers + quantization state (scales, absmax, code tables) held after, bytes

    @property
    def ratio(self) -> float:
        """bytes_after / bytes_before (1.0 for an empty module)."""
        return self.bytes_after / self.bytes_before if self.bytes_before else 1.0

    def __add__(self, other: QuantizationReport) -> QuantizationReport:
        if other.mode != self.mode:
            raise ValueError(f"cannot add a {other.mode} report to a {self.mode} report")
        return QuantizationReport(
            self.mode,
            self.layers + other.layers,
            self.bytes_before + other.bytes_before,
            self.bytes_after + other.bytes_after,
        )


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _import_bitsandbytes():
    """bitsandbytes, with its repeated log lines filtered. Raises QuantizationUnsupportedError when it cannot load."""
    for name, prefix in _QUIET_LOGS:
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefix) and f.prefix == prefix for f in target.filters):
            target.addFilter(_DropPrefix(prefix))
    try:
        import bitsandbytes
    except Exception as error:  # ImportError, or a native library that fails to load
        raise QuantizationUnsupportedError(
            f"bitsandbytes cannot be imported ({type(error).__name__}: {error}); install it ({_INSTALL}) or use --quant none"
        ) from error
    return bitsandbytes


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"{dtype!r} is not a floating point torch dtype")
    return resolved


def _check_mode(mode: str) -> None:
    if mode not in QUANT_MODES:
        raise QuantizationUnsupportedError(
            f"unknown quantization mode {mode!r}; choose one of {', '.join(QUANT_MODES)}"
        )


def check_quantization_supported(mode: str, device: str | torch.device, dtype: torch.dtype | str) -> None:
    """Refuse a mode that bitsandbytes cannot run on `device` with activations in `dtype`.

    Decided by quantizing and running one small layer (`_PROBE_FEATURES`) the first time a (mode, device, dtype) is
    asked, and comparing its output with the float layer's; the answer is cached for the process.
    Raises QuantizationUnsupportedError (code "unsupported_quantization") for an unknown mode, a missing or broken
    bitsandbytes, a device torch cannot use, or a combination whose probe fails or returns wrong numbers.
    """
    _check_mode(mode)
    if mode == "none":
        return
    target, torch_dtype = torch.device(device), _as_dtype(dtype)
    key = (mode, str(target), torch_dtype)
    if key not in _SUPPORT_CACHE:
        _SUPPORT_CACHE[key] = _probe(mode, target, torch_dtype)
    refusal = _SUPPORT_CACHE[key]
    if refusal is not None:
        reason, advice = refusal
        dtype_name = str(torch_dtype).removeprefix("torch.")
        raise QuantizationUnsupportedError(
            f"--quant {mode} cannot run on {target} with {dtype_name} activations: {reason}; {advice}"
        )


def _probe(mode: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str] | None:
    """None when a small layer quantized with `mode` runs on `device` and computes about the right output, else
    (why not, what to do)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA device on this machine", "use --device cpu"
    try:
        _import_bitsandbytes()
    except QuantizationUnsupportedError as error:
        cause = error.__cause__ or error
        return (
            f"bitsandbytes cannot be imported ({type(cause).__name__}: {cause})",
            f"install it ({_INSTALL}) or use --quant none",
        )
    advice = "use --quant int8 or --quant none" if mode == "nf4" else "use --quant none"
    in_features, out_features = _PROBE_FEATURES
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator)
    inputs = torch.randn(4, in_features, generator=generator)
    expected = torch.nn.functional.linear(inputs, weight, bias)
    probe = nn.Sequential(nn.Linear(in_features, out_features, device="meta"))  # no draw from the global RNG
    probe[0].weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    probe[0].bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    try:
        quantize_linear_layers(probe, mode, device=device, dtype=dtype)
        with torch.no_grad():
            output = probe(inputs.to(device, dtype)).float().cpu()
    except Exception as error:  # any failure of the kernels means the mode is not usable here
        cause = error.__cause__ if isinstance(error, QuantizationUnsupportedError) and error.__cause__ else error
        return f"a test layer failed ({type(cause).__name__}: {cause})", advice
    error = ((output - expected).norm() / expected.norm()).item()
    if not error <= _PROBE_MAX_ERROR:  # also catches NaN
        return f"a test layer computed wrong results (relative error {error:.3g})", advice
    return None


def quantize_linear_layers(
    module: nn.Module,
    mode: str,
    *,
    device: str | torch.device,
    dtype: torch.dtype | str,
    threshold: float = DEFAULT_THRESHOLD,
    compute_dtype: torch.dtype | None = None,
    skip: Sequence[str] = (),
) -> QuantizationReport:
    """Replace every nn.Linear inside `module`, in place, by its bitsandbytes equivalent, and move `module` to `device`.

    `dtype` is the dtype of the activations the module will run on (and of the biases, which stay unquantized).
    `threshold` is the LLM.int8 outlier magnitude (int8 only); `compute_dtype` the dtype nf4 layers multiply in
    (default `dtype`). Layers named in `skip` (a qualified name such as "mlp.down_proj", or its last part) stay as they
    are. Converted layers are in eval mode and have run once, so they hold their serving layout (see the module doc).
    With mode "none" nothing changes and nothing moves.
    Raises QuantizationUnsupportedError for an unknown mode, a missing bitsandbytes, or a layer that does not run;
    ValueError when `module` itself is an nn.Linear (wrap it in a container).
    """
    _check_mode(mode)
    before = module_weight_bytes(module)
    if mode == "none":
        return QuantizationReport(mode, 0, before, before)
    target, torch_dtype = torch.device(device), _as_dtype(dtype)
    bnb = _import_bitsandbytes()
    quantized_types = (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)
    chosen = [
        (name, child)
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear)
        and not isinstance(child, quantized_types)
        and not any(name == entry or name.endswith("." + entry) for entry in skip)
    ]
    if any(name == "" for name, _ in chosen):
        raise ValueError(
            "quantize_linear_layers replaces layers inside `module`; wrap a single nn.Linear in a container"
        )
    converted = set()
    for name, linear in chosen:
        if mode == "int8":
            layer = _int8_layer(bnb, linear, target, torch_dtype, threshold)
        else:
            layer = _nf4_layer(bnb, linear, target, torch_dtype, compute_dtype or torch_dtype)
        parent, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent), attribute, layer)
        converted.add(id(layer))
        _warm_up(layer, name, mode, target, torch_dtype)
    for sub in module.modules():  # what stays unquantized (norms, skipped layers) moves as is
        if id(sub) not in converted:
            sub._apply(lambda tensor: tensor.to(target), recurse=False)
    return QuantizationReport(mode, len(chosen), before, module_weight_bytes(module))


def _int8_layer(bnb, linear: nn.Linear, device: torch.device, dtype: torch.dtype, threshold: float) -> nn.Module:
    layer = bnb.nn.Linear8bitLt(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        has_fp16_weights=False,
        threshold=threshold,
        device="meta",
    )
    # Int8Params quantizes (int8 rows + one float32 scale per row) when moved from the CPU to a device, the CPU included
    layer.weight = bnb.nn.Int8Params(
        linear.weight.detach().to("cpu", dtype), requires_grad=False, has_fp16_weights=False
    )
    return _finish(layer, linear, device, dtype)


def _nf4_layer(bnb, linear: nn.Linear, device: torch.device, dtype: torch.dtype, compute: torch.dtype) -> nn.Module:
    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=compute,
        compress_statistics=DOUBLE_QUANT,
        quant_type="nf4",
        device="meta",
    )
    # Params4bit quantizes when moved to a device, the CPU included
    layer.weight = bnb.nn.Params4bit(
        linear.weight.detach().to("cpu", dtype),
        requires_grad=False,
        blocksize=NF4_BLOCKSIZE,
        compress_statistics=DOUBLE_QUANT,
        quant_type="nf4",
        module=layer,
    )
    if linear.out_features % _CPU_PACK_ROWS or linear.in_features % NF4_BLOCKSIZE:
        layer.support_avx512bf16_for_cpu = False  # the AVX512-BF16 layout cannot hold this shape; generic kernel
    return _finish(layer, linear, device, dtype)


def _finish(layer: nn.Module, linear: nn.Linear, device: torch.device, dtype: torch.dtype) -> nn.Module:
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach().to("cpu", dtype), requires_grad=False)
    return layer.to(device).eval()  # bitsandbytes quantizes here


def _warm_up(layer: nn.Module, name: str, mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Run one row through a converted layer so it settles into its serving layout; a failure refuses the layer."""
    try:
        with torch.no_grad():
            layer(torch.ones(1, layer.in_features, device=device, dtype=dtype))
    except Exception as error:
        raise QuantizationUnsupportedError(
            f"layer {name} ({layer.in_features} -> {layer.out_features} features) does not run with --quant {mode} "
            f"on {device}: {type(error).__name__}: {error}; use --quant none"
        ) from error


def _quant_state(prefix: str, module: nn.Module) -> Iterator[tuple[str, torch.Tensor | str]]:
    """The quantization state a bitsandbytes layer holds outside its parameters: tensors, then a description."""
    weight = getattr(module, "weight", None)
    quant_state = getattr(weight, "quant_state", None)  # Linear4bit
    if quant_state is not None:
        nested, level = prefix + "weight.", quant_state
        while level is not None:
            for attribute in ("absmax", "code", "offset"):
                value = getattr(level, attribute, None)
                if isinstance(value, torch.Tensor):
                    yield nested + attribute, value
            nested, level = nested + "state2.", getattr(level, "state2", None)
        yield (
            prefix + "quant_state",
            (
                f"{type(module).__name__} {quant_state.quant_type} blocksize={quant_state.blocksize} "
                f"shape={tuple(quant_state.shape)} dtype={quant_state.dtype} nested={quant_state.nested} "
                f"cpu_layout={getattr(quant_state, 'packing_format_for_cpu', False)}"
            ),
        )
    state = getattr(module, "state", None)  # Linear8bitLt: the row scales move from the weight to the state
    if state is not None and hasattr(state, "SCB"):
        scales = getattr(weight, "SCB", None)
        scales = scales if scales is not None else state.SCB
        if isinstance(scales, torch.Tensor):
            yield prefix + "SCB", scales
        yield prefix + "matmul_state", f"{type(module).__name__} threshold={state.threshold}"


def _held(module: nn.Module) -> Iterator[tuple[str, torch.Tensor | str]]:
    """(name, tensor or description) for every parameter, buffer and quantization state of `module`, in order."""
    for prefix, sub in module.named_modules():
        prefix = prefix + "." if prefix else ""
        for name, tensor in sub.named_parameters(prefix=prefix[:-1], recurse=False):
            yield name, tensor
        for name, tensor in sub.named_buffers(prefix=prefix[:-1], recurse=False):
            yield name, tensor
        yield from _quant_state(prefix, sub)


def module_weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter, buffer and quantization state tensor `module` holds; shared tensors count once."""
    seen, total = set(), 0
    for _, value in _held(module):
        if isinstance(value, torch.Tensor):
            key = (value.device, value.data_ptr(), value.nbytes)
            if key not in seen:
                seen.add(key)
                total += value.nbytes
    return total


def quantized_state_digest(module: nn.Module) -> str:
    """sha256 (first 16 hex characters) over the names, dtypes, shapes and bytes of everything `module` serves with.

    Covers parameters, buffers and the bitsandbytes quantization state (scales, absmax, code tables, settings), so
    quantizing the same weights the same way gives the same digest and different modes give different digests.
    """
    digest = hashlib.sha256()
    for name, value in _held(module):
        if isinstance(value, str):
            digest.update(f"{name}={value};".encode())
            continue
        tensor = value.detach().as_subclass(torch.Tensor)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return digest.hexdigest()[:16]
