"""The client's count of optimizer steps during fine-tuning follows only what the chain must report: a node that
answers a backward pass with another update than the one its step takes the chain to is failed and blamed
(client/train_link.py backward_pass), so it cannot move the count that checkpoints are taken by."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nesa_node.client.train_link import LinkLost, backward_pass
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
