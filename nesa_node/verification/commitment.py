"""A compact commitment to a window of hidden states, its check against a re-execution, and a window's input hash.

A node commits, for every 32-token window of a session and every hop, to the output of its span *before* the wire
codec; an auditor re-executes the span on the same input (its hash is in the hop record) and checks the commitment
against the tensor it got. The commitment holds two parts, both over the window's elements in token-major order
(element index = (token * batch + row) * hidden + channel):

- top-k (TOPLOC, Ong et al. 2025, sec. 3): the k largest-magnitude elements, their indices (sorted, delta-coded as
  LEB128 varints) and values (float16, relative to the window's scale). The check wants most of the k indices in the
  re-executed top-k and every value within a relative tolerance (exponent and mantissa close). Deviation: TOPLOC
  interpolates a polynomial through the values to drop the indices; delta-coded indices cost ~2 bytes each at k=16
  and keep the decoder trivial to bound.
- sketch: m random +-1 projections of the window (a Johnson-Lindenstrauss sketch): sketch_j = sum over rows r and
  channels c of P[j, c] * S[r, c] * h[r, c] / sqrt(rows * hidden), with sign tables P and S expanded from SHAKE-256
  (the same on every machine). For an error e the mean of (sketch'_j - sketch_j)^2 estimates rms(e)^2, so the
  sketch measures the relative RMS error of the whole window from m numbers. Why it is there: the top-k values
  are the window's largest, several times its RMS, so 1% RMS noise moves each by only ~0.3% of itself, as much as
  the rounding of a re-execution does; the estimate over all elements separates them (tiny Llamas, 640 windows:
  float16 re-execution <= 0.0011, 1% noise >= 0.0067; see Tolerance). More projections do not help: at m = 96 and
  128 the spread between windows, not the estimate's, dominated. Like top-k, the sketch is public: a node that
  computed the honest output could hide changes from both parts, so they catch skipped or substituted
  computation, not a node that computes and then sabotages.

Encoding (version 1, little-endian): u8 version, u16 batch, u16 tokens, u32 hidden, u8 k, u8 m, f32 scale (RMS of
the window), m x f16 sketch / scale, k varint index gaps, k x f16 value / scale: 15 + 2 m + 2 k bytes and 1-3 per
index. At the defaults (k=16, m=64) a 32-token window of batch 1 takes 198 bytes at hidden size 64, 210 at 4096.

API for a node (a copy per step; one pass over the window and one (m, hidden) product at its end):
    committer = WindowCommitter(hidden_size)       # per session, hop and window
    committer.add(output)                          # (batch, tokens, hidden) of each step, before the codec
    commitment = committer.finish()                # WindowCommitment; .to_bytes() goes in the HopRecord
    hasher = InputHasher(); hasher.update(step_input); hasher.digest()   # the record's input hash
`commit_window(hidden)` and `input_hash(hidden)` are the one-shot forms. An auditor: `compare(commitment, hidden,
tolerance)` (a MatchReport with every statistic) or `matches(...)`; `WindowCommitment.from_bytes` raises ReceiptError
for anything a hostile peer may send that is not a canonical version-1 commitment.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import sys
from dataclasses import dataclass

import numpy as np
import torch

from nesa_node.errors import ReceiptError

VERSION = 1
WINDOW_TOKENS = 32  # tokens per committed window (TOPLOC's chunk size)
DEFAULT_TOPK = 16  # top-k entries: ~4 bytes each; 16 keeps the defaults at ~200 bytes (budget 300 per window)
DEFAULT_SKETCH = 64  # projections: the RMS-error estimate has relative spread ~1/sqrt(2 m) = 9% at 64
MAX_ELEMENTS = 1 << 32  # batch * tokens * hidden a commitment may describe (indices are varints of 5 bytes at most)

_HEADER = struct.Struct("<BHHIBBf")  # version, batch, tokens, hidden, k, m, scale
_SIGNS_DOMAIN = b"nesa-commitment-row-signs-v1\x00"
_PROJECTION_DOMAIN = b"nesa-commitment-projection-v1\x00"
_INPUT_DOMAIN = b"nesa-window-input-v1\x00"


@dataclass(frozen=True)
class WindowCommitment:
    """The committed window: shape, scale (RMS of all elements, float32), the sketch and the top-k entries.

    `sketch` and `values` are relative to `scale` and float16-exact; `indices` are sorted, unique and below
    batch * tokens * hidden (token-major order, see the module docstring)."""

    batch: int
    tokens: int
    hidden: int
    scale: float
    sketch: tuple[float, ...]
    indices: tuple[int, ...]
    values: tuple[float, ...]

    def to_bytes(self) -> bytes:
        """The canonical version-1 encoding (the only one `from_bytes` accepts for this commitment)."""
        out = bytearray(
            _HEADER.pack(VERSION, self.batch, self.tokens, self.hidden, len(self.indices), len(self.sketch), self.scale)
        )
        out += np.asarray(self.sketch, dtype="<f2").tobytes()
        previous = -1
        for index in self.indices:
            out += _varint(index - previous - 1)
            previous = index
        out += np.asarray(self.values, dtype="<f2").tobytes()
        return bytes(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> WindowCommitment:
        """Decode a commitment; raises ReceiptError for a wrong version, out-of-range shape or index, non-finite
        numbers, trailing bytes or a non-canonical encoding."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ReceiptError(f"a commitment must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEADER.size:
            raise ReceiptError(f"commitment of {len(data)} bytes is shorter than its {_HEADER.size}-byte header")
        version, batch, tokens, hidden, k, m, scale = _HEADER.unpack_from(data)
        if version != VERSION:
            raise ReceiptError(f"commitment version {version}; this node reads version {VERSION}")
        elements = batch * tokens * hidden
        if min(batch, tokens, hidden) < 1 or elements > MAX_ELEMENTS:
            raise ReceiptError(f"commitment shape ({batch}, {tokens}, {hidden}) is empty or over {MAX_ELEMENTS}")
        if k > elements:
            raise ReceiptError(f"commitment has {k} top entries for a window of {elements} elements")
        if not math.isfinite(scale) or scale < 0:
            raise ReceiptError(f"commitment scale {scale} is not a finite non-negative number")
        position = _HEADER.size
        sketch, position = _read_halves(data, position, m, "sketch")
        indices = []
        previous = -1
        for _ in range(k):
            gap, position = _read_varint(data, position)
            previous = previous + 1 + gap
            if previous >= elements:
                raise ReceiptError(f"commitment index {previous} is outside the window's {elements} elements")
            indices.append(previous)
        values, position = _read_halves(data, position, k, "values")
        if position != len(data):
            raise ReceiptError(f"commitment has {len(data) - position} bytes after its end")
        commitment = cls(batch, tokens, hidden, scale, sketch, tuple(indices), values)
        if commitment.to_bytes() != data:  # non-minimal varints, -0.0 or other second spellings of one commitment
            raise ReceiptError("commitment is not in canonical form")
        return commitment


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 35, 7):
        if position >= len(data):
            raise ReceiptError("commitment ends inside an index")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
    raise ReceiptError("commitment index gap is longer than 5 bytes")


def _read_halves(data: bytes, position: int, count: int, what: str) -> tuple[tuple[float, ...], int]:
    end = position + 2 * count
    if end > len(data):
        raise ReceiptError(f"commitment ends inside its {what}")
    numbers = np.frombuffer(data[position:end], dtype="<f2")
    if not np.isfinite(numbers).all():
        raise ReceiptError(f"commitment {what} hold a non-finite number")
    if np.signbit(numbers[numbers == 0]).any():
        raise ReceiptError(f"commitment {what} hold -0.0 (the canonical zero is +0.0)")
    return tuple(float(number) for number in numbers), end


# -- sign tables: expanded from SHAKE-256, so every machine, torch and numpy version draws the same ones ----------


def _sign_bits(domain: bytes, hidden: int, rows: int) -> np.ndarray:
    """(rows, hidden) float32 of +-1: bit i of SHAKE-256(domain || hidden) gives element i (a prefix of a longer
    table is the shorter table, so tables grow without changing)."""
    stream = hashlib.shake_256(domain + struct.pack("<I", hidden)).digest((rows * hidden + 7) // 8)
    bits = np.unpackbits(np.frombuffer(stream, dtype=np.uint8), bitorder="little")[: rows * hidden]
    return (1.0 - 2.0 * bits.astype(np.float32)).reshape(rows, hidden)


@functools.lru_cache(maxsize=16)
def _row_signs(hidden: int, rows: int, device: str) -> torch.Tensor:
    return torch.from_numpy(_sign_bits(_SIGNS_DOMAIN, hidden, rows)).to(device)  # (rows, hidden)


@functools.lru_cache(maxsize=16)
def _projection(hidden: int, m: int, device: str) -> torch.Tensor:
    return torch.from_numpy(_sign_bits(_PROJECTION_DOMAIN, hidden, m)).to(device)  # (m, hidden)


def _signs_for_rows(hidden: int, end: int, device: torch.device) -> torch.Tensor:
    rows = max(WINDOW_TOKENS, 1 << (end - 1).bit_length())  # cached tables by powers of two
    return _row_signs(hidden, rows, str(device))


class WindowCommitter:
    """Collects one window's outputs step by step (on their device) and yields its WindowCommitment.

    `add` keeps a copy of each step's output (batch, tokens, hidden), in order; the batch size is fixed by the first
    step. All the work is in `finish`, once per window: per-step work was measured at ~40 us of torch call overhead
    per decode step, 14% of a tiny model's 276 us step, while a copy is ~2 us. Memory: the window's outputs, e.g.
    256 KiB for 32 tokens of hidden size 4096 in bfloat16."""

    def __init__(self, hidden: int, *, topk: int = DEFAULT_TOPK, sketch: int = DEFAULT_SKETCH):
        if not 0 <= topk <= 255 or not 0 <= sketch <= 255 or hidden < 1:
            raise ValueError(f"need hidden >= 1 and 0 <= topk, sketch <= 255, got {hidden}, {topk}, {sketch}")
        self.hidden, self.k, self.m = hidden, topk, sketch
        self.batch: int | None = None
        self.tokens = 0
        self._steps: list[torch.Tensor] = []

    def add(self, output: torch.Tensor) -> None:
        """Keep the next step's output (batch, tokens, hidden); raises ValueError for another shape."""
        if output.dim() != 3 or output.shape[2] != self.hidden or output.shape[1] < 1:
            raise ValueError(f"expected (batch, tokens, {self.hidden}), got {tuple(output.shape)}")
        if self.batch is None:
            self.batch = output.shape[0]
        elif output.shape[0] != self.batch:
            raise ValueError(f"batch {output.shape[0]} after steps of batch {self.batch}")
        self._steps.append(output.detach().clone())  # a copy: the caller may reuse or change its buffer
        self.tokens += output.shape[1]

    def finish(self) -> WindowCommitment:
        """The commitment to everything added; raises ValueError when nothing was added, the window is over the
        format's bounds, or it holds nan or inf (a node must not send such output: RELIABILITY E)."""
        if self.batch is None:
            raise ValueError("no output was added to this window")
        elements = self.batch * self.tokens * self.hidden
        if self.batch > 0xFFFF or self.tokens > 0xFFFF or elements > MAX_ELEMENTS:
            raise ValueError(f"window ({self.batch}, {self.tokens}, {self.hidden}) is over the commitment's bounds")
        window = self._steps[0] if len(self._steps) == 1 else torch.cat(self._steps, dim=1)  # (batch, tokens, hidden)
        rows = _token_major_rows(window)
        scale, sketch = _scale_and_sketch(rows, self.m)
        flat = rows.reshape(-1)  # (tokens * batch * hidden,)
        top = torch.topk(flat.abs(), min(self.k, flat.numel())).indices
        top = torch.sort(top).values
        values = flat[top].cpu()
        if not math.isfinite(scale) or not torch.isfinite(sketch).all() or not torch.isfinite(values).all():
            raise ValueError("the window holds nan or inf")
        divisor = scale if scale > 0 else 1.0
        return WindowCommitment(
            batch=self.batch,
            tokens=self.tokens,
            hidden=self.hidden,
            scale=scale,
            sketch=_halves(sketch / divisor),
            indices=tuple(top.tolist()),
            values=_halves(values / divisor),
        )


def _token_major_rows(window: torch.Tensor) -> torch.Tensor:
    """(tokens * batch, hidden) float32 rows of a window (batch, tokens, hidden), row index token * batch + row."""
    return window.detach().to(torch.float32).transpose(0, 1).reshape(-1, window.shape[-1])


def _scale_and_sketch(rows: torch.Tensor, m: int) -> tuple[float, torch.Tensor]:
    """(float32-exact RMS of the rows, (m,) float32 sketch on the host)."""
    count, hidden = rows.shape
    signs = _signs_for_rows(hidden, count, rows.device)[:count]  # (rows, hidden)
    mixed = (rows * signs).sum(0)  # (hidden,)
    scale = float(np.float32(math.sqrt(float(rows.double().pow(2).mean()))))
    projection = _projection(hidden, m, str(rows.device))  # (m, hidden)
    sketch = (projection @ mixed / math.sqrt(rows.numel())).cpu()  # (m,)
    return scale, sketch


def _halves(numbers: torch.Tensor) -> tuple[float, ...]:
    halves = numbers.to(torch.float16)
    if not torch.isfinite(halves).all():
        raise ValueError("a committed number is out of float16's range")
    return tuple(float(number) for number in halves + 0.0)  # + 0.0: -0.0 becomes 0.0, one spelling of zero


def commit_window(hidden: torch.Tensor, *, topk: int = DEFAULT_TOPK, sketch: int = DEFAULT_SKETCH) -> WindowCommitment:
    """The commitment to a whole window `hidden` (batch, tokens, hidden): the same as adding it in steps."""
    committer = WindowCommitter(hidden.shape[-1], topk=topk, sketch=sketch)
    committer.add(hidden)
    return committer.finish()


# -- the auditor's check -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """How far a re-execution may be from the committed output and still match.

    The defaults are for a node and an auditor both in float32 or float16 (either way round; TF32 errs like float16).
    Measured on two tiny Llamas (hidden 64 random, 128 trained), spans 0:2, 2:4, 1:3 and 0:4, 640 windows of 32
    tokens: honest float16 against float32 has sketch error <= 0.0011 (640/640 match), 1% RMS noise >= 0.0067 and
    0.5% noise >= 0.0034 (0/640 match). bfloat16 on either side errs nearly as much as 1% noise (sketch error up to
    0.0090 on 4 blocks), so BFLOAT16_TOLERANCE accepts that (640/640 honest windows match) and catches 1% noise in
    only 340/640 windows; a session of many windows still shows it. Spans of many blocks err more: calibrate with
    `compare` on honest windows of the model before auditing it, and pick with `tolerance_for`."""

    sketch: float = 0.003  # estimated relative RMS error of the window (measured: honest float16 <= 0.0011)
    scale: float = 0.005  # relative error of the window's RMS (measured: honest float16 <= 0.0002)
    overlap: float = 0.75  # committed indices that must be among the re-executed top-k (measured: honest >= 15/16)
    value: float = 0.01  # relative error of each committed value (measured: honest float16 <= 0.0024)
    min_topk: int = DEFAULT_TOPK  # fewer top entries or projections than these is a mismatch: a node cannot opt out
    min_sketch: int = DEFAULT_SKETCH


DEFAULT_TOLERANCE = Tolerance()
# bfloat16 on either side (measured, same windows: sketch <= 0.0090, scale <= 0.002, overlap >= 14/16, value <= 0.017)
BFLOAT16_TOLERANCE = Tolerance(sketch=0.011, scale=0.02, value=0.05)


def tolerance_for(node_dtype: str, audit_dtype: str) -> Tolerance:
    """The calibrated tolerance for a node computing in `node_dtype` audited by a re-execution in `audit_dtype`
    (torch dtype names: float32, float16, bfloat16)."""
    return BFLOAT16_TOLERANCE if "bfloat16" in (node_dtype, audit_dtype) else DEFAULT_TOLERANCE


@dataclass(frozen=True)
class MatchReport:
    """The statistics of one check and whether they are within tolerance; `reasons` names each one that is not."""

    matches: bool
    reasons: tuple[str, ...]
    sketch_error: float  # estimated rms(re-executed - committed) / rms(re-executed)
    scale_error: float  # |rms re-executed - committed scale| / rms re-executed
    overlap: int  # committed indices among the re-executed top-k
    value_error: float  # largest relative error of a committed value


def compare(
    commitment: WindowCommitment, hidden: torch.Tensor, tolerance: Tolerance = DEFAULT_TOLERANCE
) -> MatchReport:
    """Check `commitment` against a re-executed window `hidden` (batch, tokens, hidden), in any float dtype."""
    shape = (commitment.batch, commitment.tokens, commitment.hidden)
    if tuple(hidden.shape) != shape:
        return MatchReport(
            False, (f"shape {tuple(hidden.shape)} is not the committed {shape}",), math.inf, math.inf, 0, math.inf
        )
    k, m = len(commitment.indices), len(commitment.sketch)
    reasons = []
    if k < tolerance.min_topk or m < tolerance.min_sketch:
        reasons.append(
            f"commitment has {k} top entries and {m} projections, fewer than {tolerance.min_topk}, {tolerance.min_sketch}"
        )
    rows = _token_major_rows(hidden)  # (tokens * batch, hidden)
    scale, sketch = _scale_and_sketch(rows, m)
    floor = max(scale, 1e-30)
    committed_sketch = torch.tensor(commitment.sketch, dtype=torch.float32) * commitment.scale
    sketch_error = float((sketch - committed_sketch).pow(2).mean().sqrt()) / floor if m else 0.0
    scale_error = abs(scale - commitment.scale) / floor
    flat = rows.reshape(-1).cpu()
    top = set(torch.topk(flat.abs(), k).indices.tolist()) if k else set()
    overlap = len(top.intersection(commitment.indices))
    if k:
        recomputed = flat[torch.tensor(commitment.indices)]
        committed = torch.tensor(commitment.values, dtype=torch.float32) * commitment.scale
        denominator = torch.maximum(committed.abs(), recomputed.abs()).clamp_min(1e-30)
        value_error = float(((recomputed - committed).abs() / denominator).max())
    else:
        value_error = 0.0
    if not sketch_error <= tolerance.sketch:  # `not <=`: a nan statistic is a mismatch
        reasons.append(f"sketch error {sketch_error:.4g} > {tolerance.sketch}")
    if not scale_error <= tolerance.scale:
        reasons.append(f"scale error {scale_error:.4g} > {tolerance.scale}")
    if overlap < math.ceil(tolerance.overlap * k):
        reasons.append(f"top-k overlap {overlap}/{k} < {tolerance.overlap:.0%}")
    if not value_error <= tolerance.value:
        reasons.append(f"value error {value_error:.4g} > {tolerance.value}")
    return MatchReport(not reasons, tuple(reasons), sketch_error, scale_error, overlap, value_error)


def matches(commitment: WindowCommitment, hidden: torch.Tensor, tolerance: Tolerance = DEFAULT_TOLERANCE) -> bool:
    """Whether a re-executed window `hidden` is within `tolerance` of the committed output (see `compare`)."""
    return compare(commitment, hidden, tolerance).matches


# -- the input hash ------------------------------------------------------------------------------------------------


class InputHasher:
    """SHA-256 of a window's input, fed step by step: the same digest as `input_hash` of the whole window.

    Canonical encoding: domain || each step's elements in token-major order, little-endian || a trailer of the dtype
    name, batch, tokens and hidden size (the trailer, so that steps can be hashed as they come)."""

    def __init__(self):
        self._sha = hashlib.sha256(_INPUT_DOMAIN)
        self._dtype: torch.dtype | None = None
        self._batch = self._hidden = self._tokens = 0

    def update(self, step: torch.Tensor) -> None:
        """Hash the next step's input (batch, tokens, hidden); dtype, batch and hidden size are fixed by the first."""
        if step.dim() != 3:
            raise ValueError(f"expected (batch, tokens, hidden), got {tuple(step.shape)}")
        if self._dtype is None:
            self._dtype, self._batch, self._hidden = step.dtype, step.shape[0], step.shape[2]
        elif (step.dtype, step.shape[0], step.shape[2]) != (self._dtype, self._batch, self._hidden):
            raise ValueError(f"step {step.dtype} {tuple(step.shape)} after steps of {self._dtype} batch {self._batch}")
        token_major = step.detach().transpose(0, 1).contiguous().cpu()  # (tokens, batch, hidden)
        data = token_major.view(torch.uint8).numpy()  # the elements' bytes, host order
        if sys.byteorder != "little":
            data = data.reshape(-1, token_major.element_size())[:, ::-1]
        self._sha.update(data.tobytes())
        self._tokens += step.shape[1]

    def digest(self) -> bytes:
        """The 32-byte digest; raises ValueError when nothing was hashed."""
        if self._dtype is None:
            raise ValueError("no input was hashed")
        sha = self._sha.copy()
        sha.update(str(self._dtype).removeprefix("torch.").encode() + b"\x00")
        sha.update(struct.pack("<QQQ", self._batch, self._tokens, self._hidden))
        return sha.digest()


def input_hash(window: torch.Tensor) -> bytes:
    """SHA-256 of a window's input (batch, tokens, hidden): dtype, shape and little-endian elements (InputHasher)."""
    hasher = InputHasher()
    hasher.update(window)
    return hasher.digest()
