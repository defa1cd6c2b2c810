"""The CKKS demo (nesa_node/privacy/ckks.py) with TenSEAL for real: the server's context has no secret key and a
ciphertext cannot be decrypted there; greedy tokens with an encrypted layer equal plaintext; widths over the slots,
foreign bytes and a private context are refused with CkksError."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node.errors import CkksError

pytestmark = pytest.mark.once  # TenSEAL products take seconds: run once, in make test's first pass
ts = pytest.importorskip("tenseal")

from nesa_node.privacy.ckks import CkksClient, CkksLinearServer, CkksServerProcess  # noqa: E402

PROMPT = torch.tensor([[5, 17, 250, 9]])
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def pair(tiny_llama):
    client = CkksClient(tiny_llama, encrypted_layers=(1,))
    server = CkksLinearServer(tiny_llama, (1,), client.public_context())
    return client, server


def test_the_server_holds_no_secret_key_and_cannot_decrypt(pair):
    client, server = pair
    assert client.context.is_private() and not server.context.is_private()
    sent = ts.ckks_vector(client.context, [0.5] * 64).serialize()
    answer = ts.ckks_vector_from(server.context, server.apply(1, "o", [sent])[0])
    with pytest.raises(ValueError, match="secret_key"):
        answer.decrypt()
    with pytest.raises(ValueError, match="secret_key"):
        ts.ckks_vector_from(server.context, sent).decrypt()


def test_greedy_tokens_with_an_encrypted_layer_equal_plaintext(pair, tiny_llama):
    client, _ = pair
    with torch.inference_mode():
        reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
            PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    with CkksServerProcess(tiny_llama, (1,), client.public_context()) as server:  # the server in its own process
        sent = ts.ckks_vector(client.context, [0.5] * 64).serialize()
        with pytest.raises(CkksError, match="secret_key"):
            server.try_decrypt(sent)
        started = time.perf_counter()
        tokens = client.generate(server, PROMPT, NEW_TOKENS)
        seconds = time.perf_counter() - started
    assert torch.equal(tokens, reference)
    stats = client.stats
    assert stats.round_trips == 4 * NEW_TOKENS  # four per encrypted layer and step
    assert stats.products == 4 * (PROMPT.shape[1] + NEW_TOKENS - 1)  # one per token and round
    print(f"\nCKKS, 1 of 4 layers encrypted: {seconds / NEW_TOKENS:.2f} s per token, "
          f"{stats.bytes_sent / stats.products / 1e3:.0f} kB per ciphertext sent")  # fmt: skip


def test_a_product_error_is_small(pair):
    client, server = pair
    x = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sent = ts.ckks_vector(client.context, x.tolist()).serialize()
    got = torch.tensor(ts.ckks_vector_from(client.context, server.apply(1, "gate_up", [sent])[0]).decrypt())
    exact = x @ torch.from_numpy(server.matrices[1, "gate_up"])
    assert (got - exact).abs().max().item() < 1e-4


def test_refusals(pair, tiny_llama, tmp_path, monkeypatch):
    client, server = pair
    with pytest.raises(CkksError, match="secret key"):
        CkksLinearServer(tiny_llama, (1,), client.context.serialize(save_secret_key=True))
    with pytest.raises(CkksError, match="no 'o' product of layer 0"):
        server.apply(0, "o", [])
    with pytest.raises(CkksError, match="not a CKKS vector"):
        server.apply(1, "o", [b"\x00garbage"])
    with pytest.raises(CkksError, match="encrypted layers"):
        CkksClient(tiny_llama, encrypted_layers=(9,))
    monkeypatch.setattr("nesa_node.privacy.ckks.POLY_MODULUS_DEGREE", 128)  # 64 slots: the 64 -> 256 product is wider
    with pytest.raises(CkksError, match="exceeds the 64 slots"):
        CkksLinearServer(tiny_llama, (1,), client.public_context())
