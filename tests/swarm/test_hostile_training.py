"""Hostile peers against LoRA training (RELIABILITY.md G): raw libp2p peers send malformed or out-of-place training
opens, passes and replica gradients to a real node. Each is answered with a typed ErrorReply, and an honest
data-parallel FineTuningSession on the same node keeps training; gradients from anyone but a named replica, or of
the wrong size, values or round, never reach a session's slices.

Two in-process nodes of the tiny Llama: A serves blocks 0:2 (the target), B serves 2:4. The honest client trains with
two data-parallel chains, so A holds two sessions of it that name each other as replicas. The last section turns it
around: a node answering a training client with more than the client can legitimately receive is failed and replaced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID

from nesa_node.client.finetune import FineTuningSession
from nesa_node.devtools.tiny_model import TinyModelSpec, build_config
from nesa_node.errors import AdapterBudgetError, BadRequestError, NesaError, NotFiniteError
from nesa_node.protocol import lane, rpc
from nesa_node.protocol.channel import ChannelClosedError, Frame, LaneChannel, frame, read
from nesa_node.protocol.framing import StreamChannel, open_stream
from nesa_node.protocol.messages import (
    FROM_TRAINING,
    TICKET_ANSWERS,
    TRAIN_SYNC_ANSWERS,
    ErrorReply,
    Message,
    OpenTraining,
    Replica,
    TrainApplied,
    TrainApply,
    TrainBackward,
    TrainForward,
    TrainGrad,
    TrainOpened,
    TrainOutput,
    TrainState,
    TrainStateRequest,
    TrainSync,
    TrainSynced,
)
from nesa_node.protocol.tensors import bytes_to_proto, tensor_to_proto
from nesa_node.server import training as training_module
from nesa_node.server.training import activation_bytes
from nesa_node.sharding.blocks import load_config
from nesa_node.sharding.lora import AdapterSlice, projection_shapes
from nesa_node.sharding.lora_train import LoraSpec, OptimizerState, TrainableSlice, init_adapter
from tests.support.swarm import wait_until

PREFIX = "hostile-train"
HIDDEN = 64  # the tiny Llama's hidden size
MAX_TOKENS = 64
LIMITS = {
    "max_training_sessions": 6,
    "max_cache_share_per_peer": 0.34,  # two training sessions per peer
    "max_tokens_per_step": MAX_TOKENS,
    "max_message_bytes": 1 << 20,
    "step_timeout_s": 8.0,  # how long a session whose forward waits for its backward pass is safe from preemption
}
SHARE = 2
SPEC = LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "v_proj"))
MODEL_CONFIG = build_config(TinyModelSpec(arch="llama"), vocab_size=1024)  # what tiny_llama is built from
CLIENT_FRAME_BYTES = 1 << 22


@dataclass
class Target:
    swarm: object
    node: object  # A: blocks 0:2
    honest: FineTuningSession
    attackers: list[P2P]  # two raw libp2p peers, each its own identity
    model_path: str
    batch: torch.Tensor

    @property
    def attacker(self) -> P2P:
        return self.attackers[0]

    def run(self, coroutine, timeout: float = 60.0):
        return self.swarm.run(coroutine, timeout=timeout)

    @property
    def honest_peer(self) -> str:
        return self.honest.inner.model.swarm.peer_id

    def honest_keys(self) -> set[tuple[str, str]]:
        return {(self.honest_peer, chain[0].session_id) for chain in self.honest.inner.chains}

    def honest_hashes(self) -> tuple[str, str]:
        return self.honest.adapter(0).sha256, self.honest.adapter(1).sha256


@pytest.fixture(scope="module")
def target(module_swarm, tiny_llama):
    assert projection_shapes(load_config(tiny_llama)) == projection_shapes(MODEL_CONFIG)
    node = module_swarm.start_node(tiny_llama, 0, 2, dht_prefix=PREFIX, **LIMITS)
    module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=PREFIX, **LIMITS)
    peers = module_swarm.peers_with(node)

    async def identities() -> list[P2P]:
        return list(await asyncio.gather(*(P2P.create(initial_peers=peers) for _ in range(2))))

    attackers = module_swarm.run(identities())
    honest = None
    try:
        honest = FineTuningSession.create(
            tiny_llama,
            initial_peers=module_swarm.initial_peers,
            dht_prefix=PREFIX,
            spec=SPEC,
            seed=3,
            lr=1e-3,
            data_parallel=2,
        )
        assert [hop.peer_id for hop in honest.chain] == [node.peer_id, module_swarm.nodes[1].peer_id]
        batch = torch.randint(3, 1000, (2, 8), generator=torch.Generator().manual_seed(5))
        yield Target(module_swarm, node, honest, attackers, tiny_llama, batch)
    finally:
        if honest is not None:
            honest.close()

        async def shutdown() -> None:
            await asyncio.gather(*(p2p.shutdown() for p2p in attackers), return_exceptions=True)

        module_swarm.run(shutdown())


@pytest.fixture(autouse=True)
def honest_keeps_training(target):
    """After each test: the node holds no session but the honest client's, and its next training step works."""
    yield
    wait_until(lambda: set(target.node.training.sessions) == target.honest_keys())
    before = target.honest.step
    loss = target.honest.train_step(target.batch)
    assert math.isfinite(loss) and target.honest.step == before + 1
    first, second = target.honest_hashes()
    assert first == second  # the replicas took the same step


# ---- helpers ---------------------------------------------------------------------------------------------------------


@functools.cache
def adapter(seed: int = 1) -> AdapterSlice:
    """A new adapter of SPEC over every block of the tiny Llama (the conftest's TinyModelSpec)."""
    return init_adapter(MODEL_CONFIG, SPEC, seed)


def opening(
    *,
    start: int = 0,
    end: int = 2,
    piece=None,
    session_id: str = "attack",
    sha256: str | None = None,
    optimizer: bytes | None = None,
    optimizer_sha256: str | None = None,
    extra: list | None = None,
    replicas: tuple[Replica, ...] = (),
    step: int = 0,
) -> Frame:
    piece = piece if piece is not None else adapter().narrow(start, end)
    data = piece.to_bytes()
    if optimizer is not None and optimizer_sha256 is None:
        optimizer_sha256 = hashlib.sha256(optimizer).hexdigest()
    message = OpenTraining(
        session_id=session_id,
        start_block=start,
        end_block=end,
        slice_sha256=sha256 or piece.sha256,
        lr=1e-3,
        optimizer_sha256=optimizer_sha256,
        replicas=replicas,
        step=step,
    )
    tensors = [bytes_to_proto(data)] + ([bytes_to_proto(optimizer)] if optimizer is not None else []) + (extra or [])
    return frame(message, tensors)


def forward(step_id: str, hidden: torch.Tensor, **fields) -> Frame:
    return frame(TrainForward(step_id=step_id, **fields), [tensor_to_proto(hidden)])


def backward(step_id: str, grad: torch.Tensor, **fields) -> Frame:
    return frame(TrainBackward(step_id=step_id, **fields), [tensor_to_proto(grad)])


def hidden(rows: int, tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


async def ask(channel: StreamChannel, request: Frame) -> Message | None:
    """Send `request`, read the node's answer (None when it ended the stream)."""
    channel.send(request)
    async with asyncio.timeout(20):
        await channel.drain()
        answer = await channel.receive()
    return None if answer is None else read(answer, FROM_TRAINING)


async def converse(p2p: P2P, node, requests: list[Frame]) -> list[Message | None]:
    """The requests on one training stream, one answer each, until the node ends the stream (a last None)."""
    channel = await open_stream(p2p, node.peer_id, rpc.TRAIN, max_frame_bytes=CLIENT_FRAME_BYTES)
    answers = []
    try:
        for request in requests:
            answers.append(await ask(channel, request))
            if answers[-1] is None:
                break
        return answers
    finally:
        channel.close()


def code(answer: Message | None) -> str:
    assert isinstance(answer, ErrorReply), answer
    return answer.code


def refusal(target: Target, requests: list[Frame]) -> ErrorReply:
    """The answer to the last of `requests`, which must be a typed error."""
    answers = target.run(converse(target.attacker, target.node, requests))
    assert isinstance(answers[-1], ErrorReply), answers
    return answers[-1]


def limited(training, monkeypatch, **changes):
    """The node's training limits with `changes`, for the test's length (monkeypatch undoes them)."""
    monkeypatch.setattr(training, "limits", dataclasses.replace(training.limits, **changes))
    return training.limits


def raw(fields: dict, tensors: list | None = None) -> Frame:
    """A frame written by hand, as a hostile peer would, rather than by the message models."""
    return Frame(metadata=msgpack.packb(fields), tensors=tensors or [])


def optimizer_state_bytes(corrupt=None) -> bytes:
    """AdamW's canonical state of blocks 0:2 after one step, `corrupt(tensors)` applied first."""
    trainable = TrainableSlice(adapter().narrow(0, 2))
    optimizer = torch.optim.AdamW(trainable.parameters(), lr=1e-3, foreach=False)
    for parameter in trainable.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    state = trainable.optimizer_state(optimizer)
    tensors = dict(state.tensors)
    if corrupt is not None:
        corrupt(tensors)
    return OptimizerState(state.start, state.end, state.step, tensors).to_bytes()


def _nan(tensors):
    name = next(name for name in sorted(tensors) if name.endswith("exp_avg"))
    tensors[name] = tensors[name].clone().fill_(float("nan"))


def _transposed(tensors):
    name = next(name for name in sorted(tensors) if name.endswith("lora_A.exp_avg_sq"))
    tensors[name] = tensors[name].t().contiguous()


def _negative(tensors):
    name = next(name for name in sorted(tensors) if name.endswith("exp_avg_sq"))
    tensors[name] = -tensors[name] - 1.0


# ---- opening a training session --------------------------------------------------------------------------------------


OPENS = {
    "slice bytes not matching slice_sha256": (
        lambda: opening(sha256=adapter(2).narrow(0, 2).sha256),
        "adapter_hash",
        "hash to",
    ),
    "a slice of other blocks than the open's": (
        lambda: opening(piece=adapter().narrow(0, 1)),
        "adapter",
        "the slice holds blocks 0:1, the session 0:2",
    ),
    "blocks outside the node's span": (
        lambda: opening(start=2, end=4),
        "wrong_blocks",
        "serves blocks 0..1",
    ),
    "blocks past the model": (lambda: raw_open(end_block=9), "bad_request", "unknown block"),
    "two tensors without optimizer_sha256": (
        lambda: opening(extra=[bytes_to_proto(b"\0" * 32)]),
        "bad_request",
        "carries",
    ),
    "an optimizer state named but not sent": (
        lambda: frame(
            OpenTraining(**{**_open_fields(), "optimizer_sha256": "a" * 64}),
            [bytes_to_proto(adapter().narrow(0, 2).to_bytes())],
        ),
        "bad_request",
        "carries",
    ),
    "garbage optimizer state": (
        lambda: opening(optimizer=b"\x05not an optimizer state"),
        "adapter",
        "not an optimizer",
    ),
    "an optimizer state of another hash": (
        lambda: opening(optimizer=optimizer_state_bytes(), optimizer_sha256="b" * 64),
        "adapter_hash",
        "hash to",
    ),
    "NaN optimizer moments": (lambda: opening(optimizer=optimizer_state_bytes(_nan)), "adapter", "not finite"),
    "optimizer moments of the wrong shape": (
        lambda: opening(optimizer=optimizer_state_bytes(_transposed)),
        "adapter",
        "not of shape",
    ),
    "negative second moments": (lambda: opening(optimizer=optimizer_state_bytes(_negative)), "adapter", "negative"),
    "a slice with no factors": (lambda: opening(piece=AdapterSlice(0, 2, {})), "adapter", "no LoRA factors"),
    "slice bytes that are a byte tensor of another dtype": (
        lambda: frame(OpenTraining(**_open_fields()), [tensor_to_proto(torch.zeros(16))]),
        "bad_request",
        "expected bytes",
    ),
    "a pass before any open": (lambda: forward("s1", hidden(1, 4)), "bad_request", "expected a train_open"),
    "a learning rate that is NaN": (lambda: raw_open(lr=float("nan")), "bad_request", "lr"),
    "a replica that is not a peer id": (
        lambda: raw_open(replicas=[{"peer": "not-a-peer-id", "session_id": "x"}]),
        "bad_request",
        "not a valid peer id",
    ),
    "more replicas than allowed": (
        lambda: raw_open(replicas=[{"peer": _PEER, "session_id": f"r{index}"} for index in range(17)]),
        "bad_request",
        "replicas",
    ),
    "metadata that is not msgpack": (lambda: Frame(metadata=b"\xc1\xc1"), "bad_request", "not valid msgpack"),
    "a replica sync on the training stream": (
        lambda: raw({"kind": "train_sync", "owner": "x", "session_id": "y", "from_session_id": "z", "round": 1}),
        "bad_request",
        "does not match any of the expected tags",
    ),
}


_PEER = "QmVZ6rbVHDr7GpaW6ZFJQFDLP1BPu4c9X9xujJD6Cv4Xzk"  # a well-formed peer id of nobody


def _open_fields() -> dict:
    piece = adapter().narrow(0, 2)
    return {"kind": "train_open", "session_id": "attack", "start_block": 0, "end_block": 2, "slice_sha256": piece.sha256,
            "lr": 1e-3}  # fmt: skip


def raw_open(**changes) -> Frame:
    """An open written by hand, with the slice of blocks 0:2 it names."""
    return raw({**_open_fields(), **changes}, [bytes_to_proto(adapter().narrow(0, 2).to_bytes())])


@pytest.mark.parametrize(("build", "expected", "text"), OPENS.values(), ids=OPENS.keys())
def test_g1_a_bad_training_open_gets_a_typed_error(target, build, expected, text):
    error = refusal(target, [build()])
    assert error.code == expected, error
    assert text in error.message, error


def test_g1_the_control_open_is_accepted_and_resumes_adamw(target):
    """The opens above differ from these by the one thing they break: a valid slice with or without AdamW's state
    opens, and the session runs a whole step."""
    answers = target.run(
        converse(
            target.attacker,
            target.node,
            [
                opening(optimizer=optimizer_state_bytes()),
                forward("s1", hidden(1, 4)),
                backward("s1", hidden(1, 4, seed=1)),
                frame(TrainStateRequest()),
            ],
        )
    )
    assert isinstance(answers[0], TrainOpened)
    assert isinstance(answers[1], TrainOutput) and isinstance(answers[2], TrainGrad) and answers[2].step == 1
    assert isinstance(answers[3], TrainState) and answers[3].step == 1
    hand_written = target.run(converse(target.attacker, target.node, [raw_open()]))
    assert isinstance(hand_written[0], TrainOpened)  # the control of the hand-written opens


def test_g1_a_second_open_on_the_same_stream_is_refused_and_the_session_goes_on(target):
    answers = target.run(
        converse(
            target.attacker,
            target.node,
            [opening(), opening(session_id="again"), forward("s1", hidden(1, 4), keep=False)],
        )
    )
    assert isinstance(answers[0], TrainOpened)
    assert code(answers[1]) == "bad_request" and "open already" in answers[1].message
    assert isinstance(answers[2], TrainOutput)


# ---- passes ------------------------------------------------------------------------------------------------------


def test_g1_a_backward_for_a_step_never_forwarded(target):
    error = refusal(target, [opening(), backward("never", hidden(1, 4))])
    assert error.code == "bad_request" and "no forward pass never" in error.message
    assert error.step_id == "never"


def test_g1_a_gradient_of_the_wrong_shape_is_refused_and_the_step_can_still_be_taken(target):
    answers = target.run(
        converse(
            target.attacker,
            target.node,
            [
                opening(),
                forward("s1", hidden(1, 4)),
                backward("s1", hidden(1, 3)),  # one token short
                backward("s1", hidden(2, 4)),  # another row
                backward("s1", hidden(1, 4, seed=1)[..., : HIDDEN // 2]),  # half the width
                backward("s1", torch.full((1, 4, HIDDEN), float("nan"))),
                backward("s1", hidden(1, 4, seed=1)),
            ],
        )
    )
    assert isinstance(answers[1], TrainOutput)
    assert code(answers[2]) == "bad_request" and "gradient of shape (1, 3, 64)" in answers[2].message
    assert code(answers[3]) == "bad_request" and "batch of 2 rows" in answers[3].message
    assert code(answers[4]) == "bad_request" and "hidden size 32" in answers[4].message
    assert code(answers[5]) == "bad_request" and "NaN" in answers[5].message
    assert isinstance(answers[6], TrainGrad) and answers[6].step == 1  # the saved input survived the refusals


@pytest.mark.parametrize("sends_next", [False, True], ids=["waiting", "sending-the-next-step"])
def test_an_optimizer_step_that_fails_after_its_answer_ends_the_session_typed(target, sends_next):
    """The node answers a backward pass before it takes the step: a step that then fails leaves the slice unusable,
    so the node sends a typed error and ends the stream (the client fails over to its checkpoint). A client that
    keeps sending its next steps meanwhile, which the node does not read, still gets the error before the end."""
    session_id = f"failing-step-{sends_next}"

    async def run() -> list[Message | None]:
        channel = await open_stream(target.attacker, target.node.peer_id, rpc.TRAIN, max_frame_bytes=CLIENT_FRAME_BYTES)
        try:
            answers = [await ask(channel, opening(session_id=session_id))]
            answers.append(await ask(channel, forward("s1", hidden(1, 4))))
            session = target.node.training.sessions[(target.attacker.peer_id.to_base58(), session_id)]

            def failing_step(*args, **kwargs):
                time.sleep(0.5)  # the client's next step arrives meanwhile
                raise RuntimeError("device lost")

            session.optimizer.step = failing_step
            answers.append(await ask(channel, backward("s1", hidden(1, 4, seed=1), apply=True)))

            async def next_steps() -> None:  # a client that does not wait: its next steps, one every 50 ms
                for index in range(2, 200):
                    channel.send(forward(f"s{index}", hidden(1, 4, seed=index)))
                    await asyncio.sleep(0.05)

            sending = asyncio.create_task(next_steps()) if sends_next else None
            try:
                async with asyncio.timeout(20):  # unasked: the node tells the session's end, then ends the stream
                    for _ in range(2):
                        answer = await channel.receive()
                        answers.append(None if answer is None else read(answer, FROM_TRAINING))
            finally:
                if sending is not None:
                    sending.cancel()
            return answers
        finally:
            channel.close()

    answers = target.run(run())
    assert isinstance(answers[2], TrainGrad) and answers[2].step == 1, answers
    assert code(answers[3]) == "adapter" and "optimizer step failed" in answers[3].message
    assert answers[4] is None  # the stream ended
    assert not any(key[1] == session_id for key in target.node.training.sessions)


def test_g1_passes_over_the_token_limit_or_malformed_are_refused(target):
    answers = target.run(
        converse(
            target.attacker,
            target.node,
            [
                opening(),
                forward("long", hidden(1, MAX_TOKENS + 1)),
                forward("wide", hidden(3, MAX_TOKENS // 3 + 1)),
                frame(TrainForward(step_id="none")),  # no tensor
                frame(TrainForward(step_id="two"), [tensor_to_proto(hidden(1, 2))] * 2),
                forward("nan", torch.full((1, 2, HIDDEN), float("inf"))),
                forward("ok", hidden(1, MAX_TOKENS)),  # at the limit: served
                forward("ok", hidden(1, 2)),  # the same step id kept twice
            ],
        )
    )
    limit = f"exceeds the limit of {MAX_TOKENS * HIDDEN} elements"
    assert code(answers[1]) == "bad_request" and limit in answers[1].message
    assert code(answers[2]) == "bad_request" and limit in answers[2].message
    assert code(answers[3]) == "bad_request" and "one tensor" in answers[3].message
    assert code(answers[4]) == "bad_request" and "one tensor" in answers[4].message
    assert code(answers[5]) == "bad_request" and "NaN or Inf" in answers[5].message
    assert isinstance(answers[6], TrainOutput)
    assert code(answers[7]) == "bad_request" and "run already" in answers[7].message


def test_g1_a_frame_over_the_byte_limit_ends_the_stream_with_a_typed_error(target):
    async def run() -> str:
        channel = await open_stream(target.attacker, target.node.peer_id, rpc.TRAIN, max_frame_bytes=CLIENT_FRAME_BYTES)
        try:
            assert isinstance(await ask(channel, opening()), TrainOpened)
            channel.send(
                frame(TrainForward(step_id="big"), [bytes_to_proto(b"\0" * (LIMITS["max_message_bytes"] + 1))])
            )
            with pytest.raises(NesaError) as ended:
                async with asyncio.timeout(20):
                    await channel.drain()
                    await channel.receive()
            return ended.value.code
        finally:
            channel.close()

    assert target.run(run()) == "too_large"


# ---- session limits ----------------------------------------------------------------------------------------------


class Holder:
    """Training sessions held open (idle) by attacker identities until `close`."""

    def __init__(self, target: Target):
        self.target = target
        self.channels: list[StreamChannel] = []

    def open(self, p2p: P2P, session_id: str, **fields) -> Message | None:
        return self.target.run(self.opened(p2p, session_id, **fields))

    async def opened(self, p2p: P2P, session_id: str, **fields) -> Message | None:
        channel = await open_stream(p2p, self.target.node.peer_id, rpc.TRAIN, max_frame_bytes=CLIENT_FRAME_BYTES)
        self.channels.append(channel)
        return await ask(channel, opening(session_id=session_id, **fields))

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


@pytest.fixture
def holder(target):
    holder = Holder(target)
    yield holder
    holder.close()


def test_g3_one_peer_over_its_share_gets_quota_and_a_full_node_too_many_sessions(target, holder):
    first, second = target.attackers
    assert len(target.node.training.sessions) == SHARE  # the honest client's two replicas
    assert all(isinstance(holder.open(first, f"first-{index}"), TrainOpened) for index in range(SHARE))
    over_share = holder.open(first, "first-more")
    assert code(over_share) == "quota" and f"holds {SHARE} training sessions here" in over_share.message
    assert all(isinstance(holder.open(second, f"second-{index}"), TrainOpened) for index in range(SHARE))
    assert len(target.node.training.sessions) == LIMITS["max_training_sessions"]
    assert code(holder.open(first, "first-more")) == "quota"  # a peer at its share cannot preempt anyone
    third = target.run(P2P.create(initial_peers=target.swarm.peers_with(target.node)))
    try:  # a peer under its share, on a node full of sessions none of which has been idle preempt_idle_s
        full = holder.open(third, "third")
        assert code(full) == "too_many_sessions" and "max_training_sessions" in full.message
    finally:
        target.run(third.shutdown())
    # the honest sessions, open before, keep training on the full node
    assert math.isfinite(target.honest.train_step(target.batch))


def test_g1_a_session_id_is_open_once_per_peer(target, holder):
    first, second = target.attackers
    assert isinstance(holder.open(first, "same"), TrainOpened)
    again = holder.open(first, "same")
    assert code(again) == "bad_request" and "open already" in again.message
    assert isinstance(holder.open(second, "same"), TrainOpened)  # ids are scoped to the peer that opened them


def test_g3_concurrent_opens_cannot_pass_the_limits_together(target, holder):
    """Eight opens from one identity at once, each waiting on the same slow checks: only its share is admitted,
    the others are told quota, and the node holds no session it does not count."""
    first = target.attackers[0]

    async def opens() -> list[Message | None]:
        async def one(index: int) -> Message | None:
            channel = await open_stream(first, target.node.peer_id, rpc.TRAIN, max_frame_bytes=CLIENT_FRAME_BYTES)
            holder.channels.append(channel)
            return await ask(channel, opening(session_id=f"together-{index}"))

        return list(await asyncio.gather(*(one(index) for index in range(8))))

    answers = target.run(opens())
    assert sum(isinstance(answer, TrainOpened) for answer in answers) == SHARE
    assert sorted(code(answer) for answer in answers if not isinstance(answer, TrainOpened)) == ["quota"] * 6
    mine = [key for key in target.node.training.sessions if key[0] == first.peer_id.to_base58()]
    assert len(mine) == SHARE


def test_g3_idle_training_sessions_of_throwaway_identities_do_not_lock_out_an_honest_client(target, holder):
    for p2p in target.attackers:
        for index in range(SHARE):
            assert isinstance(holder.open(p2p, f"idle-{index}"), TrainOpened)
    assert len(target.node.training.sessions) == LIMITS["max_training_sessions"]
    idle_s = target.node.config.limits.preempt_idle_s + 0.5
    deadline = time.monotonic() + idle_s
    target.honest.train_step(target.batch)  # the honest sessions are not idle; the attackers' are
    time.sleep(max(0.0, deadline - time.monotonic()))
    started = time.monotonic()
    with FineTuningSession.create(
        target.model_path, initial_peers=target.swarm.initial_peers, dht_prefix=PREFIX, spec=SPEC, lr=1e-3
    ) as newcomer:
        assert math.isfinite(newcomer.train_step(target.batch))
    assert time.monotonic() - started < 15


def test_g3_refused_requests_and_forwards_never_taken_back_do_not_hold_training_places(target, holder):
    """Throwaway identities fill the node: the first's sessions each keep a forward and never send its backward pass,
    the second's send only requests the node refuses or answers from record (the step they opened at, "applied"
    again). Neither is activity: the refusers may be preempted after
    `preempt_idle_s` like idle sessions, the keepers once `step_timeout_s` has passed (an honest session between its
    forward and its backward is safe that long), and a newcomer then trains."""
    keeper, refuser = target.attackers
    limits = target.node.config.limits
    for index in range(SHARE):
        assert isinstance(holder.open(keeper, f"keeper-{index}"), TrainOpened)
        assert isinstance(holder.open(refuser, f"refuser-{index}", step=3), TrainOpened)
    keepers, refusers = holder.channels[0::2], holder.channels[1::2]
    for index, channel in enumerate(keepers):
        assert isinstance(target.run(ask(channel, forward(f"kept-{index}", hidden(1, 4)))), TrainOutput)
    started = time.monotonic()
    keys = {(p2p.peer_id.to_base58(), f"{name}-{index}") for p2p, name in ((keeper, "keeper"), (refuser, "refuser"))
            for index in range(SHARE)}  # fmt: skip
    assert (
        keys <= set(target.node.training.sessions)
        and len(target.node.training.sessions) == LIMITS["max_training_sessions"]
    )

    def refuse_until(until: float) -> None:
        async def run():
            while time.monotonic() < until:
                for channel in refusers:
                    answer = await ask(channel, backward("never", hidden(1, 4)))
                    assert code(answer) == "bad_request"
                    assert isinstance(await ask(channel, frame(TrainApply(update=3))), TrainApplied)
                await asyncio.sleep(0.25)

        target.run(run(), timeout=until - time.monotonic() + 30)

    def preemptible() -> set[tuple[str, str]]:
        training = target.node.training
        return {(s.client_peer, s.session_id) for s in training._preemptible(time.monotonic())}

    refuse_until(started + limits.preempt_idle_s + 0.5)
    waiting = preemptible()
    assert {key for key in keys if key[1].startswith("refuser")} <= waiting  # refused requests kept none busy
    assert not {key for key in keys if key[1].startswith("keeper")} & waiting  # forwards still guard their sessions
    time.sleep(max(0.0, started + limits.step_timeout_s + 0.5 - time.monotonic()))
    target.honest.train_step(target.batch)
    assert preemptible() == keys  # the honest sessions just stepped; every attacker session may go
    with FineTuningSession.create(
        target.model_path,
        initial_peers=target.swarm.initial_peers,
        dht_prefix=PREFIX,
        spec=SPEC,
        lr=1e-3,
        data_parallel=2,
    ) as newcomer:
        assert math.isfinite(newcomer.train_step(target.batch))


def test_g3_an_open_over_the_share_is_refused_before_its_bytes_are_read(target, holder):
    first = target.attackers[0]
    for index in range(SHARE):
        assert isinstance(holder.open(first, f"full-{index}"), TrainOpened)
    bad = target.run(converse(first, target.node, [opening(session_id="bad", sha256="0" * 64)]))
    assert code(bad[0]) == "quota"  # not adapter_hash: the slice's bytes were never parsed


def test_g3_concurrent_forwards_of_two_sessions_cannot_pass_the_training_memory_together(target, holder, monkeypatch):
    """Each forward fits the training memory left, not both: the first reserves its room before it runs, so the
    second, arriving while the first computes, is refused (adapter_budget), and the node never holds more."""
    first, second = target.attackers
    assert isinstance(holder.open(first, "memory-a"), TrainOpened)
    assert isinstance(holder.open(second, "memory-b"), TrainOpened)
    training = target.node.training
    rows = hidden(1, 3)
    graph = activation_bytes(training.compute.span, 3, (0, 2))
    room = training.used_bytes + rows.nbytes + rows.nbytes // 2
    # room for either forward's input, not for a graph (none kept, none to give way), while a backward pass's
    # activations fit the whole (else both are refused for that)
    assert rows.nbytes // 2 < graph < room
    # the node's whole training memory is the limit here (a peer's share of it: the next tests)
    limited(training, monkeypatch, max_training_mb=room / 2**20, max_cache_share_per_peer=1.0)
    run_work = training.compute.run_work
    started, second_answered = asyncio.Event(), asyncio.Event()

    async def held(work):  # the first forward computes until the second has its answer
        if not started.is_set():
            started.set()
            await second_answered.wait()
        return await run_work(work)

    monkeypatch.setattr(training.compute, "run_work", held)

    async def both():
        one = asyncio.create_task(ask(holder.channels[0], forward("a", rows)))
        async with asyncio.timeout(20):
            await started.wait()
        try:
            two = await ask(holder.channels[1], forward("b", rows))
        finally:
            second_answered.set()
        return await one, two

    answer_a, answer_b = target.run(both())
    assert isinstance(answer_a, TrainOutput)
    assert code(answer_b) == "adapter_budget" and "max_training_mb" in answer_b.message
    assert training.used_bytes <= training.max_state_bytes


def test_g1_a_fault_serving_a_training_lane_ends_that_connection_alone(target, monkeypatch, caplog):
    """Something other than a typed refusal going wrong while a node serves a TRAIN lane (a device fault, say) ends
    that connection, logged as one warning line: no unhandled traceback, and the node goes on (the honest client
    trains on its own lanes after the test)."""

    async def faulty(channel, peer: str) -> None:
        raise RuntimeError("device fault")

    monkeypatch.setattr(target.node.lanes, "train", faulty)

    async def attempt():
        answer = await target.attacker.call_protobuf_handler(
            PeerID.from_base58(target.node.peer_id), rpc.LANE_TICKET, Frame(), Frame
        )
        ticket = read(answer, TICKET_ANSWERS)
        stream = await lane.connect(
            target.node.lanes.address, lane.ROLE_TRAIN, ticket.ticket, bytes.fromhex(ticket.key)
        )
        channel = LaneChannel(stream)
        try:
            channel.send(opening(session_id="faulty"))
            async with asyncio.timeout(10):
                return await channel.receive()
        except ChannelClosedError:
            return None
        finally:
            channel.close()

    with caplog.at_level(logging.WARNING):
        assert target.run(attempt()) is None  # the lane ended, nothing answered
        wait_until(lambda: any("device fault" in record.getMessage() for record in caplog.records))
    faults = [record for record in caplog.records if "device fault" in record.getMessage()]
    assert [(record.name, record.levelno, record.exc_info) for record in faults] == [
        ("nesa_node.server.lanes", logging.WARNING, None)
    ]


def test_g3_concurrent_opens_cannot_build_more_training_state_than_the_memory_holds(target, holder, monkeypatch):
    """An open's float32 state (parameters, gradients, AdamW's moments) is reserved while the node builds it: with
    room for one, a second open arriving while the first builds is refused (adapter_budget) before anything of it
    is built, and the first is admitted."""
    first, second = target.attackers
    training = target.node.training
    estimate = 16 * numel_of(adapter().narrow(0, 2))
    room = (training.used_bytes + estimate * 3 // 2) / 2**20
    limited(
        training, monkeypatch, max_training_mb=room, preempt_idle_s=3600.0, max_cache_share_per_peer=1.0
    )  # nobody idle long enough to be preempted: only the reservation decides
    building, release, built = threading.Event(), threading.Event(), []
    trainable_slice = training_module.TrainableSlice

    def held(*args, **kwargs):  # the first build waits until the second open has its answer
        built.append(args)
        building.set()
        release.wait(20)
        return trainable_slice(*args, **kwargs)

    monkeypatch.setattr(training_module, "TrainableSlice", held)

    async def both():
        one = asyncio.create_task(holder.opened(first, "builds-first"))
        assert await asyncio.to_thread(building.wait, 20)
        try:
            two = await holder.opened(second, "builds-second")
        finally:
            release.set()
        return await one, two

    answer_one, answer_two = target.run(both())
    assert isinstance(answer_one, TrainOpened)
    assert code(answer_two) == "adapter_budget" and "being built" in answer_two.message
    assert len(built) == 1 and not training.room.opening
    assert training.used_bytes <= training.max_state_bytes


def test_g3_a_peer_past_its_share_borrows_free_training_memory_and_gives_it_back(target, holder, monkeypatch):
    """Saved forwards of a peer past its share of max_training_mb (max_cache_share_per_peer) take only free memory;
    when a peer within its share needs the room, the newest of them is dropped, and its backward pass is refused as
    preempted (its client starts the pass again, blaming nobody). With nothing to take back, it is refused."""
    borrower, other = target.attackers
    assert isinstance(holder.open(borrower, "borrows"), TrainOpened)
    assert isinstance(holder.open(other, "within"), TrainOpened)
    training, room = target.node.training, target.node.training.room
    small, large = hidden(1, 1), hidden(1, 3)
    budget = training.used_bytes + large.nbytes + small.nbytes // 2  # free room for the large forward alone
    share = (room.peer_bytes(borrower.peer_id.to_base58()) + small.nbytes) / budget
    limited(training, monkeypatch, max_training_mb=budget / 2**20, max_cache_share_per_peer=share)
    borrowing, within = holder.channels
    assert isinstance(target.run(ask(borrowing, forward("large", large))), TrainOutput)  # past its share, free room
    assert isinstance(target.run(ask(within, forward("small", small))), TrainOutput)  # within its share: taken back
    session = training.sessions[(borrower.peer_id.to_base58(), "borrows")]
    assert "large" not in session.saved and training.used_bytes <= training.max_state_bytes
    late = target.run(ask(borrowing, backward("large", large)))
    assert code(late) == "preempted" and "dropped to make room" in late.message
    refused = target.run(ask(borrowing, forward("again", large)))  # no free room, and nothing it may take back
    assert code(refused) == "adapter_budget" and "max_training_mb" in refused.message
    assert isinstance(target.run(ask(within, backward("small", small))), TrainGrad)  # the peer within keeps its pass


def test_g3_an_open_within_its_share_takes_back_what_a_busy_borrower_holds(target, holder, monkeypatch):
    """A peer whose saved forwards fill the free training memory past its share, and that keeps stepping (so none of
    its sessions is idle), does not keep a newcomer within its share out: the open takes back the borrower's newest
    forwards, as many as it needs, and their backward passes are refused as preempted."""
    borrower, newcomer = target.attackers
    assert isinstance(holder.open(borrower, "borrows-much"), TrainOpened)
    training, room = target.node.training, target.node.training.room
    fixed = room.peer_bytes(borrower.peer_id.to_base58())  # what the newcomer's open needs too
    rows, count = hidden(1, 3), 24
    assert count * rows.nbytes > fixed
    budget = training.used_bytes + count * rows.nbytes + fixed // 2
    limited(
        training,
        monkeypatch,
        max_training_mb=budget / 2**20,
        max_cache_share_per_peer=(fixed + rows.nbytes) / budget,
        max_queued_steps=count,
        max_training_sessions=10**6,
    )  # sessions are shared out by the same fraction: only the bytes decide here
    channel = holder.channels[0]
    for index in range(count):  # each in free memory, past the borrower's share
        assert isinstance(target.run(ask(channel, forward(f"f{index}", rows))), TrainOutput)
    assert training.used_bytes + fixed > training.max_state_bytes and not training._preemptible(time.monotonic())
    assert isinstance(holder.open(newcomer, "newcomer"), TrainOpened)
    session = training.sessions[(borrower.peer_id.to_base58(), "borrows-much")]
    kept = [f"f{index}" for index in range(count) if f"f{index}" in session.saved]
    assert kept == [f"f{index}" for index in range(len(kept))] and 0 < len(kept) < count  # the newest went
    late = target.run(ask(channel, backward(f"f{count - 1}", rows)))
    assert code(late) == "preempted"
    assert isinstance(target.run(ask(channel, backward("f0", rows))), TrainGrad)
    assert training.used_bytes <= training.max_state_bytes


def test_g3_an_open_that_cannot_fit_takes_nothing_back(target, holder, monkeypatch):
    """An open that would not fit even with everything it may take back (a kept graph, forwards borrowed past a
    share) is refused before anything gives way: a newcomer sending opens too large for the room cannot wipe a
    borrower's graphs and forwards again and again."""
    borrower, newcomer = target.attackers
    assert isinstance(holder.open(borrower, "borrows-little"), TrainOpened)
    training, room = target.node.training, target.node.training.room
    fixed = room.peer_bytes(borrower.peer_id.to_base58())
    assert isinstance(target.run(ask(holder.channels[0], forward("g", hidden(1, 1)))), TrainOutput)  # graph kept
    session = training.sessions[(borrower.peer_id.to_base58(), "borrows-little")]
    graph = session.saved["g"].graph_bytes
    rows, count, free = hidden(1, 3), 2, 256
    budget = training.used_bytes + count * rows.nbytes + free
    assert 0 < graph and graph + count * rows.nbytes + free < fixed  # all that could give way: still short
    limited(
        training,
        monkeypatch,
        max_training_mb=budget / 2**20,
        max_cache_share_per_peer=(fixed + rows.nbytes) / budget,
        max_queued_steps=count + 1,
        max_training_sessions=10**6,
    )
    for index in range(count):
        assert isinstance(target.run(ask(holder.channels[0], forward(f"f{index}", rows))), TrainOutput)
    refused = holder.open(newcomer, "too-large")
    assert code(refused) == "adapter_budget"
    assert list(session.saved) == ["g"] + [f"f{index}" for index in range(count)] and not session.dropped
    assert session.saved["g"].graph_bytes == graph and session.saved["g"].graph is not None


def test_g3_saved_inputs_whose_backward_is_overdue_make_room_for_other_sessions(target, holder, monkeypatch):
    """A session kept alive by other requests cannot hold its saved forwards for ever: once a forward's backward pass
    is overdue (past the step timeout an honest chain answers within), its input is dropped when another session
    needs the room, and that backward pass is refused if it ever comes. Before that, the room is the keeper's."""
    keeper, other = target.attackers
    assert isinstance(holder.open(keeper, "keeps"), TrainOpened)
    assert isinstance(holder.open(other, "needs-room"), TrainOpened)
    training = target.node.training
    kept, needed = hidden(1, 8), hidden(1, 4)
    assert isinstance(target.run(ask(holder.channels[0], forward("kept", kept))), TrainOutput)
    session = training.sessions[(keeper.peer_id.to_base58(), "keeps")]
    session.drop_graphs()  # graphs give way first (recomputed): here only the saved input holds the room
    budget = training.used_bytes + needed.nbytes // 2  # what the other forward lacks is the kept forward's room
    limits = limited(training, monkeypatch, max_training_mb=budget / 2**20, max_cache_share_per_peer=1.0)
    refused = target.run(ask(holder.channels[1], forward("fresh", needed)))
    assert code(refused) == "adapter_budget" and "max_training_mb" in refused.message
    overdue_s = max(limits.preempt_idle_s, limits.step_timeout_s) + 1
    session.saved["kept"].at -= overdue_s  # its backward pass overdue, and the session silent as long
    session.last_active -= overdue_s
    assert isinstance(target.run(ask(holder.channels[1], forward("later", needed))), TrainOutput)
    assert "kept" not in session.saved and training.used_bytes <= training.max_state_bytes
    late = target.run(ask(holder.channels[0], backward("kept", kept)))
    assert code(late) == "preempted" and "dropped to make room" in late.message


# ---- replica gradients (nesa.train_sync) ---------------------------------------------------------------------------


async def sync(p2p: P2P, node, message: TrainSync | Frame, tensors: list | None = None) -> Message:
    request = message if isinstance(message, Frame) else frame(message, tensors or [])
    channel = await open_stream(p2p, node.peer_id, rpc.TRAIN_SYNC, max_frame_bytes=CLIENT_FRAME_BYTES)
    try:
        channel.send(request)
        async with asyncio.timeout(20):
            await channel.drain()
            answer = await channel.receive()
        assert answer is not None
        return read(answer, TRAIN_SYNC_ANSWERS)
    finally:
        channel.close()


def numel_of(piece) -> int:
    return sum(factor.lora_a.numel() + factor.lora_b.numel() for factor in piece.factors.values())


def test_g5_gradients_from_anyone_but_a_named_replica_are_refused(target):
    """The honest sessions name each other (on node A itself) as replicas: an attacker claiming to be one of them,
    or naming a session that does not exist, is refused and the slices stay as they were."""
    before = target.honest_hashes()
    owner = target.honest_peer
    ids = [chain[0].session_id for chain in target.honest.inner.chains]
    gradients = [tensor_to_proto(torch.full((numel_of(adapter().narrow(0, 2)),), 1e3))]
    attempts = {
        "a replica's session id, from another peer": TrainSync(
            owner=owner, session_id=ids[0], from_session_id=ids[1], round=target.honest.step + 1
        ),
        "the session itself as sender": TrainSync(
            owner=owner, session_id=ids[0], from_session_id=ids[0], round=target.honest.step + 1
        ),
        "a session that does not exist": TrainSync(
            owner=owner, session_id="no-such-session", from_session_id=ids[1], round=target.honest.step + 1
        ),
        "the session under another owner": TrainSync(
            owner=target.attacker.peer_id.to_base58(), session_id=ids[0], from_session_id=ids[1], round=1
        ),
    }
    answers = {
        name: target.run(sync(target.attacker, target.node, message, gradients)) for name, message in attempts.items()
    }
    assert code(answers["a replica's session id, from another peer"]) == "bad_request"
    assert "not a replica" in answers["a replica's session id, from another peer"].message
    assert "not a replica" in answers["the session itself as sender"].message
    assert "no training session" in answers["a session that does not exist"].message
    assert "no training session" in answers["the session under another owner"].message
    for key in target.honest_keys():
        assert not target.node.training.sessions[key].inbox  # nothing kept for the next update
    assert target.honest_hashes() == before


def test_g1_a_named_replica_cannot_send_gradients_of_the_wrong_size_values_or_round(target):
    """A session that names the attacker itself as its replica, so every check after "is it a replica" is reached:
    the refused gradients never reach the session's inbox or its slices, and the honest sessions are untouched. The
    attacker passes for a node announcing the blocks (a hostile node can announce any span): the records the target
    reads are given that entry."""
    honest_before = target.honest_hashes()
    me = target.attacker.peer_id.to_base58()
    records = target.node.training.records

    async def records_with_the_attacker():
        return [*(await records()), SimpleNamespace(peer_id=me, start_block=0, end_block=2)]

    target.node.training.records = records_with_the_attacker
    numel = numel_of(adapter().narrow(0, 2))

    def message(**changes) -> TrainSync:
        return TrainSync(**{"owner": me, "session_id": "dp", "from_session_id": "ghost", "round": 1, **changes})

    def flat(values: torch.Tensor) -> list:
        return [tensor_to_proto(values)]

    nan = torch.zeros(numel)
    nan[numel // 2] = float("nan")
    cases = {
        "one value short": (message(), flat(torch.zeros(numel - 1)), "must be"),
        "one value more": (message(), flat(torch.zeros(numel + 1)), "exceeds the limit"),
        "a NaN": (message(), flat(nan), "finite"),
        "an Inf": (message(), flat(torch.full((numel,), float("inf"))), "finite"),
        "half precision": (message(), flat(torch.zeros(numel, dtype=torch.float16)), "dtype"),
        "a matrix": (message(), flat(torch.zeros(1, numel)), "rank"),
        "no tensor": (message(), [], "one tensor"),
        "two tensors": (message(), flat(torch.zeros(numel)) * 2, "one tensor"),
        "a round far ahead": (message(round=1 << 40), flat(torch.zeros(numel)), "gradients for update"),
        "the round after next": (message(round=3), flat(torch.zeros(numel)), "gradients for update"),
        "round 0": (raw({**message().model_dump(), "round": 0}), None, "round"),
        "another session of the same peer": (message(from_session_id="ghost-2"), flat(torch.zeros(numel)), "replica"),
        "to the replica's name instead of the session": (
            message(session_id="ghost"),
            flat(torch.full((numel,), 1e30)),
            "no training session",
        ),
    }

    async def scenario():
        channel = await open_stream(target.attacker, target.node.peer_id, rpc.TRAIN, max_frame_bytes=CLIENT_FRAME_BYTES)
        try:
            opened = await ask(channel, opening(session_id="dp", replicas=(Replica(peer=me, session_id="ghost"),)))
            assert isinstance(opened, TrainOpened), opened
            state_before = await ask(channel, frame(TrainStateRequest()))
            answers = {}
            for name, (request, tensors, _) in cases.items():
                answers[name] = await sync(target.attacker, target.node, request, tensors)
            session = target.node.training.sessions[(me, "dp")]
            inbox_after_refusals = {round_: dict(got) for round_, got in session.inbox.items()}
            accepted = await sync(target.attacker, target.node, message(), flat(torch.zeros(numel)))
            inbox = {round_: list(got) for round_, got in session.inbox.items()}
            state_after = await ask(channel, frame(TrainStateRequest()))
            return answers, inbox_after_refusals, accepted, inbox, state_before, state_after
        finally:
            channel.close()

    try:
        answers, refused_inbox, accepted, inbox, state_before, state_after = target.run(scenario())
    finally:
        target.node.training.records = records
    for name, (_, _, text) in cases.items():
        assert code(answers[name]) == "bad_request", name
        assert text in answers[name].message, (name, answers[name].message)
    assert not any(refused_inbox.values())
    # the control: the same sender with the right gradients is taken, for this update only
    assert isinstance(accepted, TrainSynced)
    assert inbox == {1: [(me, "ghost")]}
    assert isinstance(state_before, TrainState) and isinstance(state_after, TrainState)
    assert (state_after.step, state_after.slice_sha256) == (0, state_before.slice_sha256)
    assert state_after.optimizer_sha256 == state_before.optimizer_sha256
    assert target.honest_hashes() == honest_before


def test_g3_an_open_reserves_room_for_its_replicas_gradients(target, monkeypatch):
    """Gradients a named replica on another node send wait in the session's inbox until its update: the open reserves
    room for two updates' worth from each, counted in its peer's share, so honest replicas' gradients always have
    their room and a client naming replicas of its own cannot grow a session beyond it. A session opened past the
    share is marked lent (free memory only: the first to go for a peer within its share)."""
    me = target.attacker.peer_id.to_base58()
    training = target.node.training
    records = training.records

    async def records_with_the_attacker():
        return [*(await records()), SimpleNamespace(peer_id=me, start_block=0, end_block=2)]

    monkeypatch.setattr(training, "records", records_with_the_attacker)
    numel = numel_of(adapter().narrow(0, 2))
    slice_bytes = 4 * numel

    def gradients(round_: int) -> tuple[TrainSync, list]:
        message = TrainSync(owner=me, session_id="dp-share", from_session_id="ghost", round=round_)
        return message, [tensor_to_proto(torch.zeros(numel))]

    async def scenario():
        held = training.room.peer_bytes(me)
        share = (held + 6 * slice_bytes) / training.max_state_bytes  # the state, and room for one replica's two
        # (sessions are shared out by the same fraction: their limit raised, so only the bytes decide here)
        limited(training, monkeypatch, max_cache_share_per_peer=share, max_training_sessions=10**6)
        channels = [
            await open_stream(target.attacker, target.node.peer_id, rpc.TRAIN, max_frame_bytes=CLIENT_FRAME_BYTES)
            for _ in range(2)
        ]
        try:
            replica = (Replica(peer=me, session_id="ghost"),)
            opened = await ask(channels[0], opening(session_id="dp-share", replicas=replica))
            reserved = training.room.peer_bytes(me) - held
            synced = [await sync(target.attacker, target.node, *gradients(round_)) for round_ in (1, 2)]
            after = training.room.peer_bytes(me) - held
            more = await ask(channels[1], opening(session_id="dp-more"))  # past the share: borrowed, free memory
            lent = [training.sessions[(me, name)].lent for name in ("dp-share", "dp-more")]
            inbox = {round_: list(got) for round_, got in training.sessions[(me, "dp-share")].inbox.items()}
            return opened, reserved, synced, after, (more, lent), inbox
        finally:
            for channel in channels:
                channel.close()

    opened, reserved, synced, after, (more, lent), inbox = target.run(scenario())
    assert isinstance(opened, TrainOpened) and reserved == after == 6 * slice_bytes
    assert all(isinstance(answer, TrainSynced) for answer in synced)
    # what waits is within the room reserved: one slice's worth per replica and update, two updates
    assert inbox == {1: [(me, "ghost")], 2: [(me, "ghost")]}
    assert isinstance(more, TrainOpened) and lent == [False, True]


def test_g5_gradients_go_to_a_named_replica_only_once_it_holds_a_session_naming_them(target, monkeypatch):
    """A client names an honest node that holds no session of its own as a replica: the node asks that replica
    first with the message alone (a probe), is refused, and uploads no gradients to it, so naming many such nodes
    amplifies nothing. The step fails typed (replica_unavailable) and the session stays."""
    other = target.swarm.nodes[1]  # an honest node (blocks 2:4), passed for one serving 0:2 in the records read
    training = target.node.training
    records = training.records

    async def records_with_the_other_node():
        return [*(await records()), SimpleNamespace(peer_id=other.peer_id, start_block=0, end_block=2)]

    monkeypatch.setattr(training, "records", records_with_the_other_node)
    heard: list[bool] = []  # what the honest replica's node was sent: a probe, or gradients
    receiver = other.training.sync._receiver

    def recording(message, sender):
        heard.append(message.probe)
        return receiver(message, sender)

    monkeypatch.setattr(other.training.sync, "_receiver", recording)

    async def scenario():
        channel = await open_stream(target.attacker, target.node.peer_id, rpc.TRAIN, max_frame_bytes=CLIENT_FRAME_BYTES)
        try:
            replica = (Replica(peer=other.peer_id, session_id="never-opened"),)
            opened = await ask(channel, opening(session_id="amplifies", replicas=replica))
            assert isinstance(opened, TrainOpened), opened
            rows = hidden(1, 2)
            assert isinstance(await ask(channel, forward("p", rows)), TrainOutput)
            failed = await ask(channel, backward("p", rows, apply=True))
            state = await ask(channel, frame(TrainStateRequest()))
            return failed, state
        finally:
            channel.close()

    failed, state = target.run(scenario())
    assert code(failed) == "replica_unavailable" and "no training session" in failed.message
    assert heard == [True]  # asked once, with nothing but the message; no gradients uploaded
    assert isinstance(state, TrainState) and state.step == 0  # the session stays, no update taken


def test_g1_a_synced_optimizer_step_that_fails_ends_its_session_after_the_refusal(target, monkeypatch):
    """Two sessions on one node, each other's replica: the optimizer step after their gradients are summed fails in
    one of them (a device fault). Its slice may be half updated, so it answers the refusal, typed, and ends; the
    other takes its step."""
    me, node = target.attacker.peer_id.to_base58(), target.node.peer_id
    training = target.node.training

    def broken() -> None:
        raise RuntimeError("device fault")

    async def scenario():
        channels = [
            await open_stream(target.attacker, node, rpc.TRAIN, max_frame_bytes=CLIENT_FRAME_BYTES) for _ in range(2)
        ]
        try:
            for channel, (name, other) in zip(channels, (("dp-a", "dp-b"), ("dp-b", "dp-a")), strict=True):
                replica = (Replica(peer=node, session_id=other),)
                assert isinstance(await ask(channel, opening(session_id=name, replicas=replica)), TrainOpened)
            monkeypatch.setattr(training.sessions[(me, "dp-a")].optimizer, "step", broken)
            rows = hidden(1, 2)
            for channel in channels:
                assert isinstance(await ask(channel, forward("p", rows)), TrainOutput)
            answers = await asyncio.gather(*(ask(channel, backward("p", rows, apply=True)) for channel in channels))
            after = await ask(channels[0], frame(TrainStateRequest()))
            return answers, after
        finally:
            for channel in channels:
                channel.close()

    (failed, stepped), after = target.run(scenario())
    assert code(failed) == "adapter" and "optimizer step failed" in failed.message and "device fault" in failed.message
    assert isinstance(stepped, TrainGrad) and stepped.step == 1
    assert after is None and (me, "dp-a") not in training.sessions  # the stream ended with the session


def test_g5_a_node_sends_gradients_only_to_nodes_that_serve_the_blocks(target):
    """The attacker names its second identity, a plain libp2p peer that is no node at all, as its session's replica.
    Whether the node refuses the open or fails the step, it must not open a stream to that peer."""
    victim = target.attackers[1]
    seen: list[str] = []

    async def record(stream_info, reader, writer) -> None:
        seen.append(stream_info.peer_id.to_base58())
        writer.close()

    async def scenario() -> list[Message | None]:
        await victim.add_binary_stream_handler(rpc.TRAIN_SYNC, record)
        try:
            replica = Replica(peer=victim.peer_id.to_base58(), session_id="victim")
            channel = await open_stream(
                target.attacker, target.node.peer_id, rpc.TRAIN, max_frame_bytes=CLIENT_FRAME_BYTES
            )
            try:
                answers = [await ask(channel, opening(session_id="reflect", replicas=(replica,)))]
                if isinstance(answers[0], TrainOpened):
                    answers.append(await ask(channel, forward("s1", hidden(1, 4))))
                    answers.append(await ask(channel, backward("s1", hidden(1, 4, seed=1))))
                return answers
            finally:
                channel.close()
        finally:
            await victim.remove_binary_stream_handler(rpc.TRAIN_SYNC)

    answers = target.run(scenario())
    assert seen == [], f"the node opened {len(seen)} gradient stream(s) to a peer named only by a client: {answers}"
    assert not isinstance(answers[-1], TrainGrad), answers  # refused at the open, or the step failed


def test_a_replica_that_sends_nothing_is_reported_typed_and_the_session_stays(target):
    """The attacker's session names as replica a session id on the node itself that does not exist: the step's
    sync fails at once. The node answers the backward with a typed replica_unavailable and keeps the session."""
    replica = Replica(peer=target.node.peer_id, session_id="no-such-replica")
    answers = target.run(
        converse(
            target.attacker,
            target.node,
            [
                opening(session_id="lonely", replicas=(replica,)),
                forward("s1", hidden(1, 4)),
                backward("s1", hidden(1, 4, seed=1)),
                forward("s2", hidden(1, 4), keep=False),
            ],
        )
    )
    assert isinstance(answers[0], TrainOpened) and isinstance(answers[1], TrainOutput)
    assert isinstance(answers[2], ErrorReply), f"the node ended the stream instead of answering: {answers}"
    assert answers[2].code == "replica_unavailable", answers
    assert isinstance(answers[3], TrainOutput)  # the stream and its session go on


# ---- a hostile node against a training client ------------------------------------------------------------------------


def wait_seen(session: FineTuningSession, node) -> None:
    """Wait until the session's client reads `node`'s record (so a failover can route to it)."""
    client = session.inner.model.swarm

    def seen() -> bool:
        records = session.runner.call(client.node_records(fresh=True))
        return node.peer_id in {record.info.peer_id for record in records}

    wait_until(seen, timeout_s=30)


PADDING = "x" * (2 << 20)  # a field the client does not read, making an answer 2 MiB: far over what it can hold


@pytest.mark.parametrize(
    ("answer", "lanes"),
    [("output", True), ("output", False), ("state", True), ("refusal", True), ("full", True)],
    ids=["pass-answer-on-a-lane", "pass-answer-on-libp2p", "state-answer-on-a-lane", "refuses-every-pass", "full"],
)
def test_g1_a_node_answering_more_than_the_session_can_hold_is_failed_and_replaced(target, answer, lanes):
    """A client bounds each training answer by what it asked for (a pass: one tensor of the shape it sent; a state:
    its own slice of the node's blocks, in float32, and AdamW's two moments of it) and refuses a longer frame
    before reading it. A node that pads its answers to 2 MiB with a field nobody reads is failed like a dead one:
    banned, and the chain reopened on a spare, where the step is taken. So is a node refusing every pass as
    malformed (bad_request) although each is within what it announces it takes: not the caller's mistake, so it
    cannot stall training unblamed. One taking the open, then saying it has no room for every pass, is not banned
    (no room is no fault) but left out of the chains after its second such failover, not chosen at every one."""
    swarm, prefix = target.swarm, f"oversized-{answer}-{lanes}"
    liar = swarm.start_node(target.model_path, 0, 4, dht_prefix=prefix, **LIMITS)
    nodes, session = [liar], None
    try:
        session = FineTuningSession.create(
            target.model_path,
            initial_peers=swarm.initial_peers,
            dht_prefix=prefix,
            spec=SPEC,
            seed=3,
            lr=1e-3,
            lanes=lanes,
        )
        assert [hop.peer_id for hop in session.chain] == [liar.peer_id]
        assert isinstance(session.inner.links[0].channel, LaneChannel) == lanes
        client = session.inner.model.swarm
        nodes.append(swarm.start_node(target.model_path, 0, 4, dht_prefix=prefix, **LIMITS))
        spare = nodes[-1]

        wait_seen(session, spare)
        if answer == "state":
            assert math.isfinite(session.train_step(target.batch))  # honest passes: the oversized answer is the state
        method = "_state" if answer == "state" else "_forward"
        honest = getattr(liar.training, method)

        async def padded(*args):
            if answer == "refusal":
                raise BadRequestError("this pass is malformed (as a hostile node says of every pass)")
            if answer == "full":
                raise AdapterBudgetError("no room for this pass (as a hostile node says of every pass)")
            reply = await honest(*args)
            reply.uid = PADDING
            return reply

        setattr(liar.training, method, padded)
        if answer != "state":
            assert math.isfinite(session.train_step(target.batch)) and session.step == 1
        else:
            assert session.checkpoint().spans[0].peer_id == spare.peer_id
        assert [hop.peer_id for hop in session.chain] == [spare.peer_id]
        if answer == "full":
            assert session.failovers in (1, 2) and liar.peer_id not in client.banned()
        else:
            assert session.failovers == 1 and liar.peer_id in client.banned()
    finally:
        if session is not None:
            session.close()
        for node in nodes:
            swarm.stop_node(node)


def test_g1_a_node_sending_a_gradient_that_overflows_the_node_before_it_is_the_one_blamed(target):
    """The last node of the chain answers its backward passes with an input gradient of 1e38 in every element:
    finite, so the client passes it on, but the honest node before it overflows on it. That node takes no step on
    it (its adapter stays finite, and its AdamW state is not poisoned with infinities) and says so (not_finite); the
    client blames the node that sent the gradient, not the one that said so, and the step is taken through a spare."""
    swarm, prefix = target.swarm, "overflow"
    honest = swarm.start_node(target.model_path, 0, 2, dht_prefix=prefix, **LIMITS)
    liar = swarm.start_node(target.model_path, 2, 4, dht_prefix=prefix, **LIMITS)
    nodes, session = [honest, liar], None
    try:
        session = FineTuningSession.create(
            target.model_path, initial_peers=swarm.initial_peers, dht_prefix=prefix, spec=SPEC, seed=3, lr=1e-3
        )
        assert [hop.peer_id for hop in session.chain] == [honest.peer_id, liar.peer_id]
        client = session.inner.model.swarm
        nodes.append(swarm.start_node(target.model_path, 2, 4, dht_prefix=prefix, **LIMITS))
        spare = nodes[-1]

        wait_seen(session, spare)
        honest_backward = liar.training._backward

        async def inflated(session_, request, message):
            reply = await honest_backward(session_, request, message)
            elements = len(reply.tensors[0].buffer) // 4
            reply.tensors[0].buffer = torch.full((elements,), 1e38, dtype=torch.float32).numpy().tobytes()
            return reply

        liar.training._backward = inflated
        assert math.isfinite(session.train_step(target.batch)) and session.step == 1
        assert [hop.peer_id for hop in session.chain] == [honest.peer_id, spare.peer_id]
        assert liar.peer_id in client.banned() and honest.peer_id not in client.banned()
        for training in honest.training.sessions.values():  # the honest node took no step on what overflowed
            assert all(torch.isfinite(parameter).all() for parameter in training.slice.parameters())
    finally:
        if session is not None:
            session.close()
        for node in nodes:
            swarm.stop_node(node)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_g1_a_node_claiming_an_overflow_on_ordinary_values_is_the_one_blamed(target, direction):
    """A node answers every forward (or backward) pass with not_finite, as if its blocks had overflowed on what its
    neighbour sent, though those values are far inside its dtype's range: the client blames the node that said so,
    not the neighbour (the one before it on the forward pass, the one after it on the backward pass), and takes the
    step through a spare."""
    swarm, prefix = target.swarm, f"false-overflow-{direction}"
    first = swarm.start_node(target.model_path, 0, 2, dht_prefix=prefix, **LIMITS)
    second = swarm.start_node(target.model_path, 2, 4, dht_prefix=prefix, **LIMITS)
    liar, honest = (second, first) if direction == "forward" else (first, second)
    nodes, session = [first, second], None
    try:
        session = FineTuningSession.create(
            target.model_path, initial_peers=swarm.initial_peers, dht_prefix=prefix, spec=SPEC, seed=3, lr=1e-3
        )
        assert [hop.peer_id for hop in session.chain] == [first.peer_id, second.peer_id]
        client = session.inner.model.swarm
        nodes.append(swarm.start_node(target.model_path, *((2, 4) if liar is second else (0, 2)), dht_prefix=prefix,
                                      **LIMITS))  # fmt: skip
        spare = nodes[-1]
        wait_seen(session, spare)

        async def claims_overflow(session_, request, message):
            raise NotFiniteError("these hidden states overflow this node's blocks")

        setattr(liar.training, f"_{direction}", claims_overflow)
        assert math.isfinite(session.train_step(target.batch)) and session.step == 1
        assert liar.peer_id in client.banned() and honest.peer_id not in client.banned()
        assert spare.peer_id in [hop.peer_id for hop in session.chain] and honest.peer_id in [
            hop.peer_id for hop in session.chain
        ]
    finally:
        if session is not None:
            session.close()
        for node in nodes:
            swarm.stop_node(node)
