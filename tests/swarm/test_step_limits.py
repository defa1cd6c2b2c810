"""Step limits nodes announce (`NodeInfo.max_step_tokens`): a prompt longer than the chain takes a step goes in steps
every node takes, a replacement's cache is replayed in chunks it takes, and a node refusing a prompt within the limit
it announced failed (it is replaced) rather than making the user's request their own error."""

from __future__ import annotations

import pytest
import torch

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.config import ClientConfig
from nesa_node.devtools.chaos import AfterTokens
from nesa_node.errors import BadRequestError, NesaError, NoRouteError, SessionStateError, StepTimeoutError
from tests.support.models import greedy_tokens
from tests.support.swarm import wait_for_chain, wait_until

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])  # 11 tokens
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def reference(tiny_llama) -> torch.Tensor:
    return greedy_tokens(tiny_llama, PROMPT, NEW_TOKENS)


def connect(swarm, path: str, prefix: str, mode: str = "direct", **settings) -> DistributedModelForCausalLM:
    """A client; `settings`: ClientConfig fields (min_step_tokens=0 routes to nodes taking a few tokens a step)."""
    return DistributedModelForCausalLM.from_pretrained(
        path,
        initial_peers=swarm.initial_peers,
        dht_prefix=prefix,
        compression="none",
        mode=mode,
        config=ClientConfig(**settings),
    )


def generate(model, streamer=None) -> torch.Tensor:
    return model.generate(
        PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, streamer=streamer
    )


def record_steps(node) -> list[int]:
    """The tokens (rows x seq) of every input `node` reads, replays included."""
    seen, honest_read = [], node.compute.read_hidden

    def read(frame, codec, *, batch):
        hidden = honest_read(frame, codec, batch=batch)
        seen.append(hidden.shape[0] * hidden.shape[1])
        return hidden

    node.compute.read_hidden = read
    return seen


def refuse_prompts(node) -> list[int]:
    """`node` refuses every step of more than one token as over its step limit; the tokens of each it refused."""
    refused, honest_read = [], node.compute.read_hidden

    def refuse(frame, codec, *, batch):
        hidden = honest_read(frame, codec, batch=batch)
        if hidden.shape[1] > 1:
            refused.append(hidden.shape[1])
            raise BadRequestError(f"{hidden.shape[1]} tokens exceed this node's step limit")
        return hidden

    node.compute.read_hidden = refuse
    return refused


@pytest.mark.parametrize("mode", ["direct", "relay"])
def test_a_prompt_longer_than_a_node_takes_goes_in_steps_within_every_limit(local_swarm, tiny_llama, reference, mode):
    """The first node takes 4 tokens a step, the last 3: the 11-token prompt goes in steps of at most 3, and the
    tokens equal one process's; the last node dies mid-generation and its replacement (taking 2 a step) gets the
    history in chunks of at most 2. Before, every node refused the prompt (the user's error)."""
    prefix = f"step-limits-{mode}"
    first = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix, max_tokens_per_step=4)
    last = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix, max_tokens_per_step=3)
    spare = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix, max_tokens_per_step=2)
    seen = {node.peer_id: record_steps(node) for node in (first, last, spare)}
    assert first.current_info().max_step_tokens == 4
    model = connect(local_swarm, tiny_llama, prefix, mode, min_step_tokens=0)
    with model:
        wait_for_chain(model, hops=2, max_length=32)
        model.swarm.ban(spare.peer_id)
        with model.inference_session(max_length=32) as session:
            assert session.chain.peer_ids == (first.peer_id, last.peer_id)
            model.swarm.unban(spare.peer_id)
            output = generate(model, AfterTokens(2, lambda: local_swarm.stop_node(last)))
            failed = [entry["failed"] for entry in session.failovers]
    assert torch.equal(output, reference)
    assert failed == [last.peer_id], session.failovers
    assert seen[first.peer_id][:4] == [3, 3, 3, 2], seen[first.peer_id]  # the prompt, within the chain's least limit
    assert seen[last.peer_id][:4] == [3, 3, 3, 2]
    assert seen[spare.peer_id] and max(seen[spare.peer_id]) <= 2, seen[spare.peer_id]
    assert sum(seen[spare.peer_id]) >= len(PROMPT[0]) + 2  # the whole history, replayed in chunks it takes


@pytest.mark.parametrize("announces", ["its-limit", "none"])
def test_a_node_refusing_a_prompt_it_should_take_is_replaced(local_swarm, tiny_llama, reference, announces):
    """A first node answering "too many tokens" to a prompt within the step limit it announces would make the user's
    prompt their own error (a gateway's 400): it failed, and is replaced; a prompt the chain's records say no node
    takes is never sent whole. Announcing no limit (as an older node does) is no way out: such a node is sent the
    prompt in parts within the floor the client asked of the chain (min_step_tokens 4 here), and refusing one fails
    it the same; the rest of the prompt goes whole to the nodes announcing more."""
    prefix = f"prompt-refuser-{announces}"
    liar = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    honest = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    last = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    if announces == "none":
        announce = liar.current_info
        liar.current_info = lambda: announce().model_copy(update={"max_step_tokens": 0})
    refused = refuse_prompts(liar)  # a prompt "is too long", although within what the node should take
    last_seen = record_steps(last)
    settings, parts = ({}, [11]) if announces == "its-limit" else ({"min_step_tokens": 4}, [4, 7])
    with connect(local_swarm, tiny_llama, prefix, **settings) as model:
        wait_for_chain(model, hops=2, max_length=32)

        def announced() -> int | None:
            records = model.call(model.swarm.node_records(fresh=True))
            return next((r.info.max_step_tokens for r in records if r.info.peer_id == liar.peer_id), None)

        wait_until(lambda: announced() == (8192 if announces == "its-limit" else 0), 30)
        model.swarm.ban(honest.peer_id)  # the chain starts on the liar
        with model.inference_session(max_length=32) as session:
            assert session.chain.peer_ids[0] == liar.peer_id
            model.swarm.unban(honest.peer_id)
            output = generate(model)
            failed = [(entry["failed"], entry["replacements"][:1]) for entry in session.failovers]
        assert torch.equal(output, reference)
        assert refused == parts[:1] and failed == [(liar.peer_id, [honest.peer_id])], (refused, session.failovers)
        assert last_seen[: len(parts)] == parts, last_seen
        assert liar.peer_id in model.swarm.banned()


def fail_prompt_parts(node, seen: list[int], *, after: int = 0) -> None:
    """`node` drops its session (a step timeout, as a node too slow for it) at the first prompt part it is given
    after `after` others; every input it reads is noted in `seen` (rows x tokens)."""
    honest_read = node.compute.read_hidden

    def read(frame, codec, *, batch):
        hidden = honest_read(frame, codec, batch=batch)
        seen.append(hidden.shape[0] * hidden.shape[1])
        if hidden.shape[1] > 1 and sum(1 for tokens in seen if tokens > 1) > after:
            raise StepTimeoutError("step not computed in time: the session ended")
        return hidden

    node.compute.read_hidden = read


def test_a_replacement_found_while_a_prompts_part_is_under_way_takes_that_part_whole(
    local_swarm, tiny_llama, reference
):
    """The last node fails on the prompt's first part (8 tokens, the chain's limit): its replacement must announce
    it takes 8 tokens a step, so the spare taking 4 is passed over (it would refuse the part resent whole, and an
    honest node would be banned for it)."""
    prefix = "part-under-way"
    first = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix, max_tokens_per_step=8)
    last = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix, max_tokens_per_step=8)
    small = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix, max_tokens_per_step=4)
    big = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix, max_tokens_per_step=8)
    lost = []
    fail_prompt_parts(last, lost)
    small_seen = record_steps(small)
    with connect(local_swarm, tiny_llama, prefix, min_step_tokens=0) as model:
        wait_for_chain(model, hops=2, max_length=32)
        for spare in (small, big):
            model.swarm.ban(spare.peer_id)
        with model.inference_session(max_length=32) as session:
            assert session.chain.peer_ids == (first.peer_id, last.peer_id)
            asked, reroute = [], session.failover.reroute

            async def rerouted(request):
                asked.append(request.step_tokens)
                return await reroute(request)

            session.failover.reroute = rerouted
            for spare in (small, big):
                model.swarm.unban(spare.peer_id)
            output = generate(model)
            replaced = [(entry["failed"], entry["replacements"]) for entry in session.failovers]
    assert torch.equal(output, reference)
    assert lost == [8] and asked == [8], (lost, asked)
    assert replaced == [(last.peer_id, [big.peer_id])] and small_seen == [], replaced
    assert small.peer_id not in model.swarm.banned()


def test_a_prompt_failing_part_way_leaves_the_session_unusable_and_says_why(local_swarm, tiny_llama):
    """Nodes took the prompt's first part and no node can take the second: the step fails, and the session, whose
    nodes hold part of the prompt, refuses further steps with the reason rather than computing from a torn cache."""
    prefix = "torn-prompt"
    local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix, max_tokens_per_step=4)
    last = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix, max_tokens_per_step=4)
    fail_prompt_parts(last, [], after=1)
    with connect(local_swarm, tiny_llama, prefix, min_step_tokens=0) as model:
        wait_for_chain(model, hops=2, max_length=32)
        with model.inference_session(max_length=32) as session:
            with pytest.raises(NesaError):  # the last node's span has no other node, and it fails its replay too
                model.generate(PROMPT, max_new_tokens=2)
            assert session.position == 4  # the first part went through
            with pytest.raises(SessionStateError, match="took 4 of a prompt's 11 tokens"):
                session.step(torch.zeros(1, 1, last.compute.span.hidden_size))


def test_nodes_announcing_a_step_limit_below_the_clients_floor_are_not_routed_to(local_swarm, tiny_llama):
    """A node announcing a tiny step limit would make every prompt go a few tokens a step: by default the client
    routes around it (min_step_tokens: 256 rows x tokens, or the session's batch x max_length when less)."""
    prefix = "tiny-limit"
    tiny = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix, max_tokens_per_step=4)
    usual = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    with connect(local_swarm, tiny_llama, prefix) as model:
        wait_for_chain(model, hops=2, max_length=32)
        for _ in range(3):
            with model.inference_session(max_length=32) as session:
                assert session.chain.peer_ids[0] == usual.peer_id
        model.swarm.ban(usual.peer_id)  # lifted again when no chain is left without it (it answers): never the tiny
        try:
            with model.inference_session(max_length=32) as session:
                assert tiny.peer_id not in session.chain.peer_ids
        except NoRouteError:
            pass
    config = ClientConfig()  # what a session asks of its nodes: 256 tokens a row (its max_length when less), a
    # node's default limit (8192) at most, a token a row at least
    asked = [config.step_tokens(*size) for size in ((1, 32), (1, 1000), (4, 2), (4, 1000), (64, 1000), (9000, 8))]
    assert asked == [32, 256, 8, 1024, 8192, 9000]
    assert config.step_tokens(1, 0) == 0 and ClientConfig(min_step_tokens=0).step_tokens(1, 32) == 0
    with pytest.raises(ValueError, match="min_step_tokens"):  # above what nodes take by default: refused, not capped
        ClientConfig(min_step_tokens=8193)
