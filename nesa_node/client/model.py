"""`DistributedModelForCausalLM`: a Hugging Face style causal LM whose transformer blocks run on the swarm.

The client holds only the embeddings, the final norm and the LM head. `generate` is transformers' own
generation (greedy, sampling, beam-free strategies): every call of `forward` sends only the tokens the remote
caches have not seen yet through an inference session, so each step moves one token's hidden states.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from nesa_node.client.session import LinkFailed, RemoteInferenceSession, codec_for
from nesa_node.client.swarm import SwarmClient
from nesa_node.compression.codec import DEFAULT_CODEC
from nesa_node.errors import (
    CacheBudgetError,
    NoRouteError,
    QuotaExceededError,
    SessionStateError,
    TooManySessionsError,
    WrongBlocksError,
)
from nesa_node.protocol.dht import default_dht_prefix
from nesa_node.protocol.records import NodeState
from nesa_node.protocol.wire import WireCodec
from nesa_node.routing.chain import Chain, ChainRequest, RoutingParams, SwarmSnapshot, select_chain
from nesa_node.routing.ga import load_params
from nesa_node.sharding.blocks import load_client_edges, load_config

logger = logging.getLogger(__name__)

# refusals at open that say the node's record no longer holds, not that the request is wrong
ROUTABLE_REFUSALS = (WrongBlocksError, CacheBudgetError, TooManySessionsError, QuotaExceededError)


def _candidates(snapshot: SwarmSnapshot, request: ChainRequest, banned: frozenset[str]) -> str:
    """Why the nodes of the requested block range were not used: what a NoRouteError adds for its reader."""
    end = request.end_block if request.end_block is not None else snapshot.num_blocks
    seen = []
    for node in snapshot.nodes:
        if node.end_block <= request.start_block or node.start_block >= end:
            continue
        if node.peer_id in banned:
            reason = "banned after a failure"
        elif node.peer_id in request.exclude:
            reason = "already in the chain"
        elif not node.online:
            reason = "not online"
        else:
            reason = f"{node.cache_tokens_left} cache tokens left"
        seen.append(f"{node.peer_id[-8:]} (blocks {node.start_block}:{node.end_block}, {reason})")
    return f"nodes seen for blocks {request.start_block}:{end}: " + (", ".join(seen) or "none")


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    """Causal LM over a swarm. Build it with `from_pretrained(path, initial_peers=[...])`; close it when done."""

    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(
        self,
        config,
        edges,
        swarm: SwarmClient,
        *,
        mode: str = "direct",
        compression: str | WireCodec = DEFAULT_CODEC,
        routing_params: RoutingParams | None = None,
        chain_selector=None,
        lanes: bool = True,
    ):
        super().__init__(config)
        self.max_failovers = 3  # node failures survived per step (each bans the node and replaces its span)
        # chains tried when opening a session (and replacements tried in a failover): records of crashed nodes
        # linger until they expire (3 announce periods + 10 s), so after a burst of crashes many dead nodes can be
        # met in a row; each one that fails is banned, so every attempt removes a candidate
        self.max_open_attempts = 32
        # hidden-state codec asked of every hop that accepts it (others get "none"); a name or a WireCodec
        self.compression = compression if isinstance(compression, WireCodec) else WireCodec.of(compression)
        self.model_edges = edges
        self.swarm = swarm
        self.mode = mode
        # direct mode: hidden states over the nodes' data lanes (encrypted TCP, nesa_node.protocol.lane) where offered
        self.lanes = lanes
        # eq. 18 exponents and search settings (nesa_node.routing); `nesa-node tune` writes tuned ones
        self.routing_params = routing_params or RoutingParams()
        # (snapshot, request) -> Chain; chains may use a part of a node's span
        self.chain_selector = chain_selector or functools.partial(select_chain, params=self.routing_params)
        self.partial_spans = True
        # first-block candidates pinged per session open (those with no round trip measured in the last minute),
        # on their data lanes: a TCP socket the client closes itself, so a dead candidate leaves nothing behind
        # (pings over libp2p, cancelled when a killed peer did not answer, once made the churn soak lose steps).
        # Nodes without a lane are pinged over libp2p. 0 turns pings off: routing then uses the links nodes publish.
        self.max_pinged_candidates = 8
        self.probe_timeout_s = 1.0  # asking a node for its NodeInfo directly when routing finds no chain (reroute)
        self.active_session: RemoteInferenceSession | None = None
        self._history: torch.Tensor | None = None  # (batch, position) tokens the active session has seen
        self.last_chain: Chain | None = None

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        *,
        initial_peers: list[str],
        dht_prefix: str | None = None,
        mode: str = "direct",
        compression: str | WireCodec = DEFAULT_CODEC,
        dtype: str = "float32",
        request_timeout_s: float = 30.0,
        routing_params: RoutingParams | str | Path | None = None,
        lanes: bool = True,
        **unused,
    ) -> DistributedModelForCausalLM:
        """Load the client-side weights of `model_path` and connect to the swarm through `initial_peers`.

        `compression` names the codec for hidden states on every hop that accepts it ("none" elsewhere);
        see `nesa_node.compression.codec.CODECS`. Raises CodecError for an unknown codec.
        `routing_params`: eq. 18's exponents, as RoutingParams or the path of a JSON file `nesa-node tune` wrote
        (default: untuned, all exponents 1). Raises ValueError for a malformed file.
        `lanes`: in direct mode, send hidden states over the nodes' data lanes (direct TCP, AES-GCM with keys
        handed out over libp2p) where nodes offer them; False keeps every message on libp2p.
        """
        if unused:
            logger.debug("ignoring from_pretrained arguments %s", sorted(unused))
        model_path = str(model_path)
        config = load_config(model_path)
        if routing_params is not None and not isinstance(routing_params, RoutingParams):
            routing_params = load_params(routing_params)
        edges = load_client_edges(model_path, dtype=dtype, config=config)
        swarm = SwarmClient(
            list(initial_peers),
            dht_prefix=dht_prefix or default_dht_prefix(model_path),
            request_timeout_s=request_timeout_s,
        )
        try:
            model = cls(
                config, edges, swarm, mode=mode, compression=compression, routing_params=routing_params, lanes=lanes
            )
        except BaseException:
            swarm.close()
            raise
        with contextlib.suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(model_path)
        return model.eval()

    # ---- transformers plumbing ----------------------------------------------------------------------------

    def get_input_embeddings(self):
        return self.model_edges.embed_tokens

    def get_output_embeddings(self):
        return self.model_edges.lm_head

    @property
    def device(self) -> torch.device:
        return self.model_edges.embed_tokens.weight.device

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, logits_to_keep=0, **kwargs):
        # The caches live on the nodes: forward always gets the full sequence and sends only what is new.
        return {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": logits_to_keep}

    # ---- routing and sessions -----------------------------------------------------------------------------

    def choose_chain(
        self,
        *,
        batch: int = 1,
        max_length: int = 0,
        exclude: frozenset[str] = frozenset(),
        prompt_tokens: int = 0,
        new_tokens: int = 0,
    ) -> Chain:
        """The chain for a new session (or a cacheless forward): first-block candidates the client has no recent
        round trip to are pinged, so the first hop is chosen on the client's own measurement."""
        request = ChainRequest(
            batch=batch, max_length=max_length, exclude=exclude, prompt_tokens=prompt_tokens, new_tokens=new_tokens
        )
        self._ping_first_candidates(request)
        chain = self.reroute(request)
        self.last_chain = chain
        return chain

    def _ping_first_candidates(self, request: ChainRequest) -> None:
        if self.max_pinged_candidates <= 0:
            return
        banned = self.swarm.banned() | request.exclude
        try:
            records = self.swarm.node_records()
        except Exception as exc:  # reroute reads again and raises the error a user should see
            logger.debug("no records to choose ping candidates from: %r", exc)
            return
        candidates = sorted(
            record.info.peer_id
            for record in records
            if record.info.start_block <= request.start_block < record.info.end_block
            and record.info.state == NodeState.online
            and record.info.peer_id not in banned
        )
        self.swarm.measure_rtts(candidates[: self.max_pinged_candidates])

    def snapshot(self, *, fresh: bool = False) -> SwarmSnapshot:
        """The routing snapshot of the swarm for this model (records, links and the client's round trips)."""
        return self.swarm.snapshot(self.config.num_hidden_layers, fresh=fresh, hidden_size=self.config.hidden_size)

    def reroute(self, request: ChainRequest) -> Chain:
        """A chain for `request` (its block range; banned peers excluded) from a fresh view of the swarm."""
        request = replace(
            request,
            exclude=request.exclude | self.swarm.banned(),
            partial_spans=self.partial_spans,
            codec=self.compression.name,
        )
        try:
            return self.chain_selector(self.snapshot(), request)
        except NoRouteError:
            pass
        # The records at hand may be stale or lack a live node (its announcements missed the DHT replicas read, or a
        # replica that stopped answering slows every read): ask the nodes seen lately for these blocks directly, and
        # if that gives no chain either, decide on a completed DHT read.
        end = request.end_block if request.end_block is not None else self.config.num_hidden_layers
        candidates = [peer for peer in self.swarm.recent_nodes(request.start_block, end) if peer not in request.exclude]
        if self.swarm.probe_nodes(candidates, timeout_s=self.probe_timeout_s):
            with contextlib.suppress(NoRouteError):
                return self.chain_selector(self.snapshot(), request)
        snapshot = self.snapshot(fresh=True)
        try:
            return self.chain_selector(snapshot, request)
        except NoRouteError as error:
            raise NoRouteError(f"{error.message}; {_candidates(snapshot, request, self.swarm.banned())}") from None

    @contextlib.contextmanager
    def inference_session(
        self, *, max_length: int, batch: int = 1, prompt_tokens: int = 0
    ) -> Iterator[RemoteInferenceSession]:
        """Open one session along a chain; `generate` calls inside the block share it (and its caches).

        `prompt_tokens`, when known, tells routing how large the first pass is (eq. 18's transfer term)."""
        if self.active_session is not None:
            raise SessionStateError("an inference session is already active on this model")
        session = self._open_session(batch=batch, max_length=max_length, prompt_tokens=prompt_tokens)
        with session:
            self.active_session, self._history = session, None
            try:
                yield session
            finally:
                self.active_session, self._history = None, None

    def _open_session(self, *, batch: int, max_length: int, prompt_tokens: int = 0) -> RemoteInferenceSession:
        """Open a session on a chosen chain; a node that fails to open is banned and another chain chosen."""
        prompt_tokens = min(max(prompt_tokens, 0), max_length)
        for attempt in range(self.max_open_attempts):
            chain = self.choose_chain(  # NoRouteError when nothing is left
                batch=batch, max_length=max_length, prompt_tokens=prompt_tokens, new_tokens=max_length - prompt_tokens
            )
            session = RemoteInferenceSession(
                self.swarm,
                chain,
                batch=batch,
                max_length=max_length,
                mode=self.mode,
                lanes=self.lanes,
                compression=self.compression,
                reroute=self.reroute,
                max_failovers=self.max_failovers,
                max_replacement_attempts=self.max_open_attempts,
            )
            try:
                return session.open()
            except LinkFailed as failure:
                if failure.link is None or attempt + 1 == self.max_open_attempts:
                    raise
                logger.info("could not open a session on %s: %s", failure.link.hop.peer_id, failure)
                self.swarm.ban(failure.link.hop.peer_id)
            except ROUTABLE_REFUSALS as refusal:
                # the node's record was stale (it moved, filled its cache, began draining): route around it
                peer_id = getattr(refusal, "peer_id", None)
                if peer_id is None or attempt + 1 == self.max_open_attempts:
                    raise
                logger.info("%s refused the session: %s", peer_id, refusal)
                self.swarm.ban(peer_id)
        raise AssertionError("unreachable")  # the loop returns or raises

    @torch.inference_mode()
    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """transformers' generate, run through the swarm.

        Outside `inference_session` a session sized for this call is opened and closed. Inside one, `inputs`
        may repeat the session's tokens or hold only new ones: the session's tokens are then put in front.
        """
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        kwargs["use_cache"] = False  # generation must not build a local cache; the nodes hold it
        if self.active_session is not None:
            if input_ids is not None and self._history is not None and not self._extends_history(input_ids):
                input_ids = torch.cat([self._history, input_ids.to(self._history.device)], dim=1)
                kwargs.pop("attention_mask", None)
            output = super().generate(input_ids, *args, **kwargs)
            # the last generated token is not in the caches yet; the next call must start from it
            self._history = (output.sequences if hasattr(output, "sequences") else output).clone()
            return output
        if input_ids is None:
            raise SessionStateError("generate needs input_ids outside an inference session")
        generation_config = kwargs.get("generation_config") or self.generation_config
        max_new = kwargs.get("max_new_tokens") or generation_config.max_new_tokens
        max_length = (
            input_ids.shape[1] + max_new if max_new else kwargs.get("max_length") or generation_config.max_length
        )
        with self.inference_session(max_length=max_length, batch=input_ids.shape[0], prompt_tokens=input_ids.shape[1]):
            return super().generate(input_ids, *args, **kwargs)

    def _extends_history(self, input_ids: torch.Tensor) -> bool:
        history = self._history
        return (
            input_ids.shape[0] == history.shape[0]
            and input_ids.shape[1] >= history.shape[1]
            and torch.equal(input_ids[:, : history.shape[1]].to(history.device), history)
        )

    # ---- forward ------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ):
        """Logits of the tokens the active session has not seen (all tokens without a session).

        `logits_to_keep` > 0 computes logits for that many last positions only, as transformers' models do:
        generate asks for 1, which spares the LM head (hidden x vocab per token) on every prompt token.
        """
        if attention_mask is not None and not bool(attention_mask.all()):
            raise SessionStateError("padded batches are not supported yet: give rows of equal length")
        session = self.active_session
        if session is None:
            hidden = self.model_edges.embed_tokens(input_ids)  # (batch, seq, hidden)
            hidden = self.remote_forward(hidden)
            return CausalLMOutputWithPast(logits=self._logits(hidden, logits_to_keep))
        seen = session.position
        if self._history is not None and not self._extends_history(input_ids):
            raise SessionStateError("input_ids do not extend the tokens this inference session has processed")
        new_tokens = input_ids[:, seen:]
        if new_tokens.shape[1] == 0:
            raise SessionStateError("no new tokens to process in this inference session")
        hidden = self.model_edges.embed_tokens(new_tokens)  # (batch, new, hidden)
        hidden = session.step(hidden)
        self._history = input_ids.clone()
        return CausalLMOutputWithPast(logits=self._logits(hidden, logits_to_keep))

    def _logits(self, hidden: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]  # (batch, kept, hidden)
        return self.model_edges.lm_head(self.model_edges.norm(hidden))  # (batch, kept, vocab)

    def remote_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run hidden states (batch, seq, hidden) through every block without caches (client-relayed)."""
        chain = self.choose_chain(batch=hidden.shape[0])

        async def run(hidden: torch.Tensor) -> torch.Tensor:
            for hop in chain.hops:
                codec, output_codec = codec_for(None, hop, self.compression), codec_for(hop, None, self.compression)
                hidden, _ = await self.swarm.forward_async(hop, hidden, codec, output_codec)
            return hidden

        return self.swarm.call(run(hidden))

    def close(self) -> None:
        self.swarm.close()

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
