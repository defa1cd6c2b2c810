"""The pieces of a LoRA training session's client (client/finetune.py): the training stream to one node of a chain
(one request and one answer at a time), how replica chains are chosen, the causal LM loss the client computes on the
chain's output, and the small records a session keeps (optimizer settings, passes to replay)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nesa_node.client.session_chain import ANSWER_HEADROOM_BYTES
from nesa_node.errors import (
    AdapterBudgetError,
    BadRequestError,
    NesaError,
    NotFiniteError,
    PeerUnavailableError,
    QuotaExceededError,
    RequestError,
    TooManySessionsError,
    WrongBlocksError,
)
from nesa_node.protocol import lane, rpc
from nesa_node.protocol.channel import Channel, Frame, LaneChannel, frame, read
from nesa_node.protocol.framing import open_stream
from nesa_node.protocol.messages import (
    FROM_TRAINING,
    TICKET_ANSWERS,
    ErrorReply,
    LaneTicket,
    Message,
    TrainBackward,
    TrainForward,
    TrainGrad,
    TrainOpened,
    TrainOutput,
)
from nesa_node.protocol.tensors import WireCodec, tensor_from_proto, tensor_to_proto
from nesa_node.routing.snapshot import Hop
from nesa_node.sharding.lora import AdapterSlice

logger = logging.getLogger(__name__)

WIRE_DTYPES = ("float32", "bfloat16", "float16", "uint8", "int8")  # what a node's tensors may be on the wire
IGNORE_INDEX = -100  # labels that take no part in the loss (transformers' convention)
# one tensor's entry in a safetensors header (name, dtype, shape, offsets): about 100 bytes measured, with margin
STATE_ENTRY_BYTES = 256


# how far below its dtype's largest finite value a tensor's largest element may be and still overflow an honest node's
# blocks: they normalize their inputs, so values that far below cannot (a judgment, with a wide margin)
OVERFLOW_HEADROOM = 16.0
TRAIN_DTYPES = ("float32", "float16", "bfloat16")  # what a node's blocks compute in (sharding/blocks.py DTYPES)

CodecOf = Callable[["TrainLink", int], WireCodec]  # (link, elements) -> the codec of that hop, both ways


def overflows(sent: torch.Tensor, dtype: str) -> bool:
    """Whether finite values `sent` could make an honest node's blocks computing in `dtype` overflow: some within
    OVERFLOW_HEADROOM of that dtype's largest finite value. A node that reports an overflow (not_finite) on smaller
    values is the one at fault: it lies (to have its neighbour blamed) or its dtype cannot hold this model's values;
    either way it is the node to replace."""
    limit = torch.finfo(getattr(torch, dtype if dtype in TRAIN_DTYPES else "float32")).max / OVERFLOW_HEADROOM
    return sent.numel() > 0 and bool(sent.detach().abs().max() >= limit)


def tensor_answer_bytes(like: torch.Tensor) -> int:
    """The longest honest answer to a pass that sent `like`: one tensor of its shape in float32 (no codec sends more
    than 4 bytes an element) and its message, bytes."""
    return like.numel() * 4 + ANSWER_HEADROOM_BYTES


def state_tensor_bytes(piece: AdapterSlice) -> int:
    """The most bytes each of the two tensors of an honest TrainState answer for the blocks of `piece` (the client's
    own slice of them) holds: every value of the slice in float32 twice over (AdamW's two moments; the slice itself
    holds them once), a header entry for each of the optimizer state's tensors and one for its metadata, and the
    slice's own metadata (its scales), which the client's copy, header included, bounds."""
    factors = piece.factors.values()
    values = sum(factor.lora_a.numel() + factor.lora_b.numel() for factor in factors)
    return 8 * values + (4 * len(piece.factors) + 1) * STATE_ENTRY_BYTES + piece.nbytes


def state_answer_bytes(state_bytes: int) -> int:
    """The longest honest TrainState answer: its two tensors of at most `state_bytes` each, and its message."""
    return 2 * state_bytes + ANSWER_HEADROOM_BYTES


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, total: int | None = None) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next label (-100: ignored), in float32: the mean, or
    with `total` the sum divided by `total` (the labelled tokens of a whole batch this is a part of)."""
    shifted = logits[:, :-1].float()  # (batch, seq - 1, vocab)
    targets = labels[:, 1:].to(shifted.device)  # (batch, seq - 1)
    flat_logits, flat_targets = shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1)
    if total is None:
        return nn.functional.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX)
    summed = nn.functional.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return summed / total


async def open_link(
    swarm, hop: Hop, opening: Frame, session_id: str, timeout_s: float, *, state_bytes: int
) -> TrainLink:
    """A training session on `hop`'s node, opened with `opening` (OpenTraining and its tensors): on its TRAIN data
    lane when `swarm` (the client's Swarm) uses lanes and the node offers one (a ticket over libp2p, then direct
    encrypted TCP: no p2pd on the way), else on a libp2p stream. `state_bytes`: what each tensor of the session's
    TrainState answers may hold (state_tensor_bytes). LinkLost when the node cannot be reached or refuses for a
    reason of its own, BadRequestError when it finds the open malformed."""
    channel = await _train_lane(swarm, hop.peer_id, timeout_s)
    if channel is None:
        try:
            async with asyncio.timeout(timeout_s):
                channel = await open_stream(swarm.p2p, hop.peer_id, rpc.TRAIN, max_frame_bytes=ANSWER_HEADROOM_BYTES)
        except Exception as exc:
            raise LinkLost(hop.peer_id, f"could not be reached ({type(exc).__name__})") from None
    link = TrainLink(hop, channel, timeout_s, session_id, state_bytes=state_bytes)
    info = swarm.announced(hop.peer_id)
    link.step_tokens = info.max_step_tokens if info is not None else None
    if info is not None and info.dtype in TRAIN_DTYPES:
        link.dtype = info.dtype
    try:
        await link.call(opening, TrainOpened)
    except BaseException:
        link.close()
        raise
    return link


async def _train_lane(swarm, peer_id: str, timeout_s: float) -> LaneChannel | None:
    address = swarm.lane_address(peer_id) if swarm.use_lanes else None
    if address is None:
        return None
    try:
        async with asyncio.timeout(timeout_s):
            answer = await swarm.unary(peer_id, rpc.LANE_TICKET, Frame())
            message = read(answer, TICKET_ANSWERS)
            if not isinstance(message, LaneTicket):
                raise PeerUnavailableError(f"no lane ticket: {getattr(message, 'message', message)}")
            key = bytes.fromhex(message.key)
            stream = await lane.connect(
                address, lane.ROLE_TRAIN, message.ticket, key, max_frame_bytes=ANSWER_HEADROOM_BYTES
            )
    except (NesaError, TimeoutError, ValueError, lane.LaneClosedError) as exc:
        logger.debug("no training lane to %s, using libp2p: %r", peer_id, exc)
        return None
    return LaneChannel(stream, "answer on a training lane")


def check_labels(input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """`labels` (the inputs when None) once they and `input_ids` are (batch, seq >= 2) alike; ValueError otherwise."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be (batch, seq) with seq >= 2, got {tuple(input_ids.shape)}")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}")
    return labels


def labelled_tokens(labels: torch.Tensor) -> int:
    """Tokens whose next label takes part in the loss."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class Pass:
    """One forward and backward pass of a batch, as replayed after a failover."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    apply: bool


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW on every node's slice, torch's definitions."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


class LinkLost(PeerUnavailableError):
    """A node of the training chain failed, went silent or answered nonsense: it is replaced (failover). `blame`
    False: the node reported another's failure (a replica that sent no gradients); the client finds which."""

    def __init__(self, peer_id: str, reason: str, *, blame: bool = True, full: bool = False):
        super().__init__(f"node {peer_id[:12]}… {reason}")
        self.peer_id = peer_id
        self.blame = blame
        self.full = full  # the node said it has no room (its memory, its sessions, this peer's share)


class Overflowed(LinkLost):
    """A node that says its blocks overflowed on the finite values it was sent (NotFiniteError). Whose fault that is,
    the pass's caller decides from those values (forward_pass, backward_pass; `overflows`)."""

    def __init__(self, peer_id: str, reason: str):
        super().__init__(peer_id, reason, blame=False)


class TrainLink:
    """The training stream to one node of the chain: one request, one answer, in order. Each answer is bounded
    before it is read by what the request can legitimately be answered with (`call`'s max_answer_bytes)."""

    def __init__(self, hop: Hop, channel: Channel, timeout_s: float, session_id: str = "", *, state_bytes: int):
        self.hop = hop
        self.session_id = session_id  # the session's id on this node
        self.channel = channel
        self.timeout_s = timeout_s
        self.state_bytes = state_bytes  # the most each tensor of a TrainState answer holds (state_tensor_bytes)
        self._turn = asyncio.Lock()  # one request and its answer at a time (micro-batches share the link)
        self.broken = False  # a call was cut short: an answer may be left unread
        self.step_tokens: int | None = None  # rows x tokens of the largest pass the node announces (0: no limit)
        self.dtype = "float32"  # what the node announces its blocks compute in (overflows)

    def takes(self, tokens: int) -> bool:
        """Whether the node announced it takes a pass of `tokens` (rows x tokens): then a refusal of such a pass,
        whose input is finite and of the model's width, is the node's fault, not the caller's."""
        return self.step_tokens is not None and (self.step_tokens == 0 or tokens <= self.step_tokens)

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    async def call(
        self,
        request: Frame,
        expected: type[Message],
        *,
        timeout_s: float | None = None,
        max_answer_bytes: int = ANSWER_HEADROOM_BYTES,
        well_formed: bool = False,
    ) -> tuple[Message, Frame]:
        """Send `request`, return the node's answer (within `timeout_s`, default the link's). `max_answer_bytes`: the
        longest answer the request can have (default: a message without tensors; tensor_answer_bytes for a pass,
        state_answer_bytes for a state); a longer one is refused before it is read. Raises the node's BadRequestError
        when it refused the request as malformed (the caller's mistake), and LinkLost for everything else: the stream
        broke or ran out of step, the node did not answer, answered nonsense or too much, refused for a reason of its
        own (full, moving; blamed), or reported a failure elsewhere (a replica; not blamed). `well_formed`: the
        request passes every check an honest node makes (a pass of finite values the node announced it takes): a
        node refusing it as malformed failed (LinkLost, blamed), so refusing every pass cannot stall training
        unblamed. A node that moved to other blocks is lost, not blamed. A call cut short (cancelled, timed out)
        leaves the stream out of step: later calls raise LinkLost at once."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        async with self._turn:
            if self.broken:
                raise LinkLost(self.peer_id, "stream out of step after an interrupted call", blame=False)
            self.broken = True  # until the answer is read
            self.channel.max_frame_bytes = max_answer_bytes
            try:
                self.channel.send(request)
                async with asyncio.timeout(timeout_s):
                    await self.channel.drain()
                    answer = await self.channel.receive()
            except TimeoutError:
                raise LinkLost(self.peer_id, f"did not answer within {timeout_s} s") from None
            except PeerUnavailableError as exc:
                raise LinkLost(self.peer_id, exc.message) from None
            except RequestError as exc:  # a malformed frame
                raise LinkLost(self.peer_id, f"sent a malformed frame: {exc.message}") from None
            if answer is None:  # the node ended the session (idle, timed out, stopping): probed, not blamed
                raise LinkLost(self.peer_id, "ended the training stream", blame=False)
            self.broken = False
        try:
            message = read(answer, FROM_TRAINING)
        except RequestError as exc:
            raise LinkLost(self.peer_id, f"sent a malformed answer: {exc.message}") from None
        if isinstance(message, ErrorReply):
            error = message.error()
            # preempted, a replica of this node's session failed, or no room for now (its memory, its sessions):
            # replaced without blame (a node that has no room is not at fault)
            full = isinstance(error, AdapterBudgetError | QuotaExceededError | TooManySessionsError)
            if full or isinstance(error, PeerUnavailableError):
                raise LinkLost(
                    self.peer_id, f"reported [{error.code}] {error.message}", blame=False, full=full
                ) from None
            if isinstance(error, NotFiniteError):
                raise Overflowed(self.peer_id, f"reported [{error.code}] {error.message}") from None
            if isinstance(error, WrongBlocksError):
                raise LinkLost(self.peer_id, f"moved: {error.message}", blame=False) from None
            if isinstance(error, BadRequestError) and not well_formed:
                raise error
            if isinstance(error, BadRequestError):
                raise LinkLost(self.peer_id, f"refused a well-formed request [{error.code}] {error.message}") from None
            raise LinkLost(self.peer_id, f"refused [{error.code}] {error.message}") from None
        if not isinstance(message, expected):
            raise LinkLost(self.peer_id, f"answered {message.kind}, not {expected.__name__}")
        return message, answer

    def read_tensor(self, answer: Frame, codec: WireCodec, like: torch.Tensor) -> torch.Tensor:
        """The answer's tensor, of the shape of `like` (what was sent); LinkLost for anything else."""
        try:
            tensor = tensor_from_proto(
                answer.tensors[0] if answer.tensors else None,
                allowed_dtypes=WIRE_DTYPES,
                max_elements=like.numel(),
                rank=like.dim(),
                codec=codec,
            )
        except (RequestError, TypeError, AttributeError) as exc:
            raise LinkLost(self.peer_id, f"answered an unreadable tensor ({exc})") from None
        if tensor.shape != like.shape:
            raise LinkLost(self.peer_id, f"answered a tensor of {tuple(tensor.shape)}, not {tuple(like.shape)}")
        if not torch.isfinite(tensor).all():
            raise LinkLost(self.peer_id, "answered NaN or Inf")
        return tensor

    def close(self) -> None:
        self.channel.close()


async def forward_pass(
    links: list[TrainLink], hidden: torch.Tensor, step_id: str, codec_of: CodecOf, *, keep: bool
) -> list[torch.Tensor]:
    """Hidden states through every node of a chain (`codec_of(link, elements)`: the codec both ways on that hop; `keep`:
    the nodes save what the backward pass needs); the input each node was given, then the last node's output."""
    inputs = [hidden]
    for index, link in enumerate(links):
        codec = codec_of(link, hidden.numel())
        request = TrainForward(step_id=step_id, codec=codec, output_codec=codec, keep=keep)
        try:
            message, answer = await link.call(
                frame(request, [tensor_to_proto(hidden, codec)]),
                TrainOutput,
                max_answer_bytes=tensor_answer_bytes(hidden),
                well_formed=link.takes(hidden.shape[0] * hidden.shape[1]),
            )
        except Overflowed as overflowed:
            if not overflows(hidden, link.dtype):  # values its blocks hold with room to spare
                raise LinkLost(link.peer_id, f"claimed an overflow on ordinary hidden states ({overflowed})") from None
            if index == 0:  # the client's own embeddings: no node to blame
                raise
            raise LinkLost(
                links[index - 1].peer_id, f"sent outputs that overflow the next node ({overflowed})"
            ) from None
        if message.step_id != step_id:
            raise LinkLost(link.peer_id, f"answered step {message.step_id} for {step_id}")
        hidden = link.read_tensor(answer, message.codec, hidden).float()
        inputs.append(hidden)
    return inputs


async def backward_pass(
    links: list[TrainLink],
    grad: torch.Tensor,
    step_id: str,
    codec_of: CodecOf,
    applies: Callable[[TrainLink], bool],
    *,
    timeout_of: Callable[[bool], float],
    step_after: int | None = None,
    inputs: list[torch.Tensor] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """The gradient of the last node's output up the chain. `applies(link)`, asked as the request to a link is built:
    whether that node takes its optimizer step after this backward pass (`timeout_of(apply)`: how long the call may
    take). The steps those nodes report, and the gradient of the chain's input (for the embeddings). With
    `step_after`, the update a step takes the chain to: a node that reports any other is failed (LinkLost, blamed),
    so a node misreporting its step cannot move the client's count, and with it the checkpoints. `inputs`: what each
    node was given on the forward pass (forward_pass's answer), to find who is to blame for an overflow: the node
    that sent the gradient when it is that large, else the one before when its forward input was, else the node
    that reported it."""
    steps = []
    if not torch.isfinite(grad).all():  # the loss's gradient, from the last node's outputs
        raise LinkLost(links[-1].peer_id, "sent outputs whose loss has a gradient that is not finite")
    for index in reversed(range(len(links))):
        link = links[index]
        codec = codec_of(link, grad.numel())
        apply = applies(link)
        request = TrainBackward(step_id=step_id, codec=codec, output_codec=codec, apply=apply)
        try:
            message, answer = await link.call(
                frame(request, [tensor_to_proto(grad, codec)]),
                TrainGrad,
                timeout_s=timeout_of(apply),
                max_answer_bytes=tensor_answer_bytes(grad),
                well_formed=link.takes(grad.shape[0] * grad.shape[1]),
            )
        except Overflowed as overflowed:
            if overflows(grad, link.dtype):  # from the node after it, or the last node's outputs made the loss's
                culprit = links[min(index + 1, len(links) - 1)]
            elif index > 0 and inputs is not None and overflows(inputs[index], link.dtype):
                culprit = links[index - 1]  # its forward input was that large
            else:
                raise LinkLost(link.peer_id, f"claimed an overflow on an ordinary gradient ({overflowed})") from None
            raise LinkLost(culprit.peer_id, f"its outputs or gradient overflow another node ({overflowed})") from None
        if message.step_id != step_id:
            raise LinkLost(link.peer_id, f"answered step {message.step_id} for {step_id}")
        if apply and step_after is not None and message.step != step_after:
            raise LinkLost(link.peer_id, f"reported update {message.step} for update {step_after}")
        grad = link.read_tensor(answer, message.codec, grad).float()
        if apply:
            steps.append(message.step)
    return steps, grad


def replica_chains(hops: list[Hop], nodes, count: int, left_out: set[str] | frozenset[str]) -> list[list[Hop]]:
    """`count` more chains with the blocks of `hops`, hop for hop (data-parallel replicas): each hop on the node among
    `nodes` (routing NodeViews) serving those blocks that the chains use least, another node where the swarm has one
    that is online, not draining and not in `left_out`; a node used already runs another part."""
    plans: list[list[Hop]] = []
    for _ in range(count):
        chain = []
        for position, hop in enumerate(hops):
            used = [hop.peer_id] + [plan[position].peer_id for plan in plans]
            candidates = [
                node
                for node in nodes
                if node.start_block <= hop.start_block
                and hop.end_block <= node.end_block
                and node.online
                and not node.draining
                and node.peer_id not in left_out
            ]
            best = min(candidates, key=lambda node: (used.count(node.peer_id), node.peer_id), default=None)
            if best is None:
                chain.append(hop)  # no other node serves these blocks: the same one runs another part
            else:
                chain.append(Hop(best.peer_id, hop.start_block, hop.end_block, best.codecs))
        plans.append(chain)
    return plans


async def first_failure(calls) -> list:
    """The results of `calls`, run concurrently; on a failure the others are cancelled and the first lost node's
    LinkLost (else the first error) is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except ExceptionGroup as failures:
        lost = [error for error in failures.exceptions if isinstance(error, LinkLost)]
        raise (lost[0] if lost else failures.exceptions[0]) from None
    return [task.result() for task in tasks]


def close_chains(chains: list[list[TrainLink]]) -> None:
    for chain in chains:
        for link in chain:
            link.close()


__all__ = [
    "IGNORE_INDEX",
    "OVERFLOW_HEADROOM",
    "LinkLost",
    "OptimizerSettings",
    "Pass",
    "TrainLink",
    "backward_pass",
    "causal_lm_loss",
    "check_labels",
    "close_chains",
    "first_failure",
    "forward_pass",
    "labelled_tokens",
    "open_link",
    "overflows",
    "replica_chains",
    "state_answer_bytes",
    "state_tensor_bytes",
    "tensor_answer_bytes",
]
