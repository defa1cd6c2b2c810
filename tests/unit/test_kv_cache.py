import pytest
from hypothesis import given
from hypothesis import strategies as st

from nesa_node.errors import CacheBudgetError
from nesa_node.sharding.kv_cache import CacheBudget, kv_bytes_per_token, kv_bytes_per_token_for


def test_bytes_per_token_golden_values():
    # Llama-2-7B: 32 layers, 32 kv heads of 128, float16 -> 512 KiB per token
    assert kv_bytes_per_token(head_dim=128, n_kv_heads=32, n_layers=32, bytes_per_element=2) == 524288
    # Llama-3-8B uses grouped-query attention (8 kv heads): a quarter of that
    assert kv_bytes_per_token(head_dim=128, n_kv_heads=8, n_layers=32, bytes_per_element=2) == 131072


def test_bytes_per_token_from_config(tiny_llama):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama)  # hidden 64, 4 heads, 2 kv heads
    assert kv_bytes_per_token_for(config, n_layers=3, bytes_per_element=4) == 2 * 16 * 2 * 3 * 4


@pytest.mark.parametrize("bad", [0, -1])
def test_bytes_per_token_rejects_non_positive(bad):
    with pytest.raises(ValueError):
        kv_bytes_per_token(head_dim=bad, n_kv_heads=1, n_layers=1, bytes_per_element=1)


def test_over_budget_is_refused_without_changing_the_budget():
    budget = CacheBudget.for_tokens(100, bytes_per_token=12)
    budget.reserve(1, 60)
    with pytest.raises(CacheBudgetError, match="40 tokens"):
        budget.reserve(1, 41)
    assert budget.tokens_left == 40
    with pytest.raises(CacheBudgetError):
        budget.reserve(0, 10)
    assert budget.tokens_left == 40


def test_allocate_frees_on_error():
    budget = CacheBudget.for_tokens(10, bytes_per_token=8)
    with pytest.raises(RuntimeError), budget.allocate(2, 5):
        assert budget.tokens_left == 0
        raise RuntimeError("boom")
    assert budget.tokens_left == 10


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 50)), max_size=30), st.randoms(use_true_random=False))
def test_any_reservation_sequence_returns_exactly_to_baseline(requests, random):
    budget = CacheBudget.for_tokens(300, bytes_per_token=7)
    held = []
    for batch, length in requests:
        try:
            held.append(budget.reserve(batch, length))
        except CacheBudgetError:
            assert budget.session_bytes(batch, length) > budget.free_bytes
        assert 0 <= budget.used_bytes <= budget.capacity_bytes
    random.shuffle(held)
    for nbytes in held:
        budget.release(nbytes)
    assert budget.tokens_left == 300 and budget.used_bytes == 0
