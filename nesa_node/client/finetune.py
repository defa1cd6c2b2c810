"""LoRA fine-tuning over a swarm: the adapter lives on the nodes that hold its blocks and learns there.

The client holds the embeddings, the final norm and the LM head (frozen); it embeds a batch, sends the hidden states
through a chain of nodes (each runs its blocks with its own slice of the adapter, server/training.py), computes the
loss on the last node's output, and sends the loss's gradient back up the chain: each node backpropagates through
its blocks, returns the gradient of its input to the client for the node before it, and takes its own AdamW step.
AdamW is elementwise, so the slices end where one process training the whole adapter on the same batches ends
(Nesa paper section 2.4.2, eq. 7).

    session = FineTuningSession.create(model_path, initial_peers=peers, spec=LoraSpec(rank=8), lr=1e-3)
    loss = session.train_step(input_ids)            # labels default to the inputs (causal LM)
    held_out = session.evaluate(other_ids)
    session.save_pretrained("my-adapter")           # PEFT folder: PeftModel.from_pretrained and nodes load it
    session.close()

Batches are right-padded: pad tokens after a sequence's end take label -100 (every token attends only to those
before it, so padding after the end changes nothing before it). The loss is transformers' causal LM loss: logits
shifted by one, cross-entropy averaged over the labels that are not -100.

`AsyncFineTuningSession` is the same on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from nesa_node.client.async_model import AsyncDistributedModel
from nesa_node.client.model import LoopThread
from nesa_node.client.session_chain import codec_for
from nesa_node.errors import PeerUnavailableError
from nesa_node.protocol import lane, rpc
from nesa_node.protocol.channel import Frame, frame, read
from nesa_node.protocol.framing import StreamChannel, open_stream
from nesa_node.protocol.messages import (
    FROM_TRAINING,
    ErrorReply,
    Message,
    OpenTraining,
    TrainBackward,
    TrainForward,
    TrainGrad,
    TrainOpened,
    TrainOutput,
    TrainState,
    TrainStateRequest,
    expect,
)
from nesa_node.protocol.tensors import (
    NO_CODEC,
    WireCodec,
    bytes_from_proto,
    bytes_to_proto,
    tensor_from_proto,
    tensor_to_proto,
)
from nesa_node.routing.snapshot import Hop
from nesa_node.sharding.lora import AdapterSlice, load_adapter_slice, merge_slices
from nesa_node.sharding.lora_train import LoraSpec, init_adapter, save_peft_adapter, spec_of_folder

IGNORE_INDEX = -100  # labels that take no part in the loss (transformers' convention)
_WIRE_DTYPES = ("float32", "bfloat16", "float16", "uint8", "int8")


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW on every node's slice, torch's definitions."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the next label (-100: ignored), in float32."""
    shifted = logits[:, :-1].float()  # (batch, seq - 1, vocab)
    targets = labels[:, 1:].to(shifted.device)  # (batch, seq - 1)
    return nn.functional.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


class TrainLink:
    """The training stream to one node of the chain: one request, one answer, in order."""

    def __init__(self, hop: Hop, channel: StreamChannel, timeout_s: float):
        self.hop = hop
        self.channel = channel
        self.timeout_s = timeout_s

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    async def call(self, request: Frame, expected: type[Message]) -> tuple[Message, Frame]:
        """Send `request`, return the node's answer; its typed error when it refused; PeerUnavailableError when the
        stream broke or the node did not answer within the timeout."""
        try:
            self.channel.send(request)
            async with asyncio.timeout(self.timeout_s):
                await self.channel.drain()
                answer = await self.channel.receive()
        except TimeoutError:
            raise PeerUnavailableError(f"node {self.peer_id[:12]}… did not answer within {self.timeout_s} s") from None
        if answer is None:
            raise PeerUnavailableError(f"node {self.peer_id[:12]}… ended the training stream")
        message = read(answer, FROM_TRAINING)
        if isinstance(message, ErrorReply):
            raise message.error()
        return expect(message, expected), answer

    def close(self) -> None:
        self.channel.close()


class AsyncFineTuningSession:
    """A LoRA adapter trained on the nodes of one chain (module docstring). Build it with `create`."""

    def __init__(
        self,
        model: AsyncDistributedModel,
        spec: LoraSpec,
        adapter: AdapterSlice,
        optimizer: OptimizerSettings,
        *,
        compression: WireCodec = NO_CODEC,
        model_path: str | None = None,
    ):
        self.model = model
        self.spec = spec
        self.initial = adapter  # every block's factors at step 0 (what a node opening late starts from)
        self.optimizer = optimizer
        self.compression = compression
        self.model_path = model_path
        self.session_id = uuid.uuid4().hex
        self.links: list[TrainLink] = []
        self.step = 0  # optimizer steps taken
        self._passes = 0

    @classmethod
    async def create(
        cls,
        model_path: str | Path,
        *,
        initial_peers: list[str] | tuple[str, ...],
        dht_prefix: str | None = None,
        adapter: str | Path | None = None,
        spec: LoraSpec | None = None,
        seed: int = 0,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        compression: str = "none",
        request_timeout_s: float = 30.0,
    ) -> AsyncFineTuningSession:
        """Join the swarm and open the training streams on a chain. `adapter`: a PEFT LoRA folder to start from
        (its rank, alpha and targets); otherwise a new adapter of `spec` (default LoraSpec()) initialised as peft
        initialises one, from `seed`. `compression`: the codec for activations and gradients ("none" or a codec
        every node of the chain accepts). Raises AdapterError for a bad folder, NoRouteError when no chain covers
        the model, the node's typed error when one refuses the session."""
        model_path = str(model_path)
        model = await AsyncDistributedModel.from_pretrained(
            model_path,
            initial_peers=initial_peers,
            dht_prefix=dht_prefix,
            dtype="float32",
            compression=compression,
            request_timeout_s=request_timeout_s,
        )
        try:
            if adapter is not None:
                spec = await asyncio.to_thread(spec_of_folder, adapter)
                whole = await asyncio.to_thread(load_adapter_slice, adapter, model.model_config, 0, None)
            else:
                spec = spec or LoraSpec()
                whole = await asyncio.to_thread(init_adapter, model.model_config, spec, seed)
            settings = OptimizerSettings(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            session = cls(model, spec, whole, settings, compression=model.config.compression, model_path=model_path)
            await session.open()
        except BaseException:
            await model.close()
            raise
        return session

    # ---- the chain -------------------------------------------------------------------------------------------------

    async def open(self) -> None:
        """Choose a chain and open a training stream on each of its nodes."""
        chain = await self.model.choose_chain()
        links = []
        try:
            for hop in chain.hops:
                links.append(await self._open_link(hop, self.initial.narrow(hop.start_block, hop.end_block)))
        except BaseException:
            for link in links:
                link.close()
            raise
        self.links = links

    async def _open_link(self, hop: Hop, piece: AdapterSlice) -> TrainLink:
        timeout_s = self.model.config.request_timeout_s
        async with asyncio.timeout(timeout_s):
            channel = await open_stream(
                self.model.swarm.p2p, hop.peer_id, rpc.TRAIN, max_frame_bytes=lane.CLIENT_MAX_FRAME_BYTES
            )
        link = TrainLink(hop, channel, timeout_s)
        message = OpenTraining(
            session_id=self.session_id,
            start_block=hop.start_block,
            end_block=hop.end_block,
            slice_sha256=piece.sha256,
            lr=self.optimizer.lr,
            betas=self.optimizer.betas,
            eps=self.optimizer.eps,
            weight_decay=self.optimizer.weight_decay,
            step=self.step,
        )
        try:
            await link.call(frame(message, [bytes_to_proto(piece.to_bytes())]), TrainOpened)
        except BaseException:
            link.close()
            raise
        return link

    @property
    def chain(self) -> list[Hop]:
        return [link.hop for link in self.links]

    # ---- passes ----------------------------------------------------------------------------------------------------

    def _codecs(self, link: TrainLink, elements: int) -> tuple[WireCodec, WireCodec]:
        codec = codec_for(None, link.hop, self.compression, elements=elements)
        return codec, codec

    def _read(self, answer: Frame, codec: WireCodec, like: torch.Tensor) -> torch.Tensor:
        tensor = tensor_from_proto(
            answer.tensors[0], allowed_dtypes=_WIRE_DTYPES, max_elements=like.numel(), rank=3, codec=codec
        )
        if tensor.shape != like.shape:
            raise PeerUnavailableError(f"a node answered a tensor of {tuple(tensor.shape)}, not {tuple(like.shape)}")
        return tensor

    async def _forward(self, hidden: torch.Tensor, step_id: str, *, keep: bool) -> list[torch.Tensor]:
        """Hidden states through every node; the input each node was given, then the last node's output."""
        inputs = [hidden]
        for link in self.links:
            codec, output_codec = self._codecs(link, hidden.numel())
            request = TrainForward(step_id=step_id, codec=codec, output_codec=output_codec, keep=keep)
            message, answer = await link.call(frame(request, [tensor_to_proto(hidden, codec)]), TrainOutput)
            hidden = self._read(answer, message.codec, hidden).float()
            inputs.append(hidden)
        return inputs

    async def _backward(self, grad: torch.Tensor, step_id: str, *, apply: bool) -> int:
        """The gradient of the last node's output up the chain; the optimizer steps the nodes report."""
        steps = set()
        for link in reversed(self.links):
            codec, output_codec = self._codecs(link, grad.numel())
            request = TrainBackward(step_id=step_id, codec=codec, output_codec=output_codec, apply=apply)
            message, answer = await link.call(frame(request, [tensor_to_proto(grad, codec)]), TrainGrad)
            grad = self._read(answer, message.codec, grad).float()
            steps.add(message.step)
        return min(steps)

    def _labels(self, input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be (batch, seq) with seq >= 2, got {tuple(input_ids.shape)}")
        labels = input_ids if labels is None else labels
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}")
        return labels

    def _loss_and_grad(self, output: torch.Tensor, labels: torch.Tensor) -> tuple[float, torch.Tensor]:
        edges = self.model.edges
        with torch.enable_grad():
            hidden = output.to(self.model.device, self.model.dtype).detach().requires_grad_(True)
            loss = causal_lm_loss(edges.lm_head(edges.norm(hidden)), labels)
            loss.backward()
        return loss.item(), hidden.grad.cpu()

    async def train_step(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, apply: bool = True
    ) -> float:
        """One forward and backward pass of a batch through the chain, then (with `apply`) one AdamW step on every
        node; the batch's loss before the step. `apply=False` gathers the gradients of more micro-batches first
        (scale their losses yourself: each pass's gradient is of its own mean loss)."""
        labels = self._labels(input_ids, labels)
        self._passes += 1
        step_id = f"{self.session_id}:{self._passes}"
        hidden = self.model.embed(input_ids).float()
        outputs = await self._forward(hidden, step_id, keep=True)
        loss, grad = self._loss_and_grad(outputs[-1], labels)
        step = await self._backward(grad, step_id, apply=apply)
        if apply:
            self.step = step
        return loss

    async def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        """The loss of a batch with the adapter as it is now (nothing is saved or updated)."""
        labels = self._labels(input_ids, labels)
        self._passes += 1
        outputs = await self._forward(
            self.model.embed(input_ids).float(), f"{self.session_id}:{self._passes}", keep=False
        )
        with torch.inference_mode():
            edges = self.model.edges
            hidden = outputs[-1].to(self.model.device, self.model.dtype)
            return causal_lm_loss(edges.lm_head(edges.norm(hidden)), labels).item()

    # ---- the adapter -----------------------------------------------------------------------------------------------

    async def adapter(self) -> AdapterSlice:
        """The whole adapter as the nodes hold it now (every slice checked against its hash)."""
        pieces = []
        for link in self.links:
            message, answer = await link.call(frame(TrainStateRequest()), TrainState)
            if (message.start_block, message.end_block) != (link.hop.start_block, link.hop.end_block):
                raise PeerUnavailableError(f"node {link.peer_id[:12]}… answered another span's slice")
            data = bytes_from_proto(answer.tensors[0], max_bytes=lane.CLIENT_MAX_FRAME_BYTES)
            pieces.append(await asyncio.to_thread(AdapterSlice.from_bytes, data, message.slice_sha256))
        return merge_slices(pieces)

    async def save_pretrained(self, folder: str | Path) -> Path:
        """Write the adapter as it is now as a PEFT LoRA folder (`PeftModel.from_pretrained` loads it; nodes serve
        it with `--adapters`, clients name it with `adapter=`)."""
        whole = await self.adapter()
        return await asyncio.to_thread(save_peft_adapter, whole, self.spec, folder, base_model=self.model_path)

    async def close(self) -> None:
        for link in self.links:
            link.close()
        self.links = []
        await self.model.close()

    async def __aenter__(self) -> AsyncFineTuningSession:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


class FineTuningSession:
    """AsyncFineTuningSession on a loop thread of its own, for synchronous callers (same methods, blocking)."""

    def __init__(self, inner: AsyncFineTuningSession, runner: LoopThread):
        self.inner = inner
        self.runner = runner

    @classmethod
    def create(cls, model_path: str | Path, **options) -> FineTuningSession:
        """AsyncFineTuningSession.create's options; see there."""
        runner = LoopThread("nesa-finetune-loop")
        try:
            return cls(runner.call(AsyncFineTuningSession.create(model_path, **options)), runner)
        except BaseException:
            runner.stop()
            raise

    @property
    def step(self) -> int:
        return self.inner.step

    @property
    def chain(self) -> list[Hop]:
        return self.inner.chain

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, apply: bool = True) -> float:
        return self.runner.call(self.inner.train_step(input_ids, labels, apply=apply))

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        return self.runner.call(self.inner.evaluate(input_ids, labels))

    def adapter(self) -> AdapterSlice:
        return self.runner.call(self.inner.adapter())

    def save_pretrained(self, folder: str | Path) -> Path:
        return self.runner.call(self.inner.save_pretrained(folder))

    def close(self) -> None:
        try:
            self.runner.call(self.inner.close(), timeout=60)
        finally:
            self.runner.stop()

    def __enter__(self) -> FineTuningSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = [
    "IGNORE_INDEX",
    "AsyncFineTuningSession",
    "FineTuningSession",
    "OptimizerSettings",
    "causal_lm_loss",
]
