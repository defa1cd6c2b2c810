"""`AsyncDistributedModel`: a causal LM whose transformer blocks run on the swarm, for asyncio programs and servers.

The client holds the embeddings, the final norm and the LM head; one Swarm (one P2P host) serves any number of
concurrent sessions and generations:

    model = await AsyncDistributedModel.from_pretrained(path, initial_peers=[...])
    tokens = await model.generate(input_ids, max_new_tokens=32)           # greedy; do_sample=True samples
    async for token in model.stream(input_ids, max_new_tokens=32): ...    # one (batch,) tensor per new token
    async with model.inference_session(max_length=128) as session: ...   # steps of hidden states
    await model.close()

The client's own compute (embedding a token, the LM head of one position) runs on the event loop: it is small next
to a step through the chain. With several sessions stepping, the LM head scores the sessions waiting together in one pass
on a thread of its own (client/head_batch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from nesa_node.client.adapter_lookup import AdapterLookup, adapter_id_of_folder, own_adapter_of_folder
from nesa_node.client.audit import Auditor, AuditOutcome
from nesa_node.client.canaries import CanaryChecker, CanaryOutcome
from nesa_node.client.chain_links import LinkFailed
from nesa_node.client.codec_choice import codec_for
from nesa_node.client.config import ClientConfig, client_config
from nesa_node.client.folder_files import read_canaries, read_weights_manifest
from nesa_node.client.head_batch import HeadBatcher, choose_tokens
from nesa_node.client.majority import MajoritySession, open_majority_session
from nesa_node.client.open_refusals import ROUTABLE_REFUSALS, OpenRefusals, RefusedOpens
from nesa_node.client.private_edges import EdgeBlocks, EdgeSession, check_private_edges
from nesa_node.client.routing import ChainSelector, Router
from nesa_node.client.session import InferenceSession
from nesa_node.client.session_chain import OwnAdapter
from nesa_node.client.stability import StabilityTracker
from nesa_node.client.swarm import Swarm
from nesa_node.errors import (
    NoRouteError,
    PeerUnavailableError,
    RequestError,
    SessionStateError,
)
from nesa_node.privacy.noise import check_sigma
from nesa_node.protocol.dht import default_dht_prefix
from nesa_node.routing.chain import Chain, ChainRequest
from nesa_node.sharding.blocks import DTYPES, check_device, load_config
from nesa_node.sharding.client_edges import ClientEdges, load_client_edges
from nesa_node.sharding.weights_manifest import WeightsManifest
from nesa_node.verification.canaries import CanarySet

logger = logging.getLogger(__name__)

DEFAULT_NEW_TOKENS = 20  # what transformers generates when no length is set
MAX_AUDITED_RUNS = 3  # generations tried when audits blame a node of the chain (each blamed node is banned)


def default_new_tokens(generation_config, prompt_tokens: int) -> int:
    """New tokens when a call names no length, read as transformers reads a generation config: its max_new_tokens;
    else its max_length, prompt included; else DEFAULT_NEW_TOKENS."""
    configured = getattr(generation_config, "max_new_tokens", None)
    if configured is not None:
        return configured
    total = getattr(generation_config, "max_length", None)
    if total:
        return max(total - prompt_tokens, 0)
    return DEFAULT_NEW_TOKENS


async def swarm_dtype(swarm: Swarm, *, timeout_s: float = 10.0) -> str:
    """The dtype most of the swarm's nodes announce for this model (float32 when none is seen within `timeout_s`,
    or none announces a dtype the client can run)."""
    try:
        records = await asyncio.wait_for(swarm.node_records(), timeout=timeout_s)
    except Exception as exc:  # an empty or slow DHT: the client still starts
        logger.info("no node records to take the dtype from (%r); the client runs in float32", exc)
        return "float32"
    dtypes = [record.info.dtype for record in records if record.info.dtype in DTYPES]
    if not dtypes:
        logger.info("no node of this model seen yet; the client runs in float32")
        return "float32"
    return max(sorted(set(dtypes)), key=dtypes.count)


class AsyncDistributedModel(AdapterLookup):
    """A causal LM over a swarm (see the module docstring). Build it with `from_pretrained`; close it when done."""

    def __init__(
        self,
        model_config,
        edges: ClientEdges,
        swarm: Swarm,
        config: ClientConfig,
        *,
        chain_selector: ChainSelector | None = None,
        generation_config=None,
        adapter: str | None = None,
        edge_blocks: EdgeBlocks | None = None,
        canaries: CanarySet | None = None,
    ):
        self.model_config = model_config
        self.adapter = adapter  # the LoRA adapter id sessions use unless a call names another (or None: base)
        self.own_adapters: dict[str, OwnAdapter] = {}  # adapters named by folder: sent to nodes that lack them
        self.refused_opens = RefusedOpens()  # nodes that refused opens of their own accord (client/open_refusals.py)
        self.edges = edges
        self.edge_blocks = edge_blocks  # blocks the client runs itself (private_edges); None: the swarm runs all
        self.swarm = swarm
        self.config = config
        self.router = Router(
            swarm,
            config,
            num_blocks=model_config.num_hidden_layers,
            hidden_size=model_config.hidden_size,
            chain_selector=chain_selector,
        )
        self.router.adapter_reachable = self.adapter_reachable
        self.generation_config = generation_config
        verify = config.verify
        self.auditor = Auditor(self, verify.rate) if verify.mode == "audit" else None
        if verify.mode == "canary" and canaries is None:
            raise ValueError('verify="canary:P" needs its known answers: canaries= (from_pretrained reads the file)')
        self.canary_checker = CanaryChecker(self, verify.rate, canaries) if verify.mode == "canary" else None
        self.last_verification: dict | None = None  # what the last generation's checks found (audit, canary, majority)
        self.last_receipts = None  # the last audited session's SessionReceipts (verification/receipts.py)
        # next-token scores of concurrent sessions in shared LM head passes
        self.head = HeadBatcher(self._last_scores, window_s=config.head_batch_window_ms / 1000, waves=config.head_waves)

    @classmethod
    async def from_pretrained(
        cls,
        model_path: str | Path,
        *,
        initial_peers: list[str] | tuple[str, ...],
        dht_prefix: str | None = None,
        dtype: str | None = None,
        device: str = "cpu",
        adapter: str | None = None,
        weights_manifest: str | Path | WeightsManifest | None = None,
        canaries: str | Path | CanarySet | None = None,
        private_edges: tuple[int, int] | None = None,
        boundary_noise: float = 0.0,
        config: ClientConfig | None = None,
        **settings,
    ) -> AsyncDistributedModel:
        """Load the client-side weights of `model_path` and join the swarm through `initial_peers`.

        The client's layers (embeddings, final norm, LM head) run in `dtype` on `device`; by default in the dtype
        the swarm's nodes announce, so a lossless swarm gives the tokens of one process in that dtype (float32 when
        no node is seen yet). `settings` are ClientConfig fields (mode, compression, lanes, request_timeout_s,
        routing_params, ...); an unknown one raises TypeError. `adapter`: the LoRA adapter sessions use by
        default (a name nodes announce, an adapter folder, or an adapter id; see `resolve_adapter`).
        `weights_manifest`: the model's per-block weight hashes (`nesa-node model manifest`; a path or a
        WeightsManifest; default the folder's weights-manifest.json when it has one): only nodes announcing those
        weights for their span are routed to (sharding/weights_manifest.py). WeightsManifestError for a manifest that
        cannot be read or is of a model with another number of blocks.
        `canaries`: with verify="canary:P", the known answers nodes are checked with (`nesa-node model canaries`; a
        path or a CanarySet; default the folder's canaries.safetensors). CanaryFileError when there is none, it
        cannot be read or is of another model; ValueError when given with another verify policy.
        `private_edges` (a, b): the client also runs decoder blocks [0, a) and [L-b, L) itself; nodes serve only the
        middle and never see token ids or vocabulary-sized tensors (client/private_edges.py; what this hides is
        measured by `nesa-node privacy-check`). `boundary_noise`: Gaussian noise of this sigma (relative to each
        token's RMS) on every hidden state that leaves the client (privacy/noise.py); it costs output quality.
        Raises ModelLoadError for a bad model folder (its
        DeviceUnavailableError for a device this machine lacks), ValueError for bad settings, PeerUnavailableError
        when the swarm cannot be joined."""
        config = client_config(config, **settings)
        model_path = str(model_path)
        model_config = load_config(model_path)
        generation_config = None
        with contextlib.suppress(OSError):
            from transformers import GenerationConfig

            generation_config = GenerationConfig.from_pretrained(model_path)
        check_device(device)  # before joining: a mistake shows at once
        boundary_noise = check_sigma(boundary_noise)
        if private_edges is not None:
            private_edges = check_private_edges(private_edges, model_config.num_hidden_layers)
        manifest = await asyncio.to_thread(read_weights_manifest, weights_manifest, model_path, model_config)
        if config.verify.mode == "canary":
            canaries = await asyncio.to_thread(read_canaries, canaries, model_path, model_config)
        elif canaries is not None:
            raise ValueError(
                f'known answers (canaries=, --canaries) are for verify="canary:P"; this client verifies '
                f'"{config.verify}"'
            )
        swarm = await Swarm.create(
            list(initial_peers),
            dht_prefix=dht_prefix or default_dht_prefix(model_path),
            request_timeout_s=config.request_timeout_s,
            records_wait_s=config.records_wait_s,
            records_fresh_s=config.records_fresh_s,
            records_stale_s=config.records_stale_s,
        )
        try:
            swarm.use_lanes = config.lanes
            swarm.stability = StabilityTracker(weight=config.stability_weight, period_s=config.stability_period_s)
            if dtype is None:
                dtype = await swarm_dtype(swarm)
            edges = await asyncio.to_thread(
                load_client_edges, model_path, dtype=dtype, device=device, config=model_config
            )
            edge_blocks = None
            if private_edges is not None or boundary_noise > 0:
                edge_blocks = await asyncio.to_thread(
                    EdgeBlocks.load,
                    model_path,
                    private_edges or (0, 0),
                    config=model_config,
                    dtype=dtype,
                    device=device,
                    noise_sigma=boundary_noise,
                )
            model = cls(
                model_config,
                edges,
                swarm,
                config,
                generation_config=generation_config,
                edge_blocks=edge_blocks,
                canaries=canaries,
            )
            model.router.weights_manifest = manifest
            model.adapter = await model.resolve_model_adapter(adapter) if adapter is not None else None
            model.check_session_adapter(model.adapter)  # a combination no session could run: refused now
        except BaseException:
            await swarm.close()
            raise
        return model

    async def close(self) -> None:
        await self.head.close()
        await self.swarm.close()

    async def __aenter__(self) -> AsyncDistributedModel:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # ---- routing and sessions ----------------------------------------------------------------------------------------

    async def choose_chain(
        self,
        *,
        batch: int = 1,
        max_length: int = 0,
        exclude: frozenset[str] = frozenset(),
        prompt_tokens: int = 0,
        new_tokens: int = 0,
        adapter: str | None = None,
        adapter_block_bytes: float | None = None,
        exclude_more: frozenset[str] = frozenset(),
    ) -> Chain:
        """The chain for a new session (or a cacheless forward), for LoRA adapter id `adapter` when given: through
        any node, a node lacking it costed with getting its blocks (sent by this client when it holds the adapter,
        else fetched from the nodes announcing it); NoRouteError when the swarm has none."""
        first, end = self.swarm_blocks
        request = ChainRequest(
            start_block=first,
            end_block=end,
            batch=batch,
            max_length=max_length,
            step_tokens=self.config.step_tokens(batch, max_length),
            exclude=exclude | exclude_more,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            adapter=adapter,
            adapter_block_bytes=(
                adapter_block_bytes
                if adapter_block_bytes is not None
                else await self.adapter_block_bytes(adapter)
                if adapter is not None
                else 0.0
            ),
            adapter_reachable=await self.adapter_reachable(adapter) if adapter is not None else None,
        )
        return await self.router.choose_chain(request)

    @property
    def swarm_blocks(self) -> tuple[int, int]:
        """The blocks the swarm runs for this client: all, or the middle [a, L-b) with private edges."""
        if self.edge_blocks is not None:
            return self.edge_blocks.swarm_blocks
        return 0, self.model_config.num_hidden_layers

    def with_edges(self, session: InferenceSession) -> InferenceSession | EdgeSession | MajoritySession:
        """`session` with this client's edge blocks around its steps (itself without private edges)."""
        return session if self.edge_blocks is None else EdgeSession(session, self.edge_blocks)

    async def open_session(
        self, *, max_length: int, batch: int = 1, prompt_tokens: int = 0, adapter: str | None = None
    ) -> InferenceSession | EdgeSession | MajoritySession:
        """An open session on a chosen chain; a node that fails to open or refuses is routed around as
        client/open_refusals.py says (up to max_open_attempts). `prompt_tokens`, when known, tells
        routing how large the first pass is (eq. 18's transfer term). `adapter`: the LoRA adapter every node runs
        the session with (as `resolve_adapter` takes it; default the model's own, `from_pretrained(adapter=...)`).
        Close it when done."""
        prompt_tokens = min(max(prompt_tokens, 0), max_length)
        adapter_id = await self.resolve_adapter(adapter) if adapter is not None else self.adapter
        self.check_session_adapter(adapter_id)
        block_bytes = await self.adapter_block_bytes(adapter_id) if adapter_id is not None else 0.0
        attempts = self.config.max_open_attempts
        refusals = OpenRefusals(self.swarm, own_adapter=adapter_id in self.own_adapters)
        remembered = self.refused_opens.excluded(batch, max_length)  # refused as much before: left out while others do

        async def choose(leave_out: frozenset[str]) -> Chain:  # NoRouteError when nothing is left
            return await self.choose_chain(
                batch=batch,
                max_length=max_length,
                prompt_tokens=prompt_tokens,
                new_tokens=max_length - prompt_tokens,
                adapter=adapter_id,
                adapter_block_bytes=block_bytes,
                exclude_more=leave_out | refusals.passed_over,
            )

        for attempt in range(attempts):
            try:
                try:
                    chain = await choose(remembered)
                except NoRouteError:
                    if not remembered:
                        raise
                    remembered = frozenset()  # no chain without them: they are asked again
                    chain = await choose(remembered)
            except NoRouteError as error:
                raise refusals.no_route(error) from None
            if self.config.verify.mode == "majority":  # (on the first attempt: its replicas are its own to open)
                return self.with_edges(
                    await open_majority_session(
                        self,
                        chain,
                        replicas=self.config.verify.replicas,
                        voted_blocks=self.config.verify.blocks,
                        batch=batch,
                        max_length=max_length,
                        adapter=adapter_id,
                        adapter_block_bytes=block_bytes,
                    )
                )
            session = InferenceSession(
                self.swarm,
                chain,
                self.config,
                batch=batch,
                max_length=max_length,
                reroute=self.router.reachable_chain,
                adapter=adapter_id,
                own_adapter=self.own_adapters.get(adapter_id) if adapter_id is not None else None,
                adapter_block_bytes=block_bytes,
                commit=self.auditor is not None,
                hidden_size=self.model_config.hidden_size,
            )
            try:
                opened = await session.open()
            except (LinkFailed, RequestError) as error:
                refusals.take(error, last_attempt=attempt + 1 == attempts)
                continue
            refusals.opened(self.refused_opens, batch=batch, max_length=max_length)
            return self.with_edges(opened)
        raise SessionStateError("no session could be opened")  # the loop returns or raises first

    @contextlib.asynccontextmanager
    async def inference_session(
        self, *, max_length: int, batch: int = 1, prompt_tokens: int = 0, adapter: str | None = None
    ) -> AsyncIterator[InferenceSession]:
        session = await self.open_session(
            max_length=max_length, batch=batch, prompt_tokens=prompt_tokens, adapter=adapter
        )
        try:
            yield session
        finally:
            await session.close()

    # ---- the client's own layers -------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.edges.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.edges.embed_tokens.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states (batch, seq, hidden) of `input_ids`, in the client's dtype, on the CPU for the wire (read
        from a host copy of a table on a GPU: ClientEdges.lookup)."""
        with torch.inference_mode():
            return self.edges.lookup(input_ids)

    def logits(self, hidden: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Logits of the last `keep` positions (all with 0): the final norm and LM head over (batch, seq, hidden),
        on the client's device and in its dtype; returned on the CPU."""
        with torch.inference_mode():
            if keep > 0:
                hidden = hidden[:, -keep:]  # (batch, keep, hidden)
            hidden = hidden.to(self.device, self.dtype)
            return self.edges.scores(self.edges.norm(hidden)).cpu()  # (batch, kept, vocab)

    def _last_scores(self, last: torch.Tensor) -> torch.Tensor:
        """Next-token scores (rows, vocab), float32 on the CPU, of the last hidden states `last` (rows, hidden)."""
        return self.logits(last[:, None], keep=1)[:, -1].float()

    async def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) of a whole sequence, through a chain without caches (client-relayed)."""
        return self.logits(await self.remote_forward(self.embed(input_ids)))

    async def remote_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run hidden states (batch, seq, hidden) through every block without caches (client-relayed), with the
        base weights: a model given an adapter raises SessionStateError (sessions run adapters)."""
        if self.adapter is not None:
            raise SessionStateError(
                "a forward without an inference session runs the base model, not this model's adapter: open an "
                "inference session (generate does) to run it"
            )
        if self.edge_blocks is not None:
            hidden = self.edge_blocks.run_front(hidden)
        chain = await self.choose_chain(batch=hidden.shape[0])
        preferred = self.config.compression
        for hop in chain.hops:
            link = {"elements": hidden.numel(), "bandwidth_mbps": self.swarm.bandwidth_mbps(hop.peer_id, None)}
            codec = codec_for(None, hop, preferred, **link, lossless_bits=8 * hidden.element_size())
            output_codec = codec_for(hop, None, preferred, **link, lossless_bits=self.swarm.answer_bits(hop.peer_id))
            hidden, _ = await self.swarm.forward(hop, hidden, codec, output_codec)
        if self.edge_blocks is not None:
            hidden = self.edge_blocks.run_back(hidden)
        return hidden

    # ---- generation --------------------------------------------------------------------------------------------------

    async def stream(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        session: InferenceSession | None = None,
        adapter: str | None = None,
        send_ahead: bool | None = None,
    ) -> AsyncIterator[torch.Tensor]:
        """Generate up to `max_new_tokens` after `input_ids` (batch, seq); yields each new token column (batch,).
        Without `max_new_tokens`, the model folder's generation config decides, else DEFAULT_NEW_TOKENS, as in
        transformers (`default_new_tokens`).

        Greedy by default (the tokens single-process transformers generates, with compression "none"); `do_sample`
        samples with `temperature`, `top_k` and `top_p` from `generator`. Rows that produced `eos_token_id` continue
        with `pad_token_id` (default: the eos token) until every row has; then the generation ends. `session`: an open
        session whose caches hold exactly the tokens before input_ids' new ones (default: one opened for this call).
        A consumer that stops early closes the stream (`contextlib.aclosing`), which closes a session it opened.
        `adapter`: the LoRA adapter of a session opened here (see open_session).

        `send_ahead` (default: on a session opened here): from the second token on, each token's next step is sent
        down the chain before the token is yielded, so what the consumer does with a token (detokenize it, write it
        to an HTTP stream) overlaps the nodes' work on the next one instead of adding to it (the first token is
        yielded at once: sending the next step first would delay it where the nodes share the consumer's cores). A
        consumer that stops early then leaves the session a step past the last token it took, its output lost, so
        on the caller's own `session` it is for a session closed afterwards (the gateway's); without it, the session
        holds the tokens before the last one yielded, and a later stream goes on from there."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise SessionStateError("input_ids must be (batch, tokens) with at least one token")
        if max_new_tokens is None:
            max_new_tokens = default_new_tokens(self.generation_config, input_ids.shape[1])
        if max_new_tokens < 1:
            return
        batch, length = input_ids.shape
        owned = session is None
        if owned:
            session = await self.open_session(
                max_length=length + max_new_tokens, batch=batch, prompt_tokens=length, adapter=adapter
            )
        ahead: asyncio.Task | None = None  # the next token's step, sent before this token is yielded
        send_ahead = owned if send_ahead is None else send_ahead
        try:
            pad = eos_token_id if pad_token_id is None else pad_token_id
            finished = torch.zeros(batch, dtype=torch.bool)
            new = input_ids[:, session.position :]  # the tokens the session's caches have not seen
            for index in range(max_new_tokens):
                if ahead is None:
                    hidden = await session.step(self.embed(new))
                else:
                    sent, ahead = ahead, None  # its failure is this step's, not one left behind at the end
                    hidden = await sent
                scores = await self.head.scores(hidden[:, -1], id(session))  # (batch, vocab)
                token = choose_tokens(scores, do_sample, temperature, top_k, top_p, generator)  # (batch,)
                if eos_token_id is not None:
                    token = torch.where(finished, torch.full_like(token, pad), token)
                    finished |= token == eos_token_id
                last = index + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all()))
                if send_ahead and not last and index > 0:
                    ahead = asyncio.ensure_future(session.step(self.embed(token[:, None])))  # (batch, 1)
                    await asyncio.sleep(0)  # let it send the step now, before the consumer takes the token
                yield token
                if last:
                    return
                new = token[:, None]  # (batch, 1): the next step, unless it was sent ahead
        finally:
            # first: its next scores are no longer waited for, nor its wave held (even if the waits below are cut)
            self.head.forget(id(session))
            if ahead is not None:  # the consumer stopped early: the session is closed, by us or by the caller
                ahead.cancel()
                await asyncio.wait([ahead])  # raises only if this task itself is cancelled
                if not ahead.cancelled() and ahead.exception() is not None:
                    logger.debug("the step sent ahead failed after the stream stopped: %r", ahead.exception())
            if owned:
                await session.close()

    async def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int | None = None, **options) -> torch.Tensor:
        """`input_ids` (batch, seq) followed by the generated tokens (batch, seq + new); options as for `stream`.

        With verify="audit:P" and no `session` given, the generation's sampled windows are audited before it returns
        (client/audit.py), and with verify="canary:P" the nodes of its chain are checked with known answers
        (client/canaries.py); when a check blames a node (banned), the generation runs again on other nodes, up to
        MAX_AUDITED_RUNS times; `last_verification` says what the checks found."""
        if not self.checks_generations or options.get("session") is not None:
            return await self._generate(input_ids, max_new_tokens, options)
        if max_new_tokens is None:
            max_new_tokens = default_new_tokens(self.generation_config, input_ids.shape[1])
        blamed: list[str] = []
        adapter = options.pop("adapter", None)  # every run's: a run again after a blame is the same request
        for _ in range(MAX_AUDITED_RUNS):
            async with self.inference_session(
                max_length=input_ids.shape[1] + max_new_tokens,
                batch=input_ids.shape[0],
                prompt_tokens=input_ids.shape[1],
                adapter=adapter,
            ) as session:
                output = await self._generate(input_ids, max_new_tokens, {**options, "session": session})
                if self.auditor is not None:  # before the nodes drop the session: its records are fetched
                    outcome = await self.audit(session)
                else:
                    chain = session_of(session).chain
            if self.auditor is None:  # canaries go in sessions of their own, once the generation's is closed
                outcome = await self.check_canaries(
                    chain, max_length=input_ids.shape[1] + max_new_tokens, prompt_tokens=input_ids.shape[1]
                )
            blamed.extend(blame.peer_id for blame in outcome.blamed)
            self.last_verification = {**outcome.report(), "blamed": blamed}
            if outcome.clean:
                return output
        raise PeerUnavailableError(f"every one of {MAX_AUDITED_RUNS} chains tried failed its checks (blamed: {blamed})")

    async def _generate(self, input_ids: torch.Tensor, max_new_tokens: int | None, options: dict) -> torch.Tensor:
        tokens = [token async for token in self.stream(input_ids, max_new_tokens=max_new_tokens, **options)]
        if not tokens:
            return input_ids.clone()
        return torch.cat([input_ids, torch.stack(tokens, dim=1).to(input_ids.dtype)], dim=1)

    async def audit(self, session) -> AuditOutcome:
        """Audit an open session of this model (verify="audit:P"; client/audit.py), before closing it."""
        if self.auditor is None:
            raise SessionStateError('this model audits nothing: from_pretrained(..., verify="audit:P")')
        while isinstance(session, EdgeSession):
            session = session.session
        outcome = await self.auditor.audit(session)
        self.last_receipts = outcome.receipts
        return outcome

    @property
    def checks_generations(self) -> bool:
        """Whether a generation is checked once it ends (verify="audit:P" or "canary:P")."""
        return self.config.verify.mode in ("audit", "canary")

    async def check_canaries(self, chain: Chain, *, max_length: int = 0, prompt_tokens: int = 0) -> CanaryOutcome:
        """Check the nodes of a generation's `chain` with known answers (verify="canary:P"; client/canaries.py): each
        with chance P, in sessions of their own shaped like the generation's (`max_length`, `prompt_tokens`); blamed
        nodes are banned. Call it once the generation's session is closed."""
        if self.canary_checker is None:
            raise SessionStateError(
                'this model checks no canaries: from_pretrained(..., verify="canary:P") loads the known answers'
            )
        return await self.canary_checker.check(chain, max_length=max_length, prompt_tokens=prompt_tokens)


def session_of(session) -> InferenceSession | MajoritySession:
    """The swarm session under a private-edges session (`session` itself otherwise)."""
    while isinstance(session, EdgeSession):
        session = session.session
    return session


__all__ = [
    "AsyncDistributedModel",
    "ROUTABLE_REFUSALS",
    "adapter_id_of_folder",
    "client_config",
    "own_adapter_of_folder",
]
