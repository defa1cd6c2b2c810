"""Activation sparsity of ReLU-family MLPs: compute only the FFN neurons a predictor expects to be non-zero.

Seed 002 (Comet, Yan et al., IEEE S&P 2025, section 1 and appendix C): in a ReLU model most FFN neurons output
exactly 0, so a small predictor that says in advance which ones will not lets a node skip their rows of gate/up and
their column of down (in private inference, their secure multiplications). A Llama-family MLP is
`down(act(gate x) * up x)`; with a ReLU-family `act` ("relu", "relu2", "relu6") neuron j of a token is exactly 0
whenever (gate x)_j <= 0. SiLU and GELU neurons are never exactly zero, so skipping one always changes the output:
refused with SparsityUnsupportedError, as are quantized projections (their weights cannot be gathered by row). OPT,
the paper's ReLU model, is not a family the loaders serve (sharding/blocks.py FAMILIES): here a ReLU model is a
Llama, Mistral or Qwen2 config with hidden_act "relu" (or a SiLU model switched to ReLU and fine-tuned, the paper's
"ReLUfication", as bench/sparsity.py does).

A selector maps an MLP and its input (tokens, hidden) to a mask (tokens, intermediate) of the neurons to compute:
`oracle_mask` (the true set, gate > 0: for tests and measurements), `all_neurons`, or a `LowRankPredictor`'s
`predict` (sigmoid(B A x) >= threshold, rank r; Deja Vu, Liu et al. ICML 2023, section 4.2). Two formulations:

- "masked": the dense projections, then the neurons outside each token's own mask set to 0 before down: what skipping
  per token computes, with no compute saved (it is the accuracy reference, and the plaintext of what an MPC protocol
  that skips the masked neurons outputs). With the oracle mask the result is bitwise equal to the layer's own
  forward: the same modules run on the same inputs, and the neurons masked out were exactly 0 already.
- "gather": the gate/up rows and down columns of the step's neurons are gathered and multiplied, so compute shrinks
  with the density. A one-token step (decode) uses that token's own set; a step of several tokens (prefill, batched
  decode) uses the union of its tokens' sets, because one gathered matmul serves every row: a neuron predicted for
  any token is computed for all, which is exact for the others (it is 0 there) but keeps the union's density.
  With the oracle mask this equals dense in exact arithmetic but not bitwise: the matmul kernels split the reduction
  over the intermediate dimension into blocks and SIMD lanes, and dropping the zero terms moves the remaining ones
  into other blocks and lanes, so their partial sums are rounded at other places (the zero terms themselves are
  exact). `rounding_bound` bounds the difference (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5);
  the tests hold the gather path to it.

`install_sparsity(span, selectors)` wraps each layer's `mlp.forward` (an instance attribute, so the weights, the
state dict and the weights hash are untouched) and `SparsityHandle.remove()` restores the class's forward. Nothing
is installed unless a caller asks: off by default. "gather" keeps a neuron-major copy of each down_proj weight
(`neuron_major_down`: a third more MLP weight memory), so the weights must not change while it is installed. A
projection with forward hooks (LoRA rows, sharding/lora_rows.py) runs the dense forward instead, since gathering its
weights would skip the hook; the handle counts those steps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from nesa_node.errors import SparsityUnsupportedError

logger = logging.getLogger(__name__)

# Activations whose output is exactly 0 for every input <= 0 (transformers' ACT2FN names).
RELU_FAMILY = frozenset({"relu", "relu2", "relu6"})
MODES = ("masked", "gather")
Selector = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (mlp, x (tokens, hidden)) -> (tokens, intermediate)


def check_relu_family(config) -> None:
    """Raise SparsityUnsupportedError unless the model's MLP activation is exactly 0 for inputs <= 0."""
    activation = getattr(config, "hidden_act", None)
    if activation not in RELU_FAMILY:
        raise SparsityUnsupportedError(
            f"activation sparsity needs a ReLU-family MLP ({', '.join(sorted(RELU_FAMILY))}); this model uses "
            f"{activation!r}, whose neurons are never exactly zero, so every skipped neuron would change the output"
        )


def _projections(mlp: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    names = ("gate_proj", "up_proj", "down_proj")
    modules = tuple(getattr(mlp, name, None) for name in names)
    for name, module in zip(names, modules, strict=True):
        if type(module) is not nn.Linear:  # bitsandbytes' Linear8bitLt / Linear4bit subclass nn.Linear: refused too
            raise SparsityUnsupportedError(
                f"the MLP's {name} is {type(module).__name__}, not a plain torch Linear: quantized (--quant) or "
                "non-Llama MLP weights cannot be gathered by neuron; serve the span unquantized"
            )
    return modules  # type: ignore[return-value]


def oracle_mask(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The neurons that are truly active: gate_proj(x) > 0, a bool (tokens, intermediate) for x (tokens, hidden)."""
    return mlp.gate_proj(x) > 0


def all_neurons(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every neuron: the dense computation, as a selector (bool (tokens, intermediate))."""
    return torch.ones(x.shape[0], mlp.gate_proj.out_features, dtype=torch.bool, device=x.device)


def masked_mlp(mlp: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The MLP of x (tokens, hidden) with each token's neurons outside `mask` (tokens, intermediate) set to 0.

    Bitwise equal to mlp(x) when mask covers every neuron with gate > 0 (module docstring)."""
    gate, up, down = _projections(mlp)
    hidden = mlp.act_fn(gate(x)) * up(x)  # (tokens, intermediate)
    return down(torch.where(mask, hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device)))


def gathered_mlp(
    mlp: nn.Module, x: torch.Tensor, neurons: torch.Tensor, down_by_neuron: torch.Tensor | None = None
) -> torch.Tensor:
    """The MLP of x (tokens, hidden) computed from the neurons `neurons` (k,) only, for every token.

    `down_by_neuron` is down_proj's weight neuron-major, (intermediate, hidden) contiguous (`neuron_major_down`): a
    one-token step then sums its k rows in place (embedding_bag) and a longer one gathers contiguous rows, instead of
    gathering k strided columns of down's (hidden, intermediate) weight (measured on one x86 core, 2048 x 5632 at 62%
    density: 0.7 ms against 3.6 ms for the columns' gather alone). Equal to mlp(x) within `rounding_bound` when
    `neurons` holds every neuron with gate > 0 for some token."""
    gate, up, down = _projections(mlp)
    gate_weight = gate.weight.index_select(0, neurons)  # (k, hidden)
    up_weight = up.weight.index_select(0, neurons)  # (k, hidden)
    gate_bias = None if gate.bias is None else gate.bias.index_select(0, neurons)
    up_bias = None if up.bias is None else up.bias.index_select(0, neurons)
    linear = nn.functional.linear
    hidden = mlp.act_fn(linear(x, gate_weight, gate_bias)) * linear(x, up_weight, up_bias)  # (tokens, k)
    if down_by_neuron is None:
        return linear(hidden, down.weight.index_select(1, neurons), down.bias)  # (tokens, hidden)
    if x.shape[0] == 1:  # sum_j h_j row_j over the k rows, read where they are; one bag (offsets [0]), maybe empty
        offsets = torch.zeros(1, dtype=neurons.dtype, device=neurons.device)
        output = nn.functional.embedding_bag(
            neurons, down_by_neuron, offsets, mode="sum", per_sample_weights=hidden[0]
        )  # (1, hidden)
    else:
        output = hidden @ down_by_neuron.index_select(0, neurons)  # (tokens, k) @ (k, hidden)
    return output if down.bias is None else output + down.bias  # (tokens, hidden)


def neuron_major_down(mlp: nn.Module) -> torch.Tensor:
    """A copy of down_proj's weight as (intermediate, hidden), contiguous: row j is neuron j's output column."""
    return _projections(mlp)[2].weight.detach().T.contiguous()


def rounding_bound(mlp: nn.Module, x: torch.Tensor, neurons: torch.Tensor) -> torch.Tensor:
    """Bound on |gathered_mlp(mlp, x, neurons) - mlp(x)| (tokens, hidden) when `neurons` covers the active set.

    First order in the unit roundoff u (2^-24 in float32), gamma(n) = n u / (1 - n u) (Higham eq. 3.5: a computed
    n-term dot product is within gamma(n) sum |terms| of the exact one, whatever the order): the gathered gate and
    up dot products may round differently from the dense ones, each within 2 gamma(hidden + 1) sum_d |x_d w_jd|,
    which moves h_j = act(g_j) u_j by at most dh_j (act is monotone, so |act(g') - act(g)| <= act(g + dg) -
    act(g - dg)), plus the rounding of the product on both sides; the down sums over k and over all neurons then
    round within gamma(k) and gamma(intermediate) of sum_j |h_j w_ij|. Computed in float64; the factor 1.01 covers
    the bound's own rounding."""
    gate, up, down = _projections(mlp)
    unit = torch.finfo(x.dtype).eps / 2
    x64 = x.double()

    def gamma(n: int) -> float:
        return n * unit / (1 - n * unit)

    def magnitude(linear: nn.Linear) -> torch.Tensor:  # sum_d |x_d w_jd| (+ |bias_j|): (tokens, intermediate)
        total = x64.abs() @ linear.weight.double().abs().T
        return total if linear.bias is None else total + linear.bias.double().abs()

    inner = gamma(x.shape[-1] + 1)
    gate_value, up_value = gate(x).double(), up(x).double()  # (tokens, intermediate)
    gate_error, up_error = 2 * inner * magnitude(gate), 2 * inner * magnitude(up)
    activation = mlp.act_fn(gate_value).abs()
    activation_error = mlp.act_fn(gate_value + gate_error) - mlp.act_fn(gate_value - gate_error)
    up_reach = up_value.abs() + up_error
    hidden_error = activation_error * up_reach + activation * up_error
    hidden_error = hidden_error + 2 * unit * (activation + activation_error) * up_reach  # the product's rounding
    hidden_reach = activation * up_value.abs() + hidden_error
    down_weight = down.weight.double().abs()  # (hidden, intermediate)
    sums = gamma(len(neurons)) + gamma(down.in_features)
    bound = sums * (hidden_reach @ down_weight.T) + hidden_error @ down_weight.T  # (tokens, hidden)
    return (1.01 * bound).to(x.dtype)


class LowRankPredictor(nn.Module):
    """Which neurons of one MLP will be active: logits = B(A x) with A (rank, hidden), B (intermediate, rank) + bias.

    `predict(mlp, x)` -> bool (tokens, intermediate), logits >= `threshold_logit` (a buffer, so the state dict holds
    it: the logit of the probability threshold; `train_predictor` calibrates it for a recall target). Cost per token:
    rank (hidden + intermediate) multiply-adds against the MLP's 3 hidden intermediate."""

    def __init__(self, hidden: int, intermediate: int, rank: int, *, generator: torch.Generator | None = None):
        super().__init__()
        self.to_rank = nn.Linear(hidden, rank, bias=False)  # A: (rank, hidden)
        self.to_neurons = nn.Linear(rank, intermediate)  # B: (intermediate, rank)
        with torch.no_grad():  # nn.Linear's default init, drawn from `generator` for a reproducible predictor
            self.to_rank.weight.uniform_(-(hidden**-0.5), hidden**-0.5, generator=generator)
            self.to_neurons.weight.uniform_(-(rank**-0.5), rank**-0.5, generator=generator)
            self.to_neurons.bias.zero_()
        self.register_buffer("threshold_logit", torch.zeros(()))  # probability 0.5 until calibrated

    @property
    def threshold(self) -> float:
        """The probability threshold: a neuron is predicted active when sigmoid(logit) >= it."""
        return torch.sigmoid(self.threshold_logit.float()).item()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_neurons(self.to_rank(x))  # (..., intermediate) logits

    def predict(self, mlp: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        """The selector: bool (tokens, intermediate), True for the neurons predicted active (`mlp` is unused)."""
        return self(x) >= self.threshold_logit


@dataclass(frozen=True)
class PredictorConfig:
    # Measured on the ReLU-fine-tuned tiny Llama of bench/sparsity.py (hidden 128, 384 neurons, 4096 training tokens),
    # held-out precision at the 0.99 recall target: rank 16 0.64, 32 0.81, 64 0.93; rank 32 keeps the fewest
    # multiply-adds per token (predictor plus kept neurons). Steps 200 / 400 / 800: 0.807 / 0.813 / 0.815. Learning
    # rate 3e-3 / 1e-2 / 3e-2: 0.804 / 0.813 / 0.806.
    rank: int = 32
    steps: int = 400  # Adam steps
    batch: int = 512  # tokens per step
    learning_rate: float = 1e-2  # Adam
    target_recall: float = 0.99  # threshold chosen so this share of the training tokens' active neurons is kept
    seed: int = 0  # initialisation and batch order


@dataclass(frozen=True)
class PredictionMetrics:
    recall: float  # of the truly active (token, neuron) pairs, the share predicted active: a miss changes the output
    precision: float  # of the pairs predicted active, the share truly active: the rest is wasted compute
    predicted_density: float  # share of all pairs predicted active: the compute kept per token
    true_density: float  # share truly active: what a perfect predictor keeps
    tokens: int


def prediction_metrics(predicted: torch.Tensor, actual: torch.Tensor) -> PredictionMetrics:
    """Recall, precision and densities of `predicted` against `actual`, both bool (tokens, intermediate)."""
    hits = (predicted & actual).sum().item()
    positives, predictions = actual.sum().item(), predicted.sum().item()
    return PredictionMetrics(
        recall=hits / positives if positives else 1.0,
        precision=hits / predictions if predictions else 1.0,
        predicted_density=predictions / max(predicted.numel(), 1),
        true_density=positives / max(actual.numel(), 1),
        tokens=predicted.shape[0],
    )


def calibrate_threshold(predictor: LowRankPredictor, x: torch.Tensor, labels: torch.Tensor, recall: float) -> float:
    """Set and return the highest logit threshold that keeps at least `recall` of the active neurons in `labels`
    (bool (tokens, intermediate)) of the inputs x (tokens, hidden)."""
    if not 0.0 < recall <= 1.0:
        raise ValueError(f"recall must be in (0, 1], got {recall}")
    with torch.no_grad():
        positive_logits = predictor(x)[labels].sort().values  # (positives,)
    allowed_misses = math.floor((1.0 - recall) * len(positive_logits))
    threshold = positive_logits[allowed_misses].item() if len(positive_logits) else 0.0
    predictor.threshold_logit.fill_(threshold)
    return threshold


def train_predictor(
    x: torch.Tensor, labels: torch.Tensor, config: PredictorConfig = PredictorConfig()
) -> LowRankPredictor:
    """A predictor of `labels` (bool (tokens, intermediate), gate > 0) from the MLP inputs x (tokens, hidden),
    trained with binary cross-entropy and Adam, its threshold calibrated to `config.target_recall` on the same tokens.

    Deterministic for a given config on one machine (same torch version and thread count): the initialisation and
    the batches come from one torch.Generator seeded with `config.seed`; the caller's global RNG is not touched."""
    if x.shape[0] != labels.shape[0] or x.shape[0] == 0:
        raise ValueError(f"inputs {tuple(x.shape)} and labels {tuple(labels.shape)} must have the same tokens, > 0")
    generator = torch.Generator().manual_seed(config.seed)
    with torch.inference_mode(False), torch.enable_grad():  # a caller's inference mode would forbid training
        x = x.detach().float().cpu().clone()  # (tokens, hidden); cloned here: a normal tensor, not an inference one
        targets = labels.float().cpu()  # (tokens, intermediate)
        predictor = LowRankPredictor(x.shape[1], labels.shape[1], config.rank, generator=generator)
        with torch.no_grad():  # start from each neuron's base rate: the first steps then learn the input's part
            rate = targets.mean(0).clamp(1e-4, 1 - 1e-4)
            predictor.to_neurons.bias.copy_(torch.log(rate / (1 - rate)))
        optimizer = torch.optim.Adam(predictor.parameters(), lr=config.learning_rate)
        for _ in range(config.steps):
            rows = torch.randint(0, x.shape[0], (min(config.batch, x.shape[0]),), generator=generator)
            loss = nn.functional.binary_cross_entropy_with_logits(predictor(x[rows]), targets[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    predictor.requires_grad_(False).eval()
    calibrate_threshold(predictor, x, labels.cpu(), config.target_recall)
    return predictor


def record_mlp_inputs(span: nn.Module, inputs: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer of `span` (a BlockSpan), the inputs its MLP saw (tokens, hidden) while the span ran on each hidden
    state of `inputs` (batch, seq, hidden) as a prefill (no cache), concatenated in order."""
    recorded: list[list[torch.Tensor]] = [[] for _ in span.layers]
    handles = []
    for index, layer in enumerate(span.layers):
        hook = _recorder(recorded[index])
        handles.append(layer.mlp.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            for hidden in inputs:
                span(hidden)
    finally:
        for handle in handles:
            handle.remove()
    return [torch.cat(parts) for parts in recorded]


def _recorder(into: list[torch.Tensor]):
    def hook(module: nn.Module, args: tuple) -> None:
        into.append(args[0].reshape(-1, args[0].shape[-1]).detach().clone())

    return hook


@dataclass
class LayerSparsityStats:
    """What one installed layer computed, summed over its steps (mutable, updated by every forward)."""

    steps: int = 0
    tokens: int = 0
    selected: int = 0  # (token, neuron) pairs the selector chose: per-token density = selected / (tokens * width)
    computed: int = 0  # (token, neuron) pairs computed: the union's size times the step's tokens in "gather" mode
    width: int = 0  # intermediate size
    dense_fallbacks: int = 0  # steps run dense because a projection had forward hooks (LoRA)

    @property
    def computed_density(self) -> float:
        return self.computed / max(self.tokens * self.width, 1)

    @property
    def selected_density(self) -> float:
        return self.selected / max(self.tokens * self.width, 1)


@dataclass
class SparsityHandle:
    """The layers `install_sparsity` wrapped; `remove()` restores their dense forward (idempotent). `stats` holds one
    entry per wrapped layer, in the span's order (layers given no selector have none)."""

    mlps: list[nn.Module]
    mode: str
    stats: list[LayerSparsityStats] = field(default_factory=list)

    def remove(self) -> None:
        for mlp in self.mlps:
            mlp.__dict__.pop("forward", None)
        self.mlps = []


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _sparse_forward(
    mlp: nn.Module,
    selector: Selector,
    mode: str,
    stats: LayerSparsityStats,
    down_by_neuron: torch.Tensor | None,
    x: torch.Tensor,
):
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(_hooked(module) for module in projections):  # a hook (LoRA) would be skipped by gathered weights
        stats.dense_fallbacks += 1
        stats.steps += 1
        return type(mlp).forward(mlp, x)
    flat = x.reshape(-1, x.shape[-1])  # (tokens, hidden)
    mask = selector(mlp, flat)  # (tokens, intermediate)
    if mode == "masked":
        output, computed = masked_mlp(mlp, flat, mask), mask.numel()
    else:
        neurons = mask.any(0).nonzero().squeeze(1)  # (k,) ascending: the union over the step's tokens
        output = gathered_mlp(mlp, flat, neurons, down_by_neuron)
        computed = len(neurons) * flat.shape[0]
    stats.steps += 1
    stats.tokens += flat.shape[0]
    stats.selected += int(mask.sum())
    stats.computed += computed
    return output.reshape(*x.shape[:-1], output.shape[-1])  # (..., hidden)


def install_sparsity(span: nn.Module, selectors: Sequence[Selector | None], *, mode: str = "gather") -> SparsityHandle:
    """Make each layer i of `span` (a BlockSpan) compute its MLP from the neurons `selectors[i]` picks (None: that
    layer stays dense). A LowRankPredictor may be passed for its `predict`; it is moved to the MLP's device and dtype.

    Raises SparsityUnsupportedError for a model without a ReLU-family activation or with quantized MLP weights,
    ValueError for a wrong number of selectors, an unknown mode, or a layer already wrapped."""
    check_relu_family(span.config)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if len(selectors) != len(span.layers):
        raise ValueError(f"{len(selectors)} selectors for a span of {len(span.layers)} layers")
    chosen = []
    for layer, selector in zip(span.layers, selectors, strict=True):
        if selector is None:
            continue
        gate, _, _ = _projections(layer.mlp)
        if "forward" in layer.mlp.__dict__:
            raise ValueError("a layer's MLP forward is already wrapped; remove the other installation first")
        if isinstance(selector, LowRankPredictor):
            selector.to(device=gate.weight.device, dtype=gate.weight.dtype)
            selector = selector.predict
        chosen.append((layer.mlp, selector, gate.out_features))
    handle = SparsityHandle(mlps=[], mode=mode)
    for mlp, selector, width in chosen:
        stats = LayerSparsityStats(width=width)
        down_by_neuron = neuron_major_down(mlp) if mode == "gather" else None
        mlp.forward = functools.partial(_sparse_forward, mlp, selector, mode, stats, down_by_neuron)
        handle.mlps.append(mlp)
        handle.stats.append(stats)
    logger.debug("activation sparsity (%s) on %d of %d layers", mode, len(chosen), len(span.layers))
    return handle


@contextlib.contextmanager
def sparse_span(
    span: nn.Module, selectors: Sequence[Selector | None], *, mode: str = "gather"
) -> Iterator[SparsityHandle]:
    """`install_sparsity` for the duration of the block; the dense forward is restored on exit, error or not."""
    handle = install_sparsity(span, selectors, mode=mode)
    try:
        yield handle
    finally:
        handle.remove()
