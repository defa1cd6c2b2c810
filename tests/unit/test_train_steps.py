"""The client's count of optimizer steps during fine-tuning follows only what the chain must report: a node that
answers a backward pass with another update than the one its step takes the chain to is failed and blamed
(client/train_link.py backward_pass), so it cannot move the count that checkpoints are taken by."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nesa_node.client.train_link import OVERFLOW_HEADROOM, LinkLost, backward_pass, overflows
from nesa_node.protocol.channel import read
from nesa_node.protocol.messages import NO_CODEC, TO_TRAINING, TrainBackward, TrainGrad


class ReportingLink:
    """A training link whose node answers every backward pass, reporting `update` as its step count."""

    def __init__(self, peer_id: str, update: int):
        self.peer_id, self.update = peer_id, update
        self.asked: list[TrainBackward] = []

    def takes(self, tokens: int) -> bool:
        return True

    async def call(self, request, expected, *, timeout_s: float, max_answer_bytes: int, well_formed: bool):
        message = read(request, TO_TRAINING)
        self.asked.append(message)
        return TrainGrad(step_id=message.step_id, step=self.update), None

    def read_tensor(self, answer, codec, like: torch.Tensor) -> torch.Tensor:
        return like


def run_backward(links: list[ReportingLink], *, apply: bool = True, step_after: int | None = 5):
    return asyncio.run(
        backward_pass(
            links,
            torch.ones(1, 2, 4),
            "pass.0",
            lambda link, elements: NO_CODEC,
            lambda link: apply,
            timeout_of=lambda applies: 1.0,
            step_after=step_after,
        )
    )


def test_the_steps_of_a_chain_that_takes_the_update_are_returned():
    steps, grad = run_backward([ReportingLink("first", 5), ReportingLink("last", 5)])
    assert steps == [5, 5] and torch.equal(grad, torch.ones(1, 2, 4))


@pytest.mark.parametrize("reported", [0, 4, 6, 1 << 30], ids=["zero", "behind", "ahead", "far-ahead"])
def test_a_node_reporting_another_update_is_failed_and_blamed(reported):
    first, last = ReportingLink("first", 5), ReportingLink("last", reported)
    with pytest.raises(LinkLost) as lost:
        run_backward([first, last])
    assert lost.value.peer_id == "last" and lost.value.blame
    assert f"reported update {reported} for update 5" in lost.value.message
    assert not first.asked  # the pass stopped at the node that misreported (the backward runs from the last)


def test_without_an_update_the_reported_count_is_not_judged():
    # micro-batches gathered before a step (apply False): the count a node reports is not an update of this pass
    steps, _ = run_backward([ReportingLink("first", 3), ReportingLink("last", 7)], apply=False)
    assert steps == []


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_only_values_near_a_dtypes_largest_finite_one_can_overflow_an_honest_node(dtype):
    """`overflows` (who is blamed for a not_finite answer): values within OVERFLOW_HEADROOM of the dtype's largest
    finite one could overflow an honest node's blocks; smaller ones, of either sign, could not."""
    limit = torch.finfo(getattr(torch, dtype)).max / OVERFLOW_HEADROOM
    generator = torch.Generator().manual_seed(5)
    ordinary = torch.randn(2, 3, 8, generator=generator) * 1000.0
    assert not overflows(ordinary.clamp(-limit * 0.99, limit * 0.99), dtype)
    for sign in (1.0, -1.0):
        large = ordinary.clone()
        large[1, 2, 5] = sign * limit
        assert overflows(large, dtype)
    assert not overflows(torch.empty(0, 3, 8), dtype)


def test_a_node_announcing_no_known_dtype_is_judged_as_float32():
    """A record naming a dtype no node computes in gives the widest range: its claims of overflow need the largest
    values to be believed."""
    below_float32 = torch.full((4,), torch.finfo(torch.float32).max / OVERFLOW_HEADROOM / 2)
    assert not overflows(below_float32, "float64") and not overflows(below_float32, "bogus")
    assert overflows(torch.full((4,), 1e38), "bogus")
