"""A node's refusal during a failover's control exchange (client/session_chain.py `_control_answer`, used by
`retarget`): a neighbour that dropped the session meanwhile (its cache taken back, preempted idle, a step timeout) or
has no room fails like a lost node, so the failover replaces it too, rather than ending the user's step; any other
refusal stays the typed error it names, naming the node that refused (`peer_id`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from nesa_node.client.chain_links import LinkFailed
from nesa_node.client.session_chain import SessionChain
from nesa_node.errors import BadRequestError, CacheBudgetError, SessionPreemptedError, StepTimeoutError
from nesa_node.protocol.channel import frame
from nesa_node.protocol.messages import ErrorReply, Retargeted
from nesa_node.server.cache_room import TAKEN_BACK


class Answers:
    """The part of SessionChain `_control_answer` reads: the next answer of any link, in order."""

    def __init__(self, answers):
        self.swarm = SimpleNamespace(request_timeout_s=5.0)
        self._answers = list(answers)

    async def next_answer(self, until):
        answered, message = self._answers.pop(0)
        return answered, message, frame(message)


def control_answer(link, answers):
    return asyncio.run(SessionChain._control_answer(Answers(answers), link, Retargeted))


@pytest.mark.parametrize(
    ("error", "full"),
    [(SessionPreemptedError(TAKEN_BACK), False), (StepTimeoutError("slow"), False), (CacheBudgetError("full"), True)],
)
def test_a_neighbour_that_dropped_the_session_fails_like_a_lost_node(error, full):
    neighbour = SimpleNamespace(peer_id="neighbour")
    with pytest.raises(LinkFailed) as failed:
        control_answer(neighbour, [(neighbour, ErrorReply.of(error))])
    assert failed.value.link is neighbour and failed.value.full is full and failed.value.message == error.message


def test_another_refusal_stays_the_error_it_names_and_other_nodes_refusals_are_passed_over():
    neighbour, other = SimpleNamespace(peer_id="neighbour"), SimpleNamespace(peer_id="other")
    refusals = [
        (other, ErrorReply.of(SessionPreemptedError("not this exchange's"))),
        (neighbour, ErrorReply.of(BadRequestError("bad retarget"))),
    ]
    with pytest.raises(BadRequestError, match="bad retarget") as refused:
        control_answer(neighbour, refusals)
    assert refused.value.peer_id == "neighbour"
    answer = Retargeted()
    assert control_answer(neighbour, [(neighbour, answer)])[0] == answer
