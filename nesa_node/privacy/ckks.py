"""CKKS demo mode: a server computes chosen decoder layers' linear maps on encrypted hidden states; the client,
which alone holds the secret key, does everything nonlinear (seed 003's split: TenSEAL CKKS, four round trips per
layer).

Per encrypted layer and step, for the step's new tokens (one ciphertext per token, each round one request):
1. the client normalizes (RMSNorm) and encrypts; the server returns Enc(x Wq | x Wk | x Wv) (one fused product);
2. the client decrypts, applies the rotary embedding, attends over its own key/value cache, encrypts; the server
   returns Enc(a Wo);
3. the client adds the residual, normalizes, encrypts; the server returns Enc(x Wgate | x Wup);
4. the client applies act(gate) * up, encrypts; the server returns Enc(m Wdown); the client adds the residual.
Biases, when a layer has them, are added by the client after decrypting. Layers not encrypted run in plaintext on
the client (`load_block_span`), as do the embeddings, final norm and LM head.

The server side (`CkksLinearServer`, in a process of its own with `CkksServerProcess`) is built from bytes only: the client's serialized context *without* its
secret key, and ciphertexts; it cannot decrypt (TenSEAL raises), and it refuses a context that holds a secret key.
A product wider than the ciphertext's slot count (poly_modulus_degree / 2) is refused with CkksError instead of
being wrapped silently. CKKS is approximate: each product adds an error near 1e-7 of the values at the default
scale 2^40 (measured in tests/unit/test_ckks.py); greedy tokens then match plaintext on the tiny models.

This is a demonstration of the protocol, with its cost: every product costs tenths of a second on a CPU, and the
public context with its Galois keys is tens of MB. TenSEAL is an optional extra (`nesa-node[ckks]`).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from nesa_node.errors import CkksError
from nesa_node.sharding.blocks import LAYER_PREFIX, SafetensorsIndex, SpanSpec, load_block_span, load_config

POLY_MODULUS_DEGREE = 8192  # 4096 slots per ciphertext
COEFF_MOD_BIT_SIZES = (60, 40, 40, 60)  # one product per fresh ciphertext needs one level
GLOBAL_SCALE = 2**40
OPS = ("qkv", "o", "gate_up", "down")  # the four products of a layer, in order


def _tenseal():
    try:
        import tenseal
    except ImportError:
        raise CkksError("the CKKS demo needs TenSEAL: pip install 'nesa-node[ckks]'") from None
    return tenseal


def _linear_weights(model_path: str | Path, layer: int) -> dict[str, torch.Tensor]:
    """The seven projection weights (and biases) of decoder layer `layer`, float64, (out, in)."""
    index = SafetensorsIndex(model_path)
    prefix = LAYER_PREFIX.format(index=layer)
    names = [name for name in index.names_with_prefix(prefix) if "_proj." in name]
    return {name[len(prefix) :]: tensor.to(torch.float64) for name, tensor in index.read(names).items()}


class CkksLinearServer:
    """The server of the demo: the linear maps of `layers`, applied to ciphertexts under a public context."""

    def __init__(self, model_path: str | Path, layers: tuple[int, ...], public_context: bytes):
        ts = _tenseal()
        self.context = ts.context_from(public_context)
        if self.context.is_private():
            raise CkksError(
                "the context sent to the server holds a secret key: send it without (save_secret_key=False)"
            )
        self.slots = POLY_MODULUS_DEGREE // 2
        self.matrices: dict[tuple[int, str], np.ndarray] = {}  # (layer, op) -> (in, out) float64
        for layer in layers:
            weights = _linear_weights(model_path, layer)
            fused = {
                "qkv": torch.cat([weights[f"self_attn.{name}_proj.weight"] for name in "qkv"]),
                "o": weights["self_attn.o_proj.weight"],
                "gate_up": torch.cat([weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"]]),
                "down": weights["mlp.down_proj.weight"],
            }
            for op, matrix in fused.items():  # matrix (out, in)
                if max(matrix.shape) > self.slots:
                    raise CkksError(
                        f"layer {layer} {op}: a {matrix.shape[1]} -> {matrix.shape[0]} product exceeds the {self.slots} "
                        f"slots of a ciphertext (poly_modulus_degree {POLY_MODULUS_DEGREE}); splitting is not supported"
                    )
                self.matrices[layer, op] = matrix.T.contiguous().numpy()
        self.products = 0
        self.seconds = 0.0

    def apply(self, layer: int, op: str, ciphertexts: list[bytes]) -> list[bytes]:
        """Enc(x) -> Enc(x W) for each serialized ciphertext (one token each)."""
        ts = _tenseal()
        matrix = self.matrices.get((layer, op))
        if matrix is None:
            raise CkksError(f"this server holds no {op!r} product of layer {layer}")
        started = time.perf_counter()
        answers = []
        for data in ciphertexts:
            try:
                vector = ts.ckks_vector_from(self.context, data)
            except Exception as error:  # TenSEAL raises its own and std exceptions for bad bytes
                raise CkksError(f"not a CKKS vector of this context: {error}") from None
            if vector.size() != matrix.shape[0]:
                raise CkksError(f"layer {layer} {op}: a vector of {vector.size()} values, expected {matrix.shape[0]}")
            answers.append(vector.mm(matrix).serialize())
        self.products += len(ciphertexts)
        self.seconds += time.perf_counter() - started
        return answers


def _serve(connection, model_path: str, layers: tuple[int, ...], public_context: bytes) -> None:
    """The server process's loop: requests (name, args) in, ("ok", result) or ("error", message) out."""
    try:
        server = CkksLinearServer(model_path, layers, public_context)
    except Exception as error:
        connection.send(("error", str(error)))
        return
    connection.send(("ok", None))
    while True:
        try:
            name, args = connection.recv()
        except EOFError:
            return
        if name == "close":
            return
        try:
            if name == "apply":
                connection.send(("ok", server.apply(*args)))
            elif name == "decrypt":  # what happens when the server tries to read a ciphertext
                _tenseal().ckks_vector_from(server.context, args[0]).decrypt()
                connection.send(("ok", "decrypted"))
        except Exception as error:
            connection.send(("error", f"{type(error).__name__}: {error}"))


class CkksServerProcess:
    """A CkksLinearServer in a process of its own: what crosses to it is the public context and ciphertexts, as
    bytes over a pipe, and what comes back is ciphertexts. Same `apply` as the in-process server; close it."""

    def __init__(self, model_path: str | Path, layers: tuple[int, ...], public_context: bytes):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the client's memory
        self._connection, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, str(model_path), tuple(layers), public_context), daemon=True
        )
        self.process.start()
        child.close()
        self._answer()

    def _answer(self):
        status, value = self._connection.recv()
        if status == "error":
            raise CkksError(f"CKKS server: {value}")
        return value

    def apply(self, layer: int, op: str, ciphertexts: list[bytes]) -> list[bytes]:
        self._connection.send(("apply", (layer, op, ciphertexts)))
        return self._answer()

    def try_decrypt(self, ciphertext: bytes) -> str:
        """Ask the server to decrypt `ciphertext`: "decrypted", or CkksError with what stopped it."""
        self._connection.send(("decrypt", (ciphertext,)))
        return self._answer()

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._connection.send(("close", None))
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
        self._connection.close()

    def __enter__(self) -> CkksServerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@dataclass
class CkksStats:
    round_trips: int = 0
    products: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    step_seconds: list[float] = field(default_factory=list)


class _EncryptedLayer:
    """The client's half of one encrypted decoder layer: norms, rotary, attention and its cache, activation."""

    def __init__(self, model_path: str, layer: int, config):
        span = load_block_span(model_path, SpanSpec(layer, layer + 1), config=config)
        self.index = layer
        module = span.layers[0]
        self.input_norm, self.post_norm = module.input_layernorm, module.post_attention_layernorm
        self.act = module.mlp.act_fn
        self.rotary = span.rotary
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.intermediate = config.intermediate_size
        weights = _linear_weights(model_path, layer)
        qkv_bias = [weights.get(f"self_attn.{name}_proj.bias") for name in "qkv"]
        self.qkv_bias = torch.cat(qkv_bias).float() if all(bias is not None for bias in qkv_bias) else None
        o_bias = weights.get("self_attn.o_proj.bias")
        self.o_bias = o_bias.float() if o_bias is not None else None
        self.keys: torch.Tensor | None = None  # (kv_heads, tokens, head_dim)
        self.values: torch.Tensor | None = None

    def attend(self, qkv: torch.Tensor, position: int) -> torch.Tensor:
        """Attention of the new tokens (seq, q+k+v widths) over the cache; returns (seq, heads * head_dim)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        seq = qkv.shape[0]
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = qkv[:, :q_width].view(seq, self.heads, self.head_dim).transpose(0, 1)[None]  # (1, heads, seq, dim)
        k = qkv[:, q_width : q_width + kv_width].view(seq, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        v = qkv[:, q_width + kv_width :].view(seq, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        positions = torch.arange(position, position + seq)[None]
        cos, sin = self.rotary(q, position_ids=positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        self.keys = k[0] if self.keys is None else torch.cat([self.keys, k[0]], dim=1)
        self.values = v[0] if self.values is None else torch.cat([self.values, v[0]], dim=1)
        repeat = self.heads // self.kv_heads
        keys = self.keys.repeat_interleave(repeat, dim=0)  # (heads, tokens, dim)
        values = self.values.repeat_interleave(repeat, dim=0)
        scores = q[0] @ keys.transpose(1, 2) / math.sqrt(self.head_dim)  # (heads, seq, tokens)
        total = keys.shape[1]
        allowed = torch.arange(total)[None, :] <= (torch.arange(seq)[:, None] + total - seq)  # causal
        scores = scores.masked_fill(~allowed, -math.inf)
        out = scores.softmax(dim=-1) @ values  # (heads, seq, dim)
        return out.transpose(0, 1).reshape(seq, self.heads * self.head_dim)


class CkksClient:
    """The client of the demo: holds the secret key and the model's public weights, encrypts what it sends."""

    def __init__(self, model_path: str | Path, encrypted_layers: tuple[int, ...] = (0,)):
        ts = _tenseal()
        self.model_path = str(model_path)
        self.config = load_config(self.model_path)
        layers = self.config.num_hidden_layers
        if not encrypted_layers or not all(0 <= layer < layers for layer in encrypted_layers):
            raise CkksError(f"encrypted layers must be among 0..{layers - 1}, got {encrypted_layers}")
        self.encrypted = tuple(sorted(set(encrypted_layers)))
        self.context = ts.context(
            ts.SCHEME_TYPE.CKKS, poly_modulus_degree=POLY_MODULUS_DEGREE, coeff_mod_bit_sizes=list(COEFF_MOD_BIT_SIZES)
        )
        self.context.global_scale = GLOBAL_SCALE
        self.context.generate_galois_keys()
        from nesa_node.sharding.client_edges import load_client_edges

        self.edges = load_client_edges(self.model_path, config=self.config)
        self.stats = CkksStats()

    def public_context(self) -> bytes:
        """The context without its secret key: what the server gets."""
        return self.context.serialize(save_secret_key=False)

    def _round(self, server: CkksLinearServer, layer: int, op: str, rows: torch.Tensor) -> torch.Tensor:
        """One round trip: encrypt each row of `rows` (seq, in), the server multiplies, decrypt (seq, out)."""
        ts = _tenseal()
        sent = [ts.ckks_vector(self.context, row.double().tolist()).serialize() for row in rows]
        answers = server.apply(layer, op, sent)
        self.stats.round_trips += 1
        self.stats.products += len(sent)
        self.stats.bytes_sent += sum(map(len, sent))
        self.stats.bytes_received += sum(map(len, answers))
        return torch.tensor(
            [ts.ckks_vector_from(self.context, data).decrypt() for data in answers], dtype=torch.float32
        )

    def _encrypted_layer(self, server, layer: _EncryptedLayer, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden (seq, hidden) -> the layer's output, its linear maps computed by the server on ciphertexts."""
        with torch.inference_mode():
            qkv = self._round(server, layer.index, "qkv", layer.input_norm(hidden))
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            attended = layer.attend(qkv, position)
            out = self._round(server, layer.index, "o", attended)
            if layer.o_bias is not None:
                out = out + layer.o_bias
            hidden = hidden + out
            gate_up = self._round(server, layer.index, "gate_up", layer.post_norm(hidden))
            mixed = layer.act(gate_up[:, : layer.intermediate]) * gate_up[:, layer.intermediate :]
            return hidden + self._round(server, layer.index, "down", mixed)

    def generate(self, server: CkksLinearServer, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy tokens after `input_ids` (1, seq): input_ids followed by `new_tokens` tokens (1, seq + new)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise CkksError("the CKKS demo generates for one sequence: input_ids of shape (1, tokens)")
        parts = self._parts()  # fresh caches for this generation
        caches = [part.new_cache() if not isinstance(part, _EncryptedLayer) else None for part in parts]
        tokens, position = input_ids, 0
        new = input_ids
        for _ in range(new_tokens):
            started = time.perf_counter()
            with torch.inference_mode():
                hidden = self.edges.embed_tokens(new)  # (1, seq, hidden)
                for part, cache in zip(parts, caches, strict=True):
                    if isinstance(part, _EncryptedLayer):
                        hidden = self._encrypted_layer(server, part, hidden[0], position)[None]
                    else:
                        hidden = part(hidden, cache, position)
                logits = self.edges.lm_head(self.edges.norm(hidden[:, -1:]))  # (1, 1, vocab)
            token = logits[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
            position += new.shape[1]
            tokens, new = torch.cat([tokens, token], dim=1), token
            self.stats.step_seconds.append(time.perf_counter() - started)
        return tokens

    def _parts(self) -> list:
        """The model's layers in order: plaintext spans (BlockSpan) between the encrypted layers."""
        parts, start = [], 0
        for layer in [*self.encrypted, self.config.num_hidden_layers]:
            if start < layer:
                parts.append(load_block_span(self.model_path, SpanSpec(start, layer), config=self.config))
            if layer < self.config.num_hidden_layers:
                parts.append(_EncryptedLayer(self.model_path, layer, self.config))
            start = layer + 1
        return parts


__all__ = [
    "COEFF_MOD_BIT_SIZES",
    "POLY_MODULUS_DEGREE",
    "CkksClient",
    "CkksLinearServer",
    "CkksServerProcess",
    "CkksStats",
]
