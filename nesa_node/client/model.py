"""`DistributedModelForCausalLM`: the Hugging Face style, synchronous face of AsyncDistributedModel.

transformers' own `generate` (greedy, sampling, every strategy that needs no beam cache) drives it: each `forward`
sends only the tokens the remote caches have not seen yet through an inference session, so each step moves one
token's hidden states. The work runs on an event loop thread this object owns (`call` runs any coroutine there);
the async model, its Swarm and its sessions are the ones an asyncio program would use directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from nesa_node import event_loop, step_trace
from nesa_node.client.async_model import (
    DEFAULT_NEW_TOKENS,
    MAX_AUDITED_RUNS,
    AsyncDistributedModel,
    client_config,
    session_of,
)
from nesa_node.client.config import ClientConfig
from nesa_node.client.session import InferenceSession
from nesa_node.errors import PeerUnavailableError, SessionStateError
from nesa_node.protocol.tensors import WireCodec
from nesa_node.routing.chain import Chain, RoutingParams, SwarmSnapshot
from nesa_node.verification.canaries import CanarySet

T = TypeVar("T")


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _Caller:
    """The thread blocked in LoopThread.call(..., lend_thread=True): the work its coroutine hands over with
    `on_caller` runs there, in order."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()  # None: the coroutine is done
        self._lock = threading.Lock()
        self._open = True

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue `job` for the caller; False once the call has returned (the job is the submitter's to run)."""
        with self._lock:
            if self._open:
                self.jobs.put(job)
            return self._open

    def close(self) -> None:
        """No more jobs; those queued still run (their coroutines wait for them)."""
        with self._lock:
            self._open = False
        with contextlib.suppress(queue.Empty):
            while True:
                if (job := self.jobs.get_nowait()) is not None:
                    job()


_CALLER: contextvars.ContextVar[_Caller | None] = contextvars.ContextVar("nesa_caller", default=None)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the waiting coroutine was cancelled
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


async def on_caller(work: Callable[..., T], *args) -> T:
    """`work(*args)` on the thread that waits for this coroutine in LoopThread.call(..., lend_thread=True), inline
    otherwise. A synchronous client's own torch work (embeddings, the loss) then runs on the caller's thread, as it
    would without the swarm, and not on the loop thread: each thread that runs parallel operators keeps a team of
    OpenMP threads, and once a process holds more of them than cores, OpenMP wakes its team from sleep for every
    operator (a block's training pass on 2 cores: 13 ms on the thread that ran torch first, 21 ms on another)."""
    caller = _CALLER.get()
    if caller is None:
        return work(*args)
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def job() -> None:
        try:
            result, error = work(*args), None
        except Exception as exc:
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop has stopped: nobody waits any more
            loop.call_soon_threadsafe(_settle, done, result, error)

    if not caller.submit(job):
        return work(*args)
    return await done


class LoopThread:
    """An event loop on a daemon thread of its own; `call` runs a coroutine there from any other thread."""

    def __init__(self, name: str = "nesa-client-loop", loop_factory=event_loop.new_event_loop):
        self.loop = loop_factory()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coroutine: Coroutine, timeout: float | None = None, *, lend_thread: bool = False) -> Any:
        """The coroutine's result; PeerUnavailableError (the coroutine cancelled) after `timeout` seconds. With
        `lend_thread`, the calling thread runs what the coroutine hands it with `on_caller` while it waits."""
        if not lend_thread:
            future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
            try:
                return future.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                if future.done():  # the coroutine's own TimeoutError (the same class), not this wait's: typed
                    raise PeerUnavailableError("timed out waiting for the swarm") from None
                future.cancel()
                raise PeerUnavailableError(f"no answer within {timeout} s") from None
            except BaseException:  # KeyboardInterrupt while waiting: the coroutine stops too (a step, its session)
                future.cancel()
                raise
        caller = _Caller()
        token = _CALLER.set(caller)
        try:  # the coroutine's task starts in a copy of this context: it and its subtasks see `caller`
            future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        finally:
            _CALLER.reset(token)
        future.add_done_callback(lambda _: caller.jobs.put(None))
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while (job := caller.jobs.get(timeout=_left(deadline))) is not None:
                job()
        except queue.Empty:
            future.cancel()
            raise PeerUnavailableError(f"no answer within {timeout} s") from None
        except BaseException:  # KeyboardInterrupt while waiting or in a job: the coroutine stops too
            future.cancel()
            raise
        finally:
            caller.close()
        return future.result()

    def stop(self) -> None:
        """Cancel what still runs on the loop (hivemind's background tasks), stop it and join the thread."""
        if not self.loop.is_running():
            return

        async def cancel_rest() -> None:
            rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.call(cancel_rest(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


class SyncSession:
    """An InferenceSession driven from synchronous code (through the model's loop thread). Attributes other than
    the methods below are the async session's (position, timings, failovers, chain, session_id, ...)."""

    def __init__(self, session: InferenceSession, runner: LoopThread):
        self.session = session
        self.runner = runner

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.call(self.session.step(hidden))

    def close(self) -> None:
        self.runner.call(self.session.close(), timeout=30)

    def __getattr__(self, name: str):
        return getattr(self.session, name)

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    """Causal LM over a swarm. Build it with `from_pretrained(path, initial_peers=[...])`; close it when done.

    Its two bases are transformers' contract for a model that `generate` drives (transformers 5 requires
    GenerationMixin explicitly); everything of nesa-node's own is composed: the async model, its loop thread."""

    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config, client: AsyncDistributedModel, runner: LoopThread):
        super().__init__(config)
        self.client = client
        self.runner = runner
        self.active_session: SyncSession | None = None
        self._history: torch.Tensor | None = None  # (batch, position) tokens the active session has seen
        if client.generation_config is not None:
            self.generation_config = client.generation_config

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        *,
        initial_peers: list[str],
        dht_prefix: str | None = None,
        mode: str | None = None,
        compression: str | WireCodec | None = None,
        dtype: str | None = None,
        device: str = "cpu",
        request_timeout_s: float | None = None,
        routing_params: RoutingParams | str | Path | None = None,
        lanes: bool | None = None,
        adapter: str | Path | None = None,
        weights_manifest: str | Path | None = None,
        canaries: str | Path | CanarySet | None = None,
        private_edges: tuple[int, int] | None = None,
        boundary_noise: float = 0.0,
        verify: str | None = None,
        config: ClientConfig | None = None,
    ) -> DistributedModelForCausalLM:
        """Load the client-side weights of `model_path` and connect to the swarm through `initial_peers`.

        `dtype` and `device`: where the client's layers (embeddings, final norm, LM head) run; the dtype defaults
        to the one the swarm's nodes announce, so a lossless swarm gives one process's tokens in that dtype.
        `compression` names the codec for hidden states on every hop that accepts it ("none" elsewhere);
        see `nesa_node.compression.codec.CODECS`. "auto" (default) chooses per hop and message: lossless unless
        the 8-bit codec saves time on that link for that message (`compression/auto.py`), so on a LAN or loopback
        the tokens are exactly one process's. Raises CodecError for an unknown codec.
        `routing_params`: eq. 18's exponents, as RoutingParams or the path of a JSON file `nesa-node tune` wrote
        (default: untuned, all exponents 1). Raises ValueError for a malformed file.
        `lanes`: in direct mode, send hidden states over the nodes' data lanes (direct TCP, AES-GCM with keys
        handed out over libp2p) where nodes offer them; False keeps every message on libp2p.
        `adapter`: the LoRA adapter every session runs with unless `generate(..., adapter=...)` names another: a
        name the nodes announce, a PEFT adapter folder, or an adapter id (AsyncDistributedModel.resolve_adapter).
        `weights_manifest`: the model's per-block weight hashes (`nesa-node model manifest`; default the folder's
        weights-manifest.json when present): nodes announcing other weights are not routed to.
        `private_edges` (a, b): the client runs decoder blocks [0, a) and [L-b, L) itself, nodes only the middle;
        `boundary_noise`: Gaussian noise (sigma relative to each token's RMS) on what leaves the client. See
        client/private_edges.py and `nesa-node privacy-check` for what each hides.
        `verify`: "off"; "audit:P": nodes sign a commitment per 32-token window and a fraction P of the windows is
        re-executed on other nodes (client/audit.py); "canary:P": after each generation every node of its chain is,
        with chance P, sent a known-answer canary (client/canaries.py; `canaries` names the file, default the
        folder's canaries.safetensors that `nesa-node model canaries` writes); or "majority:N[@A:B]": the spans of
        blocks A:B (default all) run on N disjoint replicas and a strict majority decides each output
        (client/majority.py; NoConsensusError when none has one). A node a check catches is banned and the
        generation runs again on other nodes; `client.last_verification` says what the checks found.
        `config`: a ClientConfig for the other settings; mode, compression, request_timeout_s, routing_params, lanes
        and verify given as keywords override its fields, and those not given keep its values (or the defaults:
        direct, auto, 30 s, untuned, lanes on, off). An unknown keyword raises TypeError.
        """
        given = dict(
            mode=mode,
            compression=compression,
            request_timeout_s=request_timeout_s,
            routing_params=routing_params,
            lanes=lanes,
            verify=verify,
        )
        settings = client_config(config, **{name: value for name, value in given.items() if value is not None})
        runner = LoopThread()
        try:
            client = runner.call(
                AsyncDistributedModel.from_pretrained(
                    model_path,
                    initial_peers=initial_peers,
                    dht_prefix=dht_prefix,
                    dtype=dtype,
                    device=device,
                    adapter=None if adapter is None else str(adapter),
                    weights_manifest=weights_manifest,
                    canaries=canaries,
                    private_edges=private_edges,
                    boundary_noise=boundary_noise,
                    config=settings,
                ),
                timeout=120,
            )
        except BaseException:
            runner.stop()
            raise
        return cls(client.model_config, client, runner).eval()

    # ---- the async model's parts -------------------------------------------------------------------------------------

    def call(self, coroutine: Coroutine, timeout: float | None = None) -> Any:
        """Run a coroutine on this model's event loop (for the async model, its Swarm and sessions)."""
        return self.runner.call(coroutine, timeout=timeout)

    @property
    def swarm(self):
        return self.client.swarm

    @property
    def router(self):
        return self.client.router

    @property
    def last_chain(self) -> Chain | None:
        return self.client.router.last_chain

    # ---- transformers plumbing ---------------------------------------------------------------------------------------

    def get_input_embeddings(self):
        return self.client.edges.embed_tokens

    def get_output_embeddings(self):
        return self.client.edges.lm_head

    @property
    def device(self) -> torch.device:
        return self.client.edges.embed_tokens.weight.device

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, logits_to_keep=0, **kwargs):
        # The caches live on the nodes: forward always gets the full sequence and sends only what is new.
        return {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": logits_to_keep}

    # ---- routing and sessions ----------------------------------------------------------------------------------------

    def choose_chain(self, **request) -> Chain:
        """The chain for a new session (AsyncDistributedModel.choose_chain)."""
        return self.call(self.client.choose_chain(**request))

    def snapshot(self, *, fresh: bool = False) -> SwarmSnapshot:
        """The routing snapshot of the swarm for this model (records, links and the client's round trips)."""
        return self.call(self.client.router.snapshot(fresh=fresh))

    def open_session(
        self, *, max_length: int, batch: int = 1, prompt_tokens: int = 0, adapter: str | Path | None = None
    ) -> SyncSession:
        """An open session on a chosen chain (close it when done); see AsyncDistributedModel.open_session."""
        session = self.call(
            self.client.open_session(
                max_length=max_length,
                batch=batch,
                prompt_tokens=prompt_tokens,
                adapter=None if adapter is None else str(adapter),
            )
        )
        return SyncSession(session, self.runner)

    def session_on(self, chain: Chain, *, batch: int = 1, max_length: int, failover: bool = True) -> SyncSession:
        """An open session on exactly `chain` (tests and tools that pick nodes themselves)."""
        reroute = self.client.router.reachable_chain if failover else None
        session = InferenceSession(
            self.client.swarm,
            chain,
            self.client.config,
            batch=batch,
            max_length=max_length,
            reroute=reroute,
            hidden_size=self.client.model_config.hidden_size,
        )
        return SyncSession(self.client.with_edges(self.call(session.open())), self.runner)

    @contextlib.contextmanager
    def inference_session(
        self, *, max_length: int, batch: int = 1, prompt_tokens: int = 0, adapter: str | Path | None = None
    ) -> Iterator[SyncSession]:
        """Open one session along a chain (with LoRA `adapter`, default the model's); `generate` calls inside the
        block share it (and its caches)."""
        if self.active_session is not None:
            raise SessionStateError("an inference session is already active on this model")
        session = self.open_session(batch=batch, max_length=max_length, prompt_tokens=prompt_tokens, adapter=adapter)
        with session:
            self.active_session, self._history = session, None
            try:
                yield session
            finally:
                self.active_session, self._history = None, None

    @torch.inference_mode()
    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """transformers' generate, run through the swarm.

        Outside `inference_session` a session sized for this call is opened and closed, with LoRA `adapter=` when
        given (default the model's); inside one, the session's adapter applies. `inputs` may repeat the session's
        tokens or hold only new ones: the session's tokens are then put in front. With verify="audit:P" or
        "canary:P", a call outside a session is checked before it returns and run again on other nodes when a check
        blames one (see AsyncDistributedModel.generate; `client.last_verification` has the outcome).
        """
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        adapter = kwargs.pop("adapter", None)
        kwargs["use_cache"] = False  # generation must not build a local cache; the nodes hold it
        if self.active_session is not None:
            if adapter is not None:
                raise SessionStateError("inside an inference session, its adapter applies: give adapter= to it")
            if input_ids is not None and self._history is not None and not self._extends_history(input_ids):
                input_ids = torch.cat([self._history, input_ids.to(self._history.device)], dim=1)
                kwargs.pop("attention_mask", None)
            output = super().generate(input_ids, *args, **kwargs)
            # the last generated token is not in the caches yet; the next call must start from it
            self._history = (output.sequences if hasattr(output, "sequences") else output).clone()
            return output
        if input_ids is None:
            raise SessionStateError("generate needs input_ids outside an inference session")
        max_length = self._session_length(input_ids.shape[1], kwargs)
        blamed: list[str] = []
        for _ in range(MAX_AUDITED_RUNS if self.client.checks_generations else 1):
            with self.inference_session(
                max_length=max_length, batch=input_ids.shape[0], prompt_tokens=input_ids.shape[1], adapter=adapter
            ) as session:
                output = super().generate(input_ids, *args, **kwargs)
                if not self.client.checks_generations:
                    return output
                if self.client.auditor is not None:
                    outcome = self.call(self.client.audit(session.session))  # before the nodes drop the session
                else:
                    chain = session_of(session.session).chain
            if self.client.auditor is None:  # canaries go in sessions of their own, once the generation's is closed
                outcome = self.call(
                    self.client.check_canaries(chain, max_length=max_length, prompt_tokens=input_ids.shape[1])
                )
            blamed.extend(blame.peer_id for blame in outcome.blamed)
            self.client.last_verification = {**outcome.report(), "blamed": blamed}
            if outcome.clean:
                return output
        raise PeerUnavailableError(f"every one of {MAX_AUDITED_RUNS} chains tried failed its checks (blamed: {blamed})")

    def _session_length(self, prompt: int, kwargs: dict) -> int:
        """The tokens a session for one generate call must hold, read as transformers reads its length settings:
        `max_new_tokens` (argument, else generation config) after the prompt; else `max_length` in all; else the
        prompt and DEFAULT_NEW_TOKENS, capped at the model's max_position_embeddings."""
        generation_config = kwargs.get("generation_config") or self.generation_config
        max_new = kwargs.get("max_new_tokens")
        if max_new is None:
            max_new = getattr(generation_config, "max_new_tokens", None)
        if max_new is not None:
            if max_new < 1:
                raise ValueError(f"max_new_tokens must be at least 1, got {max_new}")
            return prompt + max_new
        max_length = kwargs.get("max_length") or getattr(generation_config, "max_length", None)
        if max_length:
            return max_length
        length = prompt + DEFAULT_NEW_TOKENS
        return min(length, getattr(self.config, "max_position_embeddings", None) or length)

    def _extends_history(self, input_ids: torch.Tensor) -> bool:
        history = self._history
        return (
            input_ids.shape[0] == history.shape[0]
            and input_ids.shape[1] >= history.shape[1]
            and torch.equal(input_ids[:, : history.shape[1]].to(history.device), history)
        )

    # ---- forward -----------------------------------------------------------------------------------------------------

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
        keep = logits_to_keep if isinstance(logits_to_keep, int) else 0
        session = self.active_session
        if session is None:
            hidden = self.call(self.client.remote_forward(self.client.embed(input_ids)))
            return CausalLMOutputWithPast(logits=self.client.logits(hidden, keep))
        if self._history is not None and not self._extends_history(input_ids):
            raise SessionStateError("input_ids do not extend the tokens this inference session has processed")
        new_tokens = input_ids[:, session.position :]
        if new_tokens.shape[1] == 0:
            raise SessionStateError("no new tokens to process in this inference session")
        step_trace.mark("forward")
        embedded = self.client.embed(new_tokens)
        step_trace.mark("embedded")
        hidden = session.step(embedded)  # (batch, new, hidden)
        step_trace.mark("stepped")
        self._history = input_ids.clone()
        logits = self.client.logits(hidden, keep)
        step_trace.mark("logits")
        return CausalLMOutputWithPast(logits=logits)

    def close(self) -> None:
        if not self.runner.loop.is_running():
            return
        try:
            with contextlib.suppress(Exception):
                self.call(self.client.close(), timeout=30)
        finally:
            self.runner.stop()

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["DistributedModelForCausalLM", "LoopThread", "SyncSession"]
