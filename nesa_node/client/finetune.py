"""LoRA fine-tuning over a swarm: the adapter lives on the nodes that hold its blocks and learns there.

The client holds the embeddings, the final norm and the LM head (frozen, or some trained whole: LoraSpec.edges,
client/train_edges.py); it embeds a batch, sends the hidden states through a chain of nodes (each runs its blocks
with its own slice of the adapter, server/training.py), computes the loss on the last node's output, and sends the
loss's gradient back up the chain: each node backpropagates through its blocks, returns the gradient of its input
to the client for the node before it, and takes its own AdamW step. AdamW is elementwise, so the slices end where
one process training the whole adapter on the same batches ends (Nesa paper section 2.4.2, eq. 7).

    session = FineTuningSession.create(model_path, initial_peers=peers, spec=LoraSpec(rank=8), lr=1e-3)
    loss = session.train_step(input_ids)            # labels default to the inputs (causal LM)
    held_out = session.evaluate(other_ids)
    session.save_pretrained("my-adapter")           # PEFT folder: PeftModel.from_pretrained and nodes load it
    session.close()

Batches are right-padded: pad tokens after a sequence's end take label -100 (every token attends only to those
before it, so padding after the end changes nothing before it). The loss is transformers' causal LM loss: logits
shifted by one, cross-entropy averaged over the labels that are not -100. `AsyncFineTuningSession` is the same on
the caller's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections import Counter
from pathlib import Path

import torch

from nesa_node.client.async_model import AsyncDistributedModel
from nesa_node.client.checkpoints import (
    Checkpoint,
    SpanState,
    assemble,
    check_checkpoint_edges,
    latest_step,
    read_checkpoint,
    span_state_of,
    write_checkpoint,
)
from nesa_node.client.codec_choice import codec_for
from nesa_node.client.model import LoopThread, on_caller
from nesa_node.client.train_edges import EdgeLayers, edge_weights_of
from nesa_node.client.train_link import (
    IGNORE_INDEX,
    LinkLost,
    OptimizerSettings,
    Pass,
    TrainLink,
    backward_pass,
    causal_lm_loss,
    check_labels,
    close_chains,
    first_failure,
    forward_pass,
    labelled_tokens,
    open_link,
    replica_chains,
    state_answer_bytes,
    state_tensor_bytes,
)
from nesa_node.errors import BadRequestError, CheckpointError, NoRouteError, RequestError, UnsupportedAdapterError
from nesa_node.protocol.channel import Frame, frame
from nesa_node.protocol.messages import (
    MAX_REPLICAS,
    OpenTraining,
    Replica,
    TrainState,
    TrainStateRequest,
)
from nesa_node.protocol.tensors import NO_CODEC, WireCodec, bytes_to_proto
from nesa_node.routing.snapshot import Hop
from nesa_node.sharding.lora import AdapterSlice, load_adapter_slice, merge_slices
from nesa_node.sharding.lora_edges import EdgeState, peft_edge_key, read_edge_weights
from nesa_node.sharding.lora_train import LoraSpec, OptimizerState, init_adapter, save_peft_adapter, spec_of_folder

logger = logging.getLogger(__name__)

MAX_MICRO_BATCHES = 8  # a node's default max_queued_steps: forwards waiting for their backward pass
FULL_REPEATS = 2  # failovers a node causes saying it has no room before later opens leave it out (guess)


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
        data_parallel: int = 1,
        micro_batches: int = 1,
        edge_weights: dict[str, torch.Tensor] | None = None,
    ):
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
        if not 1 <= data_parallel <= MAX_REPLICAS + 1:
            raise ValueError(f"data_parallel must be between 1 and {MAX_REPLICAS + 1}, got {data_parallel}")
        if not 1 <= micro_batches <= MAX_MICRO_BATCHES:  # each waits at a node for its backward pass
            raise ValueError(f"micro_batches must be between 1 and {MAX_MICRO_BATCHES}, got {micro_batches}")
        self.data_parallel = data_parallel
        self.micro_batches = micro_batches
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
            0,
            self.session_id,
            spec,
            dataclasses.asdict(optimizer),
            adapter,
            OptimizerState(0, num_blocks, 0, {}),
            edges=EdgeState(0, dict(edge_weights or {}), {}) if spec.edges else None,
        )
        # the embeddings, final norm and LM head: the spec's edges trained here, with their own AdamW
        self.layers = EdgeLayers(model.edges, model.model_config, spec.edges, optimizer, self._edge_restore_point)
        self.replay: list[Pass] = []  # passes since the restore point, replayed after a failover
        self.chains: list[list[TrainLink]] = []  # one chain per data-parallel part; their hops match block for block
        self.step = self.restore.step  # optimizer steps taken
        self.failovers = 0
        self.replayed_steps = 0  # optimizer steps run again after failovers
        # peer id -> failovers it caused saying it had no room: one accepting the open, then refusing every pass so,
        # would otherwise be chosen again at each recovery (FULL_REPEATS)
        self._full: Counter[str] = Counter()
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
        data_parallel: int = 1,
        micro_batches: int = 1,
        lanes: bool = True,
    ) -> AsyncFineTuningSession:
        """Join the swarm and open the training streams on a chain. `adapter`: a PEFT LoRA folder to start from
        (its rank, alpha and targets); otherwise a new adapter of `spec` (default LoraSpec()) initialised as peft
        initialises one, from `seed`. `compression`: the codec for activations and gradients ("none" or a codec
        every node of the chain accepts). Every `checkpoint_every` optimizer steps the nodes' slices and AdamW
        states are fetched (checked against their hashes and the nodes' signatures): a failover goes back to the
        last one and replays the steps since; with `checkpoint_dir` they are also written there
        (client/checkpoints.py), and `resume` continues from the newest one there (its adapter spec and step; a
        fresh start when there is none). `data_parallel` chains (nodes differ where the swarm has spares) each run a
        part of every batch, and the nodes of one span sum their gradients before each step (server/training.py);
        `micro_batches` splits each chain's part further, pipelined down the chain (the step is the same).
        `lanes`: each training session on the node's encrypted data lane where it has one (False: libp2p).
        Raises AdapterError for a bad folder, CheckpointError for a damaged
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
            lanes=lanes,
        )
        try:
            restore = None
            edge_weights, model_config = None, model.model_config
            if resume and checkpoint_dir is not None and latest_step(checkpoint_dir) is not None:
                num_blocks = model.model_config.num_hidden_layers
                restore = await asyncio.to_thread(read_checkpoint, checkpoint_dir, num_blocks)
                check_checkpoint_edges(restore, model_config, f"the edge state of {checkpoint_dir}")
                spec, whole = restore.spec, restore.adapter
            elif adapter is not None:
                spec = await asyncio.to_thread(spec_of_folder, adapter)
                allowed = {peft_edge_key(name) for name in spec.edges}  # the client's; anything else is refused
                whole = await asyncio.to_thread(
                    load_adapter_slice, adapter, model_config, 0, None, outside_allowed=allowed
                )
                edge_weights = await asyncio.to_thread(read_edge_weights, adapter, spec.edges, model_config)
            else:
                spec = spec or LoraSpec()
                whole = await asyncio.to_thread(init_adapter, model_config, spec, seed)
                edge_weights = edge_weights_of(model.edges, spec.edges)
            if getattr(model_config, "tie_word_embeddings", False) and {"embed_tokens", "lm_head"} & set(spec.edges):
                raise UnsupportedAdapterError(
                    "this model ties its LM head to its embeddings: train neither whole (the norm alone can be)"
                )
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
                data_parallel=data_parallel,
                micro_batches=micro_batches,
                edge_weights=edge_weights,
            )
            await session.open()
        except BaseException:
            await model.close()
            raise
        return session

    # ---- the chain -------------------------------------------------------------------------------------------------

    async def open(self) -> None:
        """Choose the chains and open a training stream on each of their nodes, every one starting from the restore
        point. A node that is full, refuses this peer's share or fails is left out and the chains chosen again."""
        failed, full = set(), {peer for peer, count in self._full.items() if count >= FULL_REPEATS}
        for _ in range(self.model.config.max_open_attempts):
            try:
                first = await self.model.choose_chain(exclude=frozenset(failed | full))
            except NoRouteError:
                if not full:
                    raise
                full = set()  # no chain without the nodes that said they were full: they may have room now
                continue
            plan = [list(first.hops)] + await self._replica_chains(list(first.hops), failed | full)
            self.session_id = uuid.uuid4().hex
            ids = [f"{self.session_id}-{index}" for index in range(len(plan))]
            opened: list[list[TrainLink]] = []
            hop = plan[0][0]
            try:
                for index, hops in enumerate(plan):
                    opened.append([])
                    for position, hop in enumerate(hops):
                        replicas = tuple(
                            Replica(peer=plan[other][position].peer_id, session_id=ids[other])
                            for other in range(len(plan))
                            if other != index
                        )
                        opened[-1].append(await self._open_link(hop, ids[index], replicas))
            except LinkLost as exc:  # full, moving, failed: left out of this open (banned when to blame)
                close_chains(opened)
                logger.info("training chain: leaving out %s (%s)", exc.peer_id[:12], exc)
                failed.add(exc.peer_id)
                if exc.blame:
                    self.model.swarm.ban(exc.peer_id)
                continue
            except BaseException:
                close_chains(opened)
                raise
            self.chains = opened
            return
        raise NoRouteError(f"no training chain could be opened; nodes left out: {len(failed)}")

    async def _replica_chains(self, hops: list[Hop], failed: set[str]) -> list[list[Hop]]:
        if self.data_parallel == 1:
            return []
        snapshot = await self.model.swarm.snapshot(self.model.model_config.num_hidden_layers)
        return replica_chains(hops, snapshot.nodes, self.data_parallel - 1, failed | self.model.swarm.banned())

    async def _open_link(self, hop: Hop, session_id: str, replicas: tuple[Replica, ...] = ()) -> TrainLink:
        restore = self.restore
        piece = restore.adapter.narrow(hop.start_block, hop.end_block)
        adam = restore.adam.narrow(hop.start_block, hop.end_block) if restore.adam.tensors else None
        message = OpenTraining(
            session_id=session_id,
            start_block=hop.start_block,
            end_block=hop.end_block,
            slice_sha256=piece.sha256,
            **dataclasses.asdict(self.optimizer),
            step=restore.step,
            optimizer_sha256=adam.sha256 if adam is not None else None,
            replicas=replicas,
        )
        tensors = [bytes_to_proto(piece.to_bytes())] + ([bytes_to_proto(adam.to_bytes())] if adam else [])
        timeout_s, state_bytes = self.model.config.request_timeout_s, state_tensor_bytes(piece)
        return await open_link(
            self.model.swarm, hop, frame(message, tensors), session_id, timeout_s, state_bytes=state_bytes
        )

    @property
    def links(self) -> list[TrainLink]:
        """The first chain's links (every chain holds the same adapter)."""
        return self.chains[0] if self.chains else []

    async def _recover(self, lost: LinkLost | None) -> None:
        """Replace the chain after `lost`: the failed node is banned, every node reopened at the restore point, and
        the passes since it run again before anything else."""
        logger.warning("training: %s; reopening the chain at step %d", lost or "a pass cut short", self.restore.step)
        peers = sorted({link.peer_id for chain in self.chains for link in chain})
        close_chains(self.chains)
        self.chains = []
        if lost is not None and lost.full:
            self._full[lost.peer_id] += 1
        if lost is not None and lost.blame:
            self.model.swarm.ban(lost.peer_id)
        elif peers:  # a node reported another's failure: those that do not answer now are the ones
            for peer in await self.model.swarm.unreachable(peers):
                self.model.swarm.ban(peer)
        self.failovers += 1
        self.replayed_steps += sum(item.apply for item in self.replay)
        self.step = self.restore.step
        # on the caller's thread, behind any of its jobs from the pass cut short (their gradients are dropped)
        await on_caller(self.layers.restore, self._edge_restore_point)
        self._rolled_back = True
        await self.open()

    async def _with_failover(self, work):
        """`await work()` after catching up with the replay list; on a lost node, recover and try again (at most
        max_failovers times in a row)."""
        failures = 0
        while True:
            try:
                if not self.chains or any(link.broken for chain in self.chains for link in chain):
                    # a pass cut short by an error of the caller's (or a cancellation): the nodes may hold part of
                    # it, so every chain goes back to the restore point
                    await self._recover(None)
                if self._rolled_back:
                    for item in self.replay:
                        await self._pass(item)
                    self._rolled_back = False
                return await work()
            except LinkLost as exc:
                failures += 1
                if failures > self.model.config.max_failovers:
                    close_chains(self.chains)  # the next call starts from the restore point
                    self.chains = []
                    raise
                await self._recover(exc)
            except BadRequestError:
                close_chains(self.chains)  # a node refused part of a pass: reopen before the next call
                self.chains = []
                raise

    @property
    def chain(self) -> list[Hop]:
        return [link.hop for link in self.links]

    # ---- passes ----------------------------------------------------------------------------------------------------

    def _codec(self, link: TrainLink, elements: int) -> WireCodec:
        return codec_for(None, link.hop, self.compression, elements=elements)

    def _step_timeout_s(self, apply: bool) -> float:
        """A call that takes an optimizer step with replicas waits on them too (up to their own timeout)."""
        timeout_s = self.model.config.request_timeout_s
        return 2 * timeout_s if apply and len(self.chains) > 1 else timeout_s

    @property
    def _edge_restore_point(self) -> EdgeState:
        return self.restore.edges or EdgeState(self.restore.step, {}, {})

    async def _pass(self, item: Pass) -> float:
        """One forward and backward pass of the batch: its rows split over the chains (data parallel) and, in each
        chain, into micro_batches that follow each other down the chain (pipelined: while one is at the second node
        the next is at the first); with item.apply, then one optimizer step on every node, taken with its last
        backward pass."""
        self._passes += 1
        step_id = f"{self.session_id}:{self._passes}"
        parts = len(self.chains) * self.micro_batches
        if item.input_ids.shape[0] < parts:
            raise ValueError(
                f"a batch of {item.input_ids.shape[0]} rows cannot be split over {len(self.chains)} chains of "
                f"{self.micro_batches} micro-batches"
            )
        total = labelled_tokens(item.labels) if parts > 1 else None
        # With item.apply, each node steps after the last backward pass of the batch it is sent: a link's requests
        # go out in the order they are built, and autograd has summed the earlier micro-batches' gradients by then.
        sent: dict[int, int] = {}

        def applies(link: TrainLink) -> bool:
            sent[id(link)] = sent.get(id(link), 0) + 1
            return item.apply and sent[id(link)] == self.micro_batches

        async def run(links: list[TrainLink], part: int, input_ids, labels) -> tuple[float, list[int]]:
            embedded = await on_caller(self.layers.embed, input_ids)
            outputs = await forward_pass(links, embedded.detach().cpu(), f"{step_id}.{part}", self._codec, keep=True)
            loss, grad = await on_caller(self.layers.loss_and_grad, outputs[-1], labels, total)
            steps, grad = await backward_pass(
                links, grad, f"{step_id}.{part}", self._codec, applies, timeout_of=self._step_timeout_s,
                step_after=self.step + 1, inputs=outputs,
            )  # fmt: skip
            await on_caller(self.layers.embed_backward, embedded, grad)
            return loss, steps

        ids, labels = item.input_ids.tensor_split(parts), item.labels.tensor_split(parts)
        results = await first_failure(
            run(self.chains[part // self.micro_batches], part, ids[part], labels[part]) for part in range(parts)
        )
        if item.apply:
            await on_caller(self.layers.step)
            self.step = min(step for _, steps in results for step in steps)
        return sum(loss for loss, _ in results)

    async def train_step(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, apply: bool = True
    ) -> float:
        """One forward and backward pass of a batch through the chain, then (with `apply`) one AdamW step on every
        node; the batch's loss before the step. `apply=False` gathers the gradients of more micro-batches first
        (scale their losses yourself: each pass's gradient is of its own mean loss). A node lost on the way is
        replaced (module docstring): the call returns once the step is taken on the new chain."""
        item = Pass(input_ids, check_labels(input_ids, labels), apply)

        async def run() -> float:
            loss = await self._pass(item)
            self.replay.append(item)
            return loss

        loss = await self._with_failover(run)
        if apply and self.step - self.restore.step >= self.checkpoint_every:
            await self._with_failover(self._checkpoint_now)
        return loss

    async def checkpoint(self) -> Checkpoint:
        """Fetch every node's slice and AdamW state now (hashes and signatures checked) as the new restore point,
        written to checkpoint_dir when set; a node lost on the way is replaced first."""
        return await self._with_failover(self._checkpoint_now)

    async def _checkpoint_now(self) -> Checkpoint:
        spans = []
        for link in self.links:
            message, answer = await link.call(
                frame(TrainStateRequest()), TrainState, max_answer_bytes=state_answer_bytes(link.state_bytes)
            )
            spans.append(await self._span_state(link, message, answer))
        session_id = self.links[0].session_id
        edges = self.layers.state(self.step) if self.layers.trains else None
        checkpoint = assemble(self.step, session_id, self.spec, dataclasses.asdict(self.optimizer), spans, edges)
        # trained weights that have diverged are not saved: the restore point stays the last good checkpoint
        check_checkpoint_edges(checkpoint, self.model.model_config, f"the client's edge layers at step {self.step}")
        if self.checkpoint_dir is not None:
            await asyncio.to_thread(write_checkpoint, self.checkpoint_dir, checkpoint)
        self.restore = checkpoint
        self.replay = []
        return checkpoint

    async def _span_state(self, link: TrainLink, message: TrainState, answer: Frame) -> SpanState:
        """The state a node answered, checked: its span, step, hashes and signature (LinkLost otherwise)."""
        hop = link.hop
        try:
            return await asyncio.to_thread(
                span_state_of,
                message,
                answer,
                (hop.start_block, hop.end_block),
                self.step,
                link.session_id,
                hop.peer_id,
                max_bytes=link.state_bytes,
            )
        except (RequestError, CheckpointError) as exc:
            raise LinkLost(link.peer_id, f"sent a bad training state: {exc.message}") from None

    async def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        """The loss of a batch with the adapter as it is now (nothing is saved or updated); its rows split over the
        data-parallel chains."""
        labels = check_labels(input_ids, labels)

        async def run() -> float:
            self._passes += 1
            step_id = f"{self.session_id}:{self._passes}"
            parts = min(len(self.chains), input_ids.shape[0])
            total = labelled_tokens(labels)

            async def part(links: list[TrainLink], ids: torch.Tensor, part_labels: torch.Tensor) -> float:
                hidden = await on_caller(self.layers.embed, ids, False)
                outputs = await forward_pass(links, hidden.cpu(), step_id, self._codec, keep=False)
                return await on_caller(self.layers.loss, outputs[-1], part_labels, total)

            split = zip(self.chains, input_ids.tensor_split(parts), labels.tensor_split(parts), strict=False)
            return sum(await first_failure(part(links, ids, lab) for links, ids, lab in split))

        return await self._with_failover(run)

    # ---- the adapter -----------------------------------------------------------------------------------------------

    async def adapter(self, chain: int = 0) -> AdapterSlice:
        """The whole adapter as the nodes of data-parallel chain `chain` hold it now (every slice checked against its
        hash and signature; the chains' replicas hold the same)."""

        async def fetch() -> AdapterSlice:
            spans = []
            for link in self.chains[chain]:
                message, answer = await link.call(
                    frame(TrainStateRequest()), TrainState, max_answer_bytes=state_answer_bytes(link.state_bytes)
                )
                spans.append(await self._span_state(link, message, answer))
            return merge_slices([span.slice for span in spans])

        return await self._with_failover(fetch)

    async def save_pretrained(self, folder: str | Path) -> Path:
        """Write the adapter as it is now as a PEFT LoRA folder (`PeftModel.from_pretrained` loads it; nodes serve
        it with `--adapters`, clients name it with `adapter=`)."""
        whole = await self.adapter()
        edges = self.layers.weights() if self.layers.trains else None
        return await asyncio.to_thread(
            save_peft_adapter, whole, self.spec, folder, base_model=self.model_path, edges=edges
        )

    async def close(self) -> None:
        close_chains(self.chains)
        self.chains = []
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
        return self.runner.call(self.inner.train_step(input_ids, labels, apply=apply), lend_thread=True)

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        return self.runner.call(self.inner.evaluate(input_ids, labels), lend_thread=True)

    def adapter(self, chain: int = 0) -> AdapterSlice:
        return self.runner.call(self.inner.adapter(chain))

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


__all__ = ["IGNORE_INDEX", "AsyncFineTuningSession", "FineTuningSession", "OptimizerSettings", "causal_lm_loss"]
