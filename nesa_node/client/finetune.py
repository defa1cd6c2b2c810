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
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from nesa_node.client.async_model import AsyncDistributedModel
from nesa_node.client.checkpoints import (
    Checkpoint,
    SpanState,
    assemble,
    check_signature,
    latest_step,
    read_checkpoint,
    write_checkpoint,
)
from nesa_node.client.model import LoopThread
from nesa_node.client.session_chain import codec_for
from nesa_node.client.train_link import IGNORE_INDEX, LinkLost, TrainLink, causal_lm_loss
from nesa_node.errors import (
    AdapterBudgetError,
    CheckpointError,
    NoRouteError,
    PeerUnavailableError,
    QuotaExceededError,
    RequestError,
    TooManySessionsError,
)
from nesa_node.protocol import lane, rpc
from nesa_node.protocol.channel import Frame, frame
from nesa_node.protocol.framing import open_stream
from nesa_node.protocol.messages import (
    OpenTraining,
    TrainBackward,
    TrainForward,
    TrainGrad,
    TrainOpened,
    TrainOutput,
    TrainState,
    TrainStateRequest,
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
from nesa_node.sharding.lora_train import (
    LoraSpec,
    OptimizerState,
    init_adapter,
    save_peft_adapter,
    spec_of_folder,
)

logger = logging.getLogger(__name__)

_WIRE_DTYPES = ("float32", "bfloat16", "float16", "uint8", "int8")


@dataclass(frozen=True)
class _Pass:
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
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 10,
        restore: Checkpoint | None = None,
    ):
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
        self.model = model
        self.spec = spec
        self.optimizer = optimizer
        self.compression = compression
        self.model_path = model_path
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.session_id = uuid.uuid4().hex  # a new one at every (re)open of the chain
        num_blocks = model.model_config.num_hidden_layers
        # where a failover goes back to: the last checkpoint (in memory; on disk too with checkpoint_dir)
        self.restore = restore or Checkpoint(
            0, self.session_id, spec, dataclasses.asdict(optimizer), adapter, OptimizerState(0, num_blocks, 0, {})
        )
        self.replay: list[_Pass] = []  # passes since the restore point, replayed after a failover
        self.links: list[TrainLink] = []
        self.step = self.restore.step  # optimizer steps taken
        self.failovers = 0
        self.replayed_steps = 0  # optimizer steps run again after failovers
        self._rolled_back = False  # the chain was reopened at the restore point: the replay list runs first
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
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 10,
        resume: bool = False,
    ) -> AsyncFineTuningSession:
        """Join the swarm and open the training streams on a chain. `adapter`: a PEFT LoRA folder to start from
        (its rank, alpha and targets); otherwise a new adapter of `spec` (default LoraSpec()) initialised as peft
        initialises one, from `seed`. `compression`: the codec for activations and gradients ("none" or a codec
        every node of the chain accepts). Every `checkpoint_every` optimizer steps the nodes' slices and AdamW
        states are fetched (checked against their hashes and the nodes' signatures): a failover goes back to the
        last one and replays the steps since; with `checkpoint_dir` they are also written there
        (client/checkpoints.py), and `resume` continues from the newest one there (its adapter spec and step; a
        fresh start when there is none). Raises AdapterError for a bad folder, CheckpointError for a damaged
        checkpoint, NoRouteError when no chain covers the model, the node's typed error when one refuses the
        session for another reason than being full."""
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
            restore = None
            if resume and checkpoint_dir is not None and latest_step(checkpoint_dir) is not None:
                num_blocks = model.model_config.num_hidden_layers
                restore = await asyncio.to_thread(read_checkpoint, checkpoint_dir, num_blocks)
                spec, whole = restore.spec, restore.adapter
            elif adapter is not None:
                spec = await asyncio.to_thread(spec_of_folder, adapter)
                whole = await asyncio.to_thread(load_adapter_slice, adapter, model.model_config, 0, None)
            else:
                spec = spec or LoraSpec()
                whole = await asyncio.to_thread(init_adapter, model.model_config, spec, seed)
            settings = OptimizerSettings(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            session = cls(
                model,
                spec,
                whole,
                settings,
                compression=model.config.compression,
                model_path=model_path,
                checkpoint_dir=checkpoint_dir,
                checkpoint_every=checkpoint_every,
                restore=restore,
            )
            await session.open()
        except BaseException:
            await model.close()
            raise
        return session

    # ---- the chain -------------------------------------------------------------------------------------------------

    async def open(self) -> None:
        """Choose a chain and open a training stream on each of its nodes, every one starting from the restore
        point. A node that is full, refuses this peer's share or fails is left out and the chain chosen again."""
        failed: set[str] = set()
        for _ in range(self.model.config.max_open_attempts):
            chain = await self.model.choose_chain(exclude=frozenset(failed))
            self.session_id = uuid.uuid4().hex
            links: list[TrainLink] = []
            try:
                for hop in chain.hops:
                    links.append(await self._open_link(hop))
            except (LinkLost, TooManySessionsError, QuotaExceededError, AdapterBudgetError) as exc:
                for link in links:
                    link.close()
                peer = exc.peer_id if isinstance(exc, LinkLost) else chain.hops[len(links)].peer_id
                logger.info("training chain: leaving out %s (%s)", peer[:12], exc)
                failed.add(peer)
                if isinstance(exc, LinkLost):
                    self.model.swarm.ban(peer)
                continue
            except BaseException:
                for link in links:
                    link.close()
                raise
            self.links = links
            return
        raise NoRouteError(f"no training chain could be opened; nodes left out: {len(failed)}")

    async def _open_link(self, hop: Hop) -> TrainLink:
        timeout_s = self.model.config.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                channel = await open_stream(
                    self.model.swarm.p2p, hop.peer_id, rpc.TRAIN, max_frame_bytes=lane.CLIENT_MAX_FRAME_BYTES
                )
        except Exception as exc:
            raise LinkLost(hop.peer_id, f"could not be reached ({type(exc).__name__})") from None
        restore = self.restore
        piece = restore.adapter.narrow(hop.start_block, hop.end_block)
        adam = restore.adam.narrow(hop.start_block, hop.end_block) if restore.adam.tensors else None
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
            step=restore.step,
            optimizer_sha256=adam.sha256 if adam is not None else None,
        )
        tensors = [bytes_to_proto(piece.to_bytes())] + ([bytes_to_proto(adam.to_bytes())] if adam else [])
        try:
            await link.call(frame(message, tensors), TrainOpened)
        except BaseException:
            link.close()
            raise
        return link

    async def _recover(self, lost: LinkLost) -> None:
        """Replace the chain after `lost`: the failed node is banned, every node reopened at the restore point, and
        the passes since it run again before anything else."""
        logger.warning("training: %s; reopening the chain at step %d", lost, self.restore.step)
        self.model.swarm.ban(lost.peer_id)
        for link in self.links:
            link.close()
        self.links = []
        self.failovers += 1
        self.replayed_steps += sum(item.apply for item in self.replay)
        self.step = self.restore.step
        self._rolled_back = True
        await self.open()

    async def _with_failover(self, work):
        """`await work()` after catching up with the replay list; on a lost node, recover and try again (at most
        max_failovers times in a row)."""
        failures = 0
        while True:
            try:
                if self._rolled_back:
                    for item in self.replay:
                        await self._pass(item)
                    self._rolled_back = False
                return await work()
            except LinkLost as exc:
                failures += 1
                if failures > self.model.config.max_failovers:
                    raise
                await self._recover(exc)

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

    async def _pass(self, item: _Pass) -> float:
        """One forward and backward pass through the chain (and an optimizer step with item.apply)."""
        self._passes += 1
        step_id = f"{self.session_id}:{self._passes}"
        hidden = self.model.embed(item.input_ids).float()
        outputs = await self._forward(hidden, step_id, keep=True)
        loss, grad = self._loss_and_grad(outputs[-1], item.labels)
        step = await self._backward(grad, step_id, apply=item.apply)
        if item.apply:
            self.step = step
        return loss

    async def train_step(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, apply: bool = True
    ) -> float:
        """One forward and backward pass of a batch through the chain, then (with `apply`) one AdamW step on every
        node; the batch's loss before the step. `apply=False` gathers the gradients of more micro-batches first
        (scale their losses yourself: each pass's gradient is of its own mean loss). A node lost on the way is
        replaced (module docstring): the call returns once the step is taken on the new chain."""
        item = _Pass(input_ids, self._labels(input_ids, labels), apply)

        async def run() -> float:
            loss = await self._pass(item)
            self.replay.append(item)
            return loss

        loss = await self._with_failover(run)
        if apply and self.step - self.restore.step >= self.checkpoint_every:
            await self._with_failover(self.checkpoint)
        return loss

    async def checkpoint(self) -> Checkpoint:
        """Fetch every node's slice and AdamW state now (hashes and signatures checked) as the new restore point,
        written to checkpoint_dir when set."""
        spans = []
        for link in self.links:
            message, answer = await link.call(frame(TrainStateRequest()), TrainState)
            spans.append(await self._span_state(link, message, answer))
        checkpoint = assemble(self.step, self.session_id, self.spec, dataclasses.asdict(self.optimizer), spans)
        if self.checkpoint_dir is not None:
            await asyncio.to_thread(write_checkpoint, self.checkpoint_dir, checkpoint)
        self.restore = checkpoint
        self.replay = []
        return checkpoint

    async def _span_state(self, link: TrainLink, message: TrainState, answer: Frame) -> SpanState:
        """The state a node answered, checked: its span, step, hashes and signature (LinkLost otherwise)."""
        try:
            if (message.start_block, message.end_block) != (link.hop.start_block, link.hop.end_block):
                raise CheckpointError("answered another span's state")
            if message.step != self.step or len(answer.tensors) != 2:
                raise CheckpointError(f"answered the state of step {message.step}, not {self.step}")
            check_signature(message, self.session_id, link.peer_id)
            limit = lane.CLIENT_MAX_FRAME_BYTES
            piece = await asyncio.to_thread(
                AdapterSlice.from_bytes, bytes_from_proto(answer.tensors[0], max_bytes=limit), message.slice_sha256
            )
            adam = await asyncio.to_thread(
                OptimizerState.from_bytes,
                bytes_from_proto(answer.tensors[1], max_bytes=limit),
                message.optimizer_sha256,
            )
            if (piece.start, piece.end) != (adam.start, adam.end) or adam.step not in (0, message.step):
                raise CheckpointError("the optimizer state does not match the slice")
        except (RequestError, CheckpointError) as exc:
            raise LinkLost(link.peer_id, f"sent a bad training state: {exc.message}") from None
        adam = OptimizerState(adam.start, adam.end, message.step, adam.tensors) if not adam.tensors else adam
        return SpanState(piece, adam, link.peer_id, message.public_key, message.signature)

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
        """The whole adapter as the nodes hold it now (every slice checked against its hash and signature)."""

        async def fetch() -> AdapterSlice:
            spans = []
            for link in self.links:
                message, answer = await link.call(frame(TrainStateRequest()), TrainState)
                spans.append(await self._span_state(link, message, answer))
            return merge_slices([span.slice for span in spans])

        return await self._with_failover(fetch)

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

    @property
    def failovers(self) -> int:
        return self.inner.failovers

    @property
    def replayed_steps(self) -> int:
        return self.inner.replayed_steps

    def checkpoint(self):
        return self.runner.call(self.inner.checkpoint())

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
