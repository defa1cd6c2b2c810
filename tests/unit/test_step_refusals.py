"""How the client reads a node's refusal of a step (client/session.py `_raise_step_error`): a node refusing an input
the client itself sent it, which passes every check an honest node makes, failed and is replaced (a LinkFailed),
rather than the refusal reaching the user as their own error; an input that is not sane, or longer than both the
step limit the node announces (when it does) and any step it took, is the caller's error as before; refusals of
other steps, and in relay mode refusals from nodes not being sent this step, are passed over."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from nesa_node.client.chain_links import LinkFailed
from nesa_node.client.config import ClientConfig
from nesa_node.client.routing import explain_missing
from nesa_node.client.session import InferenceSession
from nesa_node.errors import AdapterMissingError, BadRequestError, SessionNotFoundError, SessionStateError
from nesa_node.protocol import push_tag
from nesa_node.protocol.channel import frame
from nesa_node.protocol.messages import ErrorReply, Step
from nesa_node.protocol.tensors import NO_CODEC, tensor_to_proto
from nesa_node.routing.chain import Chain, ChainRequest, NodeView, SwarmSnapshot

HIDDEN = 8
STEP = "session:5"


def session_of(mode: str, hidden_size: int | None = HIDDEN, **settings) -> tuple[InferenceSession, list]:
    """A session of max_length 32 over three links; `settings`: ClientConfig fields (by default its nodes must take
    32 tokens a step: min_step_tokens, the session's length being less)."""
    session = InferenceSession(
        SimpleNamespace(announced=lambda peer_id: None),  # the swarm: no node's record at hand
        Chain(hops=()),
        ClientConfig(mode=mode, **settings),
        batch=1,
        max_length=32,
        session_id="session",
        hidden_size=hidden_size,
    )
    links = [SimpleNamespace(peer_id=name) for name in ("first", "middle", "last")]
    session.links.links = list(links)
    return session, links


def fed(session: InferenceSession, link, hidden: torch.Tensor, step_id: str = STEP) -> None:
    """What `_step` notes when it sends `hidden` to `link` under `step_id` (at position 5, codec "none")."""
    session._note_fed(link.peer_id, step_id, (5, "none", tensor_to_proto(hidden)), hidden)


def refuse(session, answered, to, error, step_id: str | None = STEP, hidden=None, current: str = STEP) -> None:
    """`answered`'s refusal (for `step_id`) while the client waits on step `current`, sent to `to`."""
    shape = tuple(hidden.shape) if hidden is not None else (1, 1, HIDDEN)
    session._raise_step_error(answered, ErrorReply.of(error, step_id), None, step_id=current, fed=to, shape=shape)


ONE_TOKEN = torch.ones(1, 1, HIDDEN)


@pytest.mark.parametrize("mode", ["direct", "relay"])
@pytest.mark.parametrize("error", [BadRequestError("NaN"), SessionNotFoundError("no such"), AdapterMissingError("x")])
def test_a_refusal_of_a_sane_one_token_step_the_client_sent_fails_that_node(mode, error):
    session, (first, middle, _) = session_of(mode)
    to = first if mode == "direct" else middle
    fed(session, to, ONE_TOKEN)
    with pytest.raises(LinkFailed) as failed:
        refuse(session, to, to, error)
    assert failed.value.link is to and not failed.value.fault


def test_a_prompt_longer_than_any_step_the_node_took_is_the_callers_error_until_it_took_one():
    session, (first, _, _) = session_of("direct", min_step_tokens=0)  # no floor: nothing says what the node takes
    prompt = torch.ones(1, 5, HIDDEN)
    fed(session, first, prompt)
    with pytest.raises(BadRequestError):  # its step limit may be below 5 tokens: an honest refusal
        refuse(session, first, first, BadRequestError("too many tokens"), hidden=prompt)
    session._taken[first.peer_id] = 5
    with pytest.raises(LinkFailed):
        refuse(session, first, first, BadRequestError("too many tokens"), hidden=prompt)


@pytest.mark.parametrize("mode", ["direct", "relay"])
@pytest.mark.parametrize(
    "announced, within, beyond",
    [(6, (2, 3), (2, 4)), (0, (2, 16), (3, 11))],  # rows x seq: 6 and 8 tokens; 32 and 33
    ids=["announced-6", "announced-none"],
)
def test_a_prompt_within_the_step_limit_the_node_takes_is_its_fault_and_beyond_it_the_callers(
    mode, announced, within, beyond
):
    """Within the limit a node announces, or for a node announcing none (as an older node does) within the floor
    routing chose it for (min_step_tokens: 32 tokens here, the session's length), a refusal fails the node: it
    cannot turn a prompt into the user's error; beyond it, the refusal is the caller's error."""
    session, (first, middle, _) = session_of(mode)
    to = first if mode == "direct" else middle
    session.links.swarm = SimpleNamespace(announced=lambda peer_id: SimpleNamespace(max_step_tokens=announced))
    within, beyond = torch.ones(*within, HIDDEN), torch.ones(*beyond, HIDDEN)
    fed(session, to, within)
    with pytest.raises(LinkFailed) as failed:
        refuse(session, to, to, BadRequestError("too many tokens"), hidden=within)
    assert failed.value.link is to
    fed(session, to, beyond, step_id="session:6")
    with pytest.raises(BadRequestError):  # over what it takes: an honest node refuses it
        refuse(session, to, to, BadRequestError("too many"), hidden=beyond, step_id="session:6", current="session:6")


def test_the_chains_step_limit_is_the_least_any_of_its_nodes_announces():
    session, _ = session_of("direct")
    limits = {"first": 0, "middle": 9, "last": 4}  # 0: announces none
    session.links.swarm = SimpleNamespace(announced=lambda peer_id: SimpleNamespace(max_step_tokens=limits[peer_id]))
    assert session._chain_step_tokens() == 4
    limits.update(middle=0, last=0)  # those announcing none are taken at the floor the session asked: 32 tokens
    assert session._chain_step_tokens() == 32
    limits.update(middle=12)
    assert session._chain_step_tokens() == 12
    session.links.swarm = SimpleNamespace(announced=lambda peer_id: None)  # no records at hand
    assert session._chain_step_tokens() == 32
    unbounded, _ = session_of("direct", min_step_tokens=0)  # no floor asked, none announced: no bound
    assert unbounded._chain_step_tokens() == 0


@pytest.mark.parametrize(
    "sent",
    [
        torch.full((1, 1, HIDDEN), float("nan")),  # not finite
        torch.ones(1, 1, HIDDEN + 1),  # not the model's width
        torch.ones(1, HIDDEN),  # not three dimensions
    ],
    ids=["nan", "width", "rank"],
)
def test_a_refusal_of_an_input_that_is_not_sane_is_the_callers_error(sent):
    session, (first, _, _) = session_of("direct")
    fed(session, first, sent)
    with pytest.raises(BadRequestError):
        refuse(session, first, first, BadRequestError("malformed"))


def test_without_the_models_width_known_a_refusal_is_the_callers_error():
    session, (first, _, _) = session_of("direct", hidden_size=None)
    fed(session, first, ONE_TOKEN)
    with pytest.raises(BadRequestError):
        refuse(session, first, first, BadRequestError("malformed"))


def changed_buffer(first, session) -> None:
    buffer = ONE_TOKEN.clone()
    fed(session, first, buffer)
    buffer.add_(1)  # the caller's buffer, reused for the step taken again
    fed(session, first, buffer)


def changed_dtype(first, session) -> None:
    fed(session, first, ONE_TOKEN)
    fed(session, first, ONE_TOKEN.to(torch.float16))  # the same values, other bytes


@pytest.mark.parametrize("resend", [changed_buffer, changed_dtype])
def test_a_node_sent_other_content_under_the_same_step_id_is_not_blamed(resend):
    """A step interrupted and taken again with other content (or a relay input recomputed upstream): the node's
    refusal of a reused id may be honest. The same content sent again leaves the node to blame."""
    session, (first, _, _) = session_of("direct")
    fed(session, first, ONE_TOKEN)
    fed(session, first, ONE_TOKEN.clone())  # the same content again (a retry)
    with pytest.raises(LinkFailed):
        refuse(session, first, first, BadRequestError("refused"))
    session, (first, _, _) = session_of("direct")
    resend(first, session)
    with pytest.raises(BadRequestError):
        refuse(session, first, first, BadRequestError("step id already used for different content"))
    fed(session, first, ONE_TOKEN, step_id="session:6")  # a new id: judged again
    with pytest.raises(LinkFailed):
        refuse(session, first, first, BadRequestError("x"), step_id="session:6", current="session:6")


def test_refusals_of_other_steps_and_from_nodes_not_being_fed_in_relay_mode_are_passed_over():
    """A refusal naming no step, from the node being fed, fails it at once (the client awaits this step alone)."""
    session, (first, middle, last) = session_of("relay")
    fed(session, middle, ONE_TOKEN)
    assert refuse(session, middle, middle, BadRequestError("stale"), step_id="session:4") is None
    with pytest.raises(LinkFailed) as failed:
        refuse(session, middle, middle, BadRequestError("no id"), step_id=None)
    assert failed.value.link is middle
    assert refuse(session, first, middle, BadRequestError("answered already")) is None  # fed before middle
    assert refuse(session, last, middle, SessionNotFoundError("not sent yet")) is None
    direct, (first, middle, _) = session_of("direct")
    fed(direct, first, ONE_TOKEN)
    with pytest.raises(LinkFailed) as failed:  # a direct chain's later node refusing for anything but its input
        refuse(direct, middle, first, SessionNotFoundError("lost it"))
    assert failed.value.link is middle


def test_a_step_of_no_tokens_is_the_callers_error_before_anything_is_sent():
    session, _ = session_of("direct")
    session._opened = True
    with pytest.raises(SessionStateError, match="at least one token"):
        asyncio.run(session.step(torch.ones(1, 0, HIDDEN)))


def test_a_no_route_message_says_which_nodes_take_too_few_tokens_a_step():
    snapshot = SwarmSnapshot(
        num_blocks=2,
        nodes=(NodeView("QmSmallLimit", 0, 2, cache_tokens_left=999, max_step_tokens=16),),
    )
    said = explain_missing(snapshot, ChainRequest(max_length=32, step_tokens=32), frozenset())
    assert "takes 16 tokens a step, 32 asked" in said
    silent = SwarmSnapshot(num_blocks=2, nodes=(NodeView("QmNoLimit", 0, 2, cache_tokens_left=999),))
    said = explain_missing(silent, ChainRequest(max_length=32, step_tokens=300, unannounced_tokens=256), frozenset())
    assert "announces no step limit (held to 256 tokens), 300 asked" in said


SHOWN = {  # what the refused push carries -> who is blamed: (link, fault, accuser); None: passed over as stale
    "current": ("last", False, None),  # the seals and shape the client sent: the refuser failed
    "never-sent": ("middle", True, None),
    "own-seal-kept": ("middle", True, None),  # the current seals at another place: not what it was to push on
    "a-token-more": ("middle", True, None),  # its own input was sealed with the step's tokens
    "earlier-attempt": None,  # a push before the last node was replaced: genuine, stale now
    "earlier-attempt-other-tokens": None,  # a retry of the step id with other tokens: that attempt's shape holds
    "earlier-seals-a-token-more": ("middle", True, None),
}


@pytest.mark.parametrize("shown", list(SHOWN))
def test_a_pushed_steps_seals_and_tokens_under_its_pushers_tag_tell_who_is_at_fault(shown):
    """The last node refuses what the middle one pushed, returning it under the middle node's tag
    (protocol/push_tag.py). With the seals the client sent this attempt after the middle node and the step's shape,
    the refuser failed; with seals the client never sent after it, or another token count than the seals' attempt,
    the pusher is at fault (its own input was sealed); a well-formed push with the seals of an earlier attempt of the
    step (sent before a failover replaced the node after it, or with other tokens) is stale: passed over, the
    attempt under way follows."""
    session, (first, middle, last) = session_of("direct")
    session.links.swarm = SimpleNamespace(announced=lambda peer_id: None, answer_dtypes=lambda peer_id: ("float32",))
    session.position = 5
    replaced = SimpleNamespace(peer_id="replaced")
    for link in (first, middle, last, replaced):
        link.push_key = push_tag.new_key()
    earlier_tokens = 2 if shown == "earlier-attempt-other-tokens" else 1
    earlier = session._seal([first, middle, replaced], STEP, earlier_tokens)  # the last node was replaced since
    current = session._seal([first, middle, last], STEP, 1)
    seals = {
        "never-sent": ("0" * 64,),
        "own-seal-kept": current,
        "earlier-attempt": earlier[1:],
        "earlier-attempt-other-tokens": earlier[1:],
        "earlier-seals-a-token-more": earlier[1:],
    }.get(shown, current[1:])
    tokens = 2 if shown in ("a-token-more", "earlier-attempt-other-tokens", "earlier-seals-a-token-more") else 1
    proto = tensor_to_proto(torch.ones(1, tokens, HIDDEN))
    tag = push_tag.tag_of(middle.push_key, STEP, 5, NO_CODEC, proto, seals)
    evidence = Step(step_id=STEP, position=5, seals=seals, tag=tag)
    reply = ErrorReply.of(BadRequestError("the step's seal does not match"), STEP).model_copy(
        update={"evidence": evidence}
    )
    refusal = frame(reply, [proto])
    if SHOWN[shown] is None:
        session._raise_step_error(last, reply, refusal, step_id=STEP, fed=first, shape=(1, 1, HIDDEN))  # no raise
        return
    with pytest.raises(LinkFailed) as failed:
        session._raise_step_error(last, reply, refusal, step_id=STEP, fed=first, shape=(1, 1, HIDDEN))
    link, fault, accuser = SHOWN[shown]
    links = {"last": last, "middle": middle}
    assert (failed.value.link, failed.value.fault, failed.value.accuser) == (links[link], fault, accuser)
