"""A node of a direct chain that refuses the input its previous node pushed accuses that node, which the client
cannot see. The refused step comes back under the pusher's tag (protocol/push_tag.py), which settles it: a malformed
input is the pusher's fault (a ban never lifted early), a well-formed one the refuser's failure. Without that
evidence (a refuser that keeps it back) the accused's kept outputs decide (client/failover.py Failover.judge):
outputs it recorded as NaN are its fault; sane ones leave word against word, so the accused is replaced for a failure
only, and a node that refuses the sane inputs of two different nodes is the one replaced, for a failure too. Either
way the tokens equal one process's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.config import ClientConfig
from nesa_node.devtools.chaos import AfterTokens
from nesa_node.errors import BadRequestError
from nesa_node.protocol.messages import ErrorReply, HistoryRequest
from nesa_node.protocol.push_tag import push_tag
from nesa_node.protocol.tensors import tensor_to_proto
from tests.support.swarm import wait_for_chain

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def reference(tiny_llama) -> torch.Tensor:
    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(tiny_llama)
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)


def connect(swarm, path: str, prefix: str) -> DistributedModelForCausalLM:
    return DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=swarm.initial_peers, dht_prefix=prefix, compression="none"
    )


def generate(model, streamer=None) -> torch.Tensor:
    return model.generate(
        PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, streamer=streamer
    )


@pytest.mark.parametrize("evidence", [True, False], ids=["with-evidence", "evidence-kept-back"])
def test_a_node_refusing_every_pushed_input_is_replaced(local_swarm, tiny_llama, reference, evidence):
    """With the tagged step it refused, a lying refuser is replaced at once; keeping it back, once two nodes' records
    showed their outputs sane."""
    prefix = f"accuser-{evidence}"
    firsts = [local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix) for _ in range(2)]
    liar = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    honest = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    refused = []

    def lie(frame, codec, *, batch):  # every input it is pushed "is malformed"
        refused.append(batch)
        raise BadRequestError("hidden states with NaN or infinite values")

    with connect(local_swarm, tiny_llama, prefix) as model:
        wait_for_chain(model, hops=2, max_length=32)
        model.swarm.ban(honest.peer_id)  # the chain starts on the liar
        liar.compute.read_hidden = lie
        if not evidence:
            liar.inference._refusal = lambda error, step_id, item, session: ErrorReply.of(error, step_id)
        with model.inference_session(max_length=32) as session:
            assert session.chain.peer_ids[1] == liar.peer_id
            first = session.chain.peer_ids[0]
            output = generate(model)
            failed = [(entry["failed"], entry["replacements"]) for entry in session.failovers]
        other = next(node.peer_id for node in firsts if node.peer_id != first)
        assert torch.equal(output, reference)
        assert model.swarm.faulty() == frozenset()  # a refusal may be honest (a position its cache lacks): no fault
        if evidence:  # the tagged input was well formed: the refuser is replaced, the pusher stays
            assert failed == [(liar.peer_id, [honest.peer_id])], session.failovers
            assert len(refused) == 1 and liar.peer_id in model.swarm.banned() and first not in model.swarm.banned()
        else:  # the first accused is replaced for a failure; the second accusation of sane outputs replaces the liar
            assert failed == [(first, [other]), (liar.peer_id, [honest.peer_id])], session.failovers
            assert len(refused) == 2 and {first, liar.peer_id} <= model.swarm.banned()


@pytest.mark.parametrize("how", ["recorded-evidence-kept-back", "pushed-under-its-tag"])
def test_a_node_pushing_nan_is_blamed_on_its_own_word(local_swarm, tiny_llama, reference, how):
    """The first node pushes NaN from the first decode step on. Either it computed the NaN (its record shows them)
    and the refusing node keeps the evidence back: its record convicts it; or it computed and recorded honestly but
    pushed NaN tagged as its own: the refusing node returns the tagged step, which convicts it whatever its record
    says."""
    prefix = f"spoiler-{how}"
    spoiler = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    spare = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    last = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    honest_run, honest_push = spoiler.compute.run, spoiler.inference.push.push

    async def spoil_compute(hidden, cache, position, blocks, adapter=None):
        output, seconds = await honest_run(hidden, cache, position, blocks, adapter)
        return (torch.full_like(output, float("nan")) if position >= PROMPT.shape[1] else output), seconds

    async def spoil_push(session, step, tensors):
        if step.position < PROMPT.shape[1]:
            return await honest_push(session, step, tensors)
        hidden = torch.full((1, 1, spoiler.compute.span.hidden_size), float("nan"))
        spoiled = [tensor_to_proto(hidden)]  # (the session's codec is "none": compression="none")
        step = step.model_copy(update={"tag": push_tag(session.push_key, step, spoiled[0])})
        return await honest_push(session, step, spoiled)

    with connect(local_swarm, tiny_llama, prefix) as model:
        wait_for_chain(model, hops=2, max_length=32)
        model.swarm.ban(spare.peer_id)  # the chain starts on the spoiler
        if how == "pushed-under-its-tag":
            spoiler.inference.push.push = spoil_push
        else:
            spoiler.compute.run = spoil_compute
            last.inference._refusal = lambda error, step_id, item, session: ErrorReply.of(error, step_id)
        with model.inference_session(max_length=32) as session:
            assert session.chain.peer_ids[0] == spoiler.peer_id
            model.swarm.unban(spare.peer_id)
            output = generate(model)
            failed = [(entry["failed"], entry["replacements"]) for entry in session.failovers]
        assert torch.equal(output, reference)
        assert failed == [(spoiler.peer_id, [spare.peer_id])], session.failovers
        assert model.swarm.faulty() == {spoiler.peer_id}


@pytest.mark.parametrize("mode", ["direct", "relay"])
def test_a_node_refusing_the_clients_own_well_formed_steps_is_replaced(local_swarm, tiny_llama, reference, mode):
    """A node answering bad_request to the steps the client itself sends it (the first node; in relay mode any node)
    would turn the user's request into their own error (a gateway's 400): the client's input passes every check an
    honest node makes, so the refuser failed and is replaced, and the tokens equal one process's. An input that is
    not well formed (NaN from the caller) is still the caller's error."""
    prefix = f"own-refuser-{mode}"
    refused_span, other_span = ((0, 2), (2, 4)) if mode == "direct" else ((2, 4), (0, 2))
    other = local_swarm.start_node(tiny_llama, *other_span, dht_prefix=prefix)
    liar, honest = (local_swarm.start_node(tiny_llama, *refused_span, dht_prefix=prefix) for _ in range(2))
    refused = []
    honest_read = liar.compute.read_hidden

    def lie(frame, codec, *, batch):  # every one-token step "is malformed" (a prompt's refusal may be honest)
        hidden = honest_read(frame, codec, batch=batch)
        if hidden.shape[1] == 1:
            refused.append(batch)
            raise BadRequestError("hidden states contain NaN or Inf")
        return hidden

    model = DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix=prefix, compression="none", mode=mode
    )
    with model:
        wait_for_chain(model, hops=2, max_length=32)
        model.swarm.ban(honest.peer_id)  # the chain starts on the liar
        liar.compute.read_hidden = lie
        with model.inference_session(max_length=32) as session:
            assert liar.peer_id in session.chain.peer_ids
            model.swarm.unban(honest.peer_id)
            output = generate(model)
            failed = [(entry["failed"], entry["replacements"]) for entry in session.failovers]
        assert torch.equal(output, reference)
        assert failed == [(liar.peer_id, [honest.peer_id])] and len(refused) == 1, session.failovers
        assert liar.peer_id in model.swarm.banned() and other.peer_id not in model.swarm.banned()
        with model.inference_session(max_length=32) as session:  # the caller's own NaN: the caller's error
            with pytest.raises(BadRequestError):
                session.step(torch.full((1, 1, other.compute.span.hidden_size), float("nan")))


@pytest.mark.parametrize("max_failovers", [3, 2])
def test_a_neighbour_refusing_its_outputs_to_a_replacement_is_replaced_too(
    local_swarm, tiny_llama, reference, max_failovers
):
    """The last node dies mid-generation; its replacement's cache is rebuilt from the outputs the first node kept,
    and the first node refuses them (bad_request). That refusal is the first node's failure, not the user's error:
    it is replaced too, and the tokens equal one process's. Two nodes lost cost two of the step's failovers: the
    last node's recovery cut short by the first node's is not counted (three recoveries)."""
    prefix = f"history-refuser-{max_failovers}"
    refuser, spare_first = (local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix) for _ in range(2))
    victim, spare_last = (local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix) for _ in range(2))
    honest_control = refuser.inference._control

    def refuse_history(session, message):
        if isinstance(message, HistoryRequest):
            raise BadRequestError("no history here")
        return honest_control(session, message)

    refuser.inference._control = refuse_history
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama,
        initial_peers=local_swarm.initial_peers,
        dht_prefix=prefix,
        compression="none",
        config=ClientConfig(max_failovers=max_failovers),
    ) as model:
        wait_for_chain(model, hops=2, max_length=32)
        for spare in (spare_first, spare_last):
            model.swarm.ban(spare.peer_id)  # the chain starts on the refuser and the victim
        with model.inference_session(max_length=32) as session:
            assert session.chain.peer_ids == (refuser.peer_id, victim.peer_id)
            for spare in (spare_first, spare_last):
                model.swarm.unban(spare.peer_id)
            output = generate(model, AfterTokens(2, lambda: local_swarm.stop_node(victim)))
            failed = {entry["failed"] for entry in session.failovers}
        assert torch.equal(output, reference)
        assert {refuser.peer_id, victim.peer_id} <= failed, session.failovers
        assert refuser.peer_id in model.swarm.banned()


def test_a_node_refusing_every_open_is_passed_over_not_the_end_of_the_session(local_swarm, tiny_llama, reference):
    """A node that answers every open with a refusal of no routable kind (bad_request here) would otherwise fail
    every session routed through it: the client leaves it out of that open and routes to another node; once that
    open went through, the next open asking as much leaves it out too (it is not banned)."""
    prefix = "refuser"
    refuser = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    honest = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    opens = []

    async def refuse(request, channel, client_peer, upload=None):
        opens.append(client_peer)
        raise BadRequestError("this node takes no sessions")

    refuser.inference._open = refuse
    with connect(local_swarm, tiny_llama, prefix) as model:
        wait_for_chain(model, hops=2, max_length=32)
        model.swarm.ban(honest.peer_id)  # routing picks the refuser first
        with model.inference_session(max_length=32) as session:
            assert session.chain.peer_ids[0] == honest.peer_id  # (its failure ban lifted: no chain without it)
            output = generate(model)
        assert torch.equal(output, reference)
        assert len(opens) == 1 and model.swarm.faulty() == frozenset()
        assert refuser.peer_id not in model.swarm.banned()
        model.swarm.ban(honest.peer_id)  # routing would pick the refuser first again
        with model.inference_session(max_length=32) as session:
            assert session.chain.peer_ids[0] == honest.peer_id
        assert len(opens) == 1  # not asked: it refused as much before
        model.swarm.ban(honest.peer_id)
        with model.inference_session(max_length=16) as session:  # less than it refused: it is asked again
            assert session.chain.peer_ids[0] == honest.peer_id
        assert len(opens) == 2


def test_the_only_node_of_a_span_refusing_the_open_is_named_with_its_refusal(local_swarm, tiny_llama):
    prefix = "only-refuser"
    refuser = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)

    async def refuse(request, channel, client_peer, upload=None):
        raise BadRequestError("this node takes no sessions")

    refuser.inference._open = refuse
    with connect(local_swarm, tiny_llama, prefix) as model:
        wait_for_chain(model, hops=2, max_length=32)
        with pytest.raises(BadRequestError, match="this node takes no sessions") as refused:
            generate(model)
        assert refused.value.peer_id == refuser.peer_id  # not "no route": the caller sees why
