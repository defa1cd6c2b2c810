"""The async client (nesa_node.client.async_model) from an asyncio program: one AsyncDistributedModel, one P2P host,
many generations at once, each with its single-process reference tokens."""

from __future__ import annotations

import asyncio
import threading
import time

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import AsyncDistributedModel
from nesa_node.client.model import LoopThread
from nesa_node.errors import NoRouteError, SessionStateError
from nesa_node.peer import start_peer

GENERATIONS = 8
NEW_TOKENS = 24


def p2pd_children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True) if child.name() == "p2pd"}


async def wait_for_chain_async(model: AsyncDistributedModel, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await model.choose_chain(max_length=64)
            return
        except NoRouteError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


def test_eight_concurrent_generations_through_one_async_client(local_swarm, tiny_llama):
    nodes = [local_swarm.start_node(tiny_llama, start, end, dht_prefix="async") for start, end in ((0, 2), (2, 4))]
    prompts = [
        torch.randint(3, 1000, (1, 4 + index), generator=torch.Generator().manual_seed(index))
        for index in range(GENERATIONS)
    ]
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.inference_mode():
        expected = [
            reference.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            for prompt in prompts
        ]
    before = p2pd_children()

    async def program():
        model = await AsyncDistributedModel.from_pretrained(
            tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="async", compression="none"
        )
        try:
            hosts = p2pd_children() - before  # the client's own p2pd daemons
            await wait_for_chain_async(model)
            peak = 0

            async def watch() -> None:  # how many sessions the nodes hold at once
                nonlocal peak
                while True:
                    peak = max(peak, *(len(node.sessions) for node in nodes))
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            try:
                outputs = await asyncio.gather(
                    *(model.generate(prompt, max_new_tokens=NEW_TOKENS) for prompt in prompts)
                )
            finally:
                watcher.cancel()
            return outputs, hosts, peak, p2pd_children() - before
        finally:
            await model.close()

    outputs, hosts, peak, hosts_after = asyncio.run(program())
    assert len(hosts) == 1 and hosts_after == hosts  # one P2P host for every generation
    assert peak >= 2, peak  # the generations did run at the same time
    for output, reference_tokens in zip(outputs, expected, strict=True):
        assert torch.equal(output, reference_tokens)
    print(f"\n{GENERATIONS} generations at once through one client: up to {peak} sessions open per node")


def test_async_sampling_is_seeded_and_streams_token_by_token(local_swarm, tiny_llama):
    """Sampling with the same seed gives the same tokens; `stream` yields each new token as it is chosen, and
    stopping early closes the session it opened."""
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="async-sampling")
    prompt = torch.tensor([[5, 6, 7, 8]])

    async def program():
        model = await AsyncDistributedModel.from_pretrained(
            tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="async-sampling", compression="none"
        )
        try:
            await wait_for_chain_async(model)
            options = {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.9}
            runs = [
                await model.generate(prompt, max_new_tokens=12, generator=torch.Generator().manual_seed(3), **options)
                for _ in range(2)
            ]
            streamed = []
            stream = model.stream(prompt, max_new_tokens=12)
            async for token in stream:
                streamed.append(int(token[0]))
                if len(streamed) == 5:
                    break
            await stream.aclose()
            greedy = await model.generate(prompt, max_new_tokens=12)
            return runs, streamed, greedy
        finally:
            await model.close()

    runs, streamed, greedy = asyncio.run(program())
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (1, 16)
    assert streamed == greedy[0, 4:9].tolist()
    assert not node.sessions.sessions  # the stream stopped early closed its session


def test_a_stream_sends_each_next_step_ahead_and_a_callers_session_goes_on_where_it_stopped(local_swarm, tiny_llama):
    """With `send_ahead` (a stream's own session, the gateway's), the next token's step is on its way from the
    second token on before the consumer gets a token. On the caller's own session it is off by default: a stream
    stopped early leaves the session at the tokens before the last one yielded, and a later stream goes on to the
    reference tokens."""
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="async-ahead")
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
            prompt, max_new_tokens=12, do_sample=False
        )

    async def stopped_at_five(model, session, **options) -> tuple[list[torch.Tensor], list[int]]:
        """Five tokens, slowly (the step sent ahead completes meanwhile); the steps the session had at each."""
        tokens, steps_seen = [], []
        stream = model.stream(prompt, max_new_tokens=12, session=session, **options)
        async for token in stream:
            tokens.append(token)
            await asyncio.sleep(0.2)
            steps_seen.append(len(session.timings))
            if len(tokens) == 5:
                break
        await stream.aclose()
        return tokens, steps_seen

    async def program():
        model = await AsyncDistributedModel.from_pretrained(
            tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="async-ahead", compression="none"
        )
        try:
            await wait_for_chain_async(model)
            async with model.inference_session(max_length=16) as session:
                ahead_tokens, ahead_steps = await stopped_at_five(model, session, send_ahead=True)
            async with model.inference_session(max_length=16) as session:
                tokens, steps_seen = await stopped_at_five(model, session)
                position = session.position
                ids = torch.cat([prompt, torch.stack(tokens, dim=1)], dim=1)  # everything the caller has seen
                rest = [token async for token in model.stream(ids, max_new_tokens=7, session=session)]
            return ahead_tokens, ahead_steps, tokens, steps_seen, position, rest
        finally:
            await model.close()

    ahead_tokens, ahead_steps, tokens, steps_seen, position, rest = asyncio.run(program())
    # at the first token, the prefill alone; from the second on, the step of the token in hand is already done
    assert ahead_steps == [1, 3, 4, 5, 6], ahead_steps
    assert steps_seen == [1, 2, 3, 4, 5], steps_seen
    assert torch.equal(torch.stack(ahead_tokens, dim=1), reference[:, 4:9])
    assert position == 4 + 4  # the prompt and the tokens before the fifth
    assert torch.equal(torch.cat([prompt, torch.stack(tokens + rest, dim=1)], dim=1), reference)
    assert not node.sessions.sessions


def test_unknown_keywords_are_refused(tiny_llama):
    with pytest.raises(TypeError, match="unknown client settings"):
        asyncio.run(
            AsyncDistributedModel.from_pretrained(tiny_llama, initial_peers=["/ip4/127.0.0.1/tcp/1"], lane=True)
        )
    from nesa_node import DistributedModelForCausalLM

    with pytest.raises(TypeError, match="unexpected keyword argument 'compresion'"):
        DistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[], compresion="none")


def test_a_cancelled_forward_leaves_nothing_owed_on_a_shared_lane(local_swarm, tiny_llama):
    """A forward cancelled while its answer is owed (a caller's timeout) closes the node's forward lane, so the next
    forward to that node, maybe another request's, reads its own answer and not the stale one."""
    local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="cancelled", inject_delay_ms=300.0)
    first, second = (torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))
    with torch.inference_mode():
        expected = AutoModelForCausalLM.from_pretrained(tiny_llama)(second).logits

    async def program():
        model = await AsyncDistributedModel.from_pretrained(
            tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="cancelled", compression="none"
        )
        try:
            await wait_for_chain_async(model)
            await model.forward(first)  # the forward lane is open and kept
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(model.forward(first), timeout=0.15)  # cancelled with its answer owed
            return await model.forward(second)
        finally:
            await model.close()

    torch.testing.assert_close(asyncio.run(program()), expected, atol=1e-4, rtol=0)


def test_steps_of_one_session_go_one_at_a_time(local_swarm, tiny_llama):
    local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="one-step")

    async def program():
        model = await AsyncDistributedModel.from_pretrained(
            tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="one-step", compression="none"
        )
        try:
            await wait_for_chain_async(model)
            async with model.inference_session(max_length=16) as session:
                hidden = model.embed(torch.tensor([[5, 6, 7]]))
                results = await asyncio.gather(session.step(hidden), session.step(hidden), return_exceptions=True)
                return results, session.position
        finally:
            await model.close()

    (first, second), position = asyncio.run(program())
    assert isinstance(first, torch.Tensor) and first.shape == (1, 3, 64)
    assert isinstance(second, SessionStateError) and "one at a time" in second.message
    assert position == 3


def test_clients_started_at_once_from_several_threads_all_start(local_swarm):
    """Each synchronous client runs its own uvloop loop, and uvloop refuses to spawn a process (p2pd) while another
    loop of the process spawns one: peers started at the same moment from four threads must all come up."""
    errors: list[BaseException] = []

    def start_together(runners: list[LoopThread], barrier: threading.Barrier, peers: list, index: int) -> None:
        barrier.wait(timeout=30)
        try:
            peer = start_peer(initial_peers=local_swarm.initial_peers, host=None, client_mode=True)
            peers[index] = runners[index].call(peer, timeout=60)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    started = 0
    for _ in range(3):
        runners = [LoopThread(f"start-{index}") for index in range(4)]
        barrier, peers = threading.Barrier(len(runners)), [None] * len(runners)
        threads = [
            threading.Thread(target=start_together, args=(runners, barrier, peers, index))
            for index in range(len(runners))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        for runner, peer in zip(runners, peers, strict=True):
            if peer is not None:
                started += 1
                runner.call(peer.shutdown(), timeout=30)
            runner.stop()
    assert not errors, errors
    assert started == 12
