"""The gateway's HTTP API: OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models`, and `/health`, over
one AsyncDistributedModel (one P2P host; each request one swarm session, at most `max_concurrency` at once).

Requests and answers follow OpenAI's shapes: errors as {"error": {"message", "type", "param", "code"}} (404 for an
unknown model, 400 for a bad request, never a 500 for the caller's mistake); streams as server-sent events, one
`data: {json}` per chunk and `data: [DONE]` at the end; `stream_options.include_usage` adds one last chunk with
empty choices and the usage. `finish_reason` is "stop" (end of sequence or a stop string) or "length" (max_tokens),
the same streamed or not; stop strings never reach the client, also when they cross tokens (gateway/text.py). A
client that goes away mid-stream, or takes nothing of its stream for `send_timeout_s` (gateway/streams.py), closes the
request's session, so the nodes free its cache at once. Who may call `/v1/*` (API keys) and load adapters:
gateway/auth.py; how many requests one caller may have at once: gateway/callers.py; errors: gateway/handlers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from nesa_node.client.async_model import AsyncDistributedModel, session_of
from nesa_node.errors import AdapterError, AdapterMissingError, NesaError
from nesa_node.gateway.adapters import GatewayAdapters, LoadAdapter, UnloadAdapter
from nesa_node.gateway.answers import Generation, Prepared, completion
from nesa_node.gateway.auth import ADMIN_KEY_NEEDED, KEY_NEEDED, ApiKeys, is_loopback
from nesa_node.gateway.callers import CallerLimit, caller_address, default_limit
from nesa_node.gateway.dashboard import TOPOLOGY_PERIOD_S, DashboardState
from nesa_node.gateway.handlers import add_error_handlers
from nesa_node.gateway.middleware import BODY_TIMEOUT_S, CountRequests, LimitBody, RequireKey
from nesa_node.gateway.page import PAGE
from nesa_node.gateway.requests import (
    BODY_HEADROOM_BYTES,
    DEFAULT_MAX_TOKENS,
    MAX_CHARS_PER_TOKEN,
    MAX_STOP_CHARS,
    MAX_STOPS,
    PREFIX_CHARS_PER_TOKEN,
    PREFIX_SLACK_TOKENS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    content_text,
    shown,
    unencodable_field,
    unsupported_parameter,
)
from nesa_node.gateway.streams import SEND_TIMEOUT_S, EventStream, answer_events, quiet_cut_streams
from nesa_node.gateway.text import TextStream
from nesa_node.metrics import GatewayMetrics, exposition
from nesa_node.protocol.records import NodeState

logger = logging.getLogger(__name__)

WAITING_PER_SLOT = 4  # requests that may wait for a generation slot, per slot (--max-concurrency): past them, 429
CHECKS_WAITING_PER_SLOT = 4  # streamed answers' canary checks that may wait, per slot: past them, unchecked (guess)
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


class Gateway:
    """Turns OpenAI requests into swarm generations (see the module docstring)."""

    def __init__(
        self,
        model: AsyncDistributedModel,
        tokenizer,
        *,
        model_name: str,
        chat_template: str | None = None,
        max_concurrency: int = 64,
        topology_period_s: float = TOPOLOGY_PERIOD_S,
        adapter_dir: str | None = None,
        api_keys: ApiKeys | None = None,
        admin_keys: ApiKeys | None = None,
        send_timeout_s: float = SEND_TIMEOUT_S,
        max_requests_per_caller: int | None = None,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ):
        """`send_timeout_s`: the longest a streamed answer waits for its client to take a chunk (gateway/streams.py);
        `max_requests_per_caller`: requests one API key (without keys: one client address) may have running or
        waiting at once, by default a quarter of `max_concurrency` (gateway/callers.py); `admin_keys`: the keys that
        load and unload adapters, also API keys (gateway/auth.py); `body_timeout_s`: the longest a request's body
        may take to arrive whole (gateway/middleware.py)."""
        self.model = model
        self.api_keys = api_keys  # None: /v1 is open (gateway/auth.py)
        self.admin_keys = admin_keys  # None: adapters are managed with any API key (none: from this machine only)
        self.send_timeout_s = send_timeout_s
        self.body_timeout_s = body_timeout_s
        self.callers = CallerLimit(max_requests_per_caller or default_limit(max_concurrency))
        self.adapters = GatewayAdapters(model, base_name=model_name, adapter_dir=adapter_dir)
        self.topology_period_s = topology_period_s
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat_template = chat_template
        self.created = int(time.time())
        self.max_concurrency = max_concurrency
        self.slots = asyncio.Semaphore(max_concurrency)
        self.max_waiting = WAITING_PER_SLOT * max_concurrency
        self._waiting = 0  # requests waiting for a slot
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="gateway-tokenizer")
        self._closing: set[asyncio.Task] = set()  # sessions being closed (the loop keeps only weak references)
        # canary checks of answers under way, as many as answers (streamed answers do not wait for theirs), and at
        # most CHECKS_WAITING_PER_SLOT x that many waiting: past it a streamed answer's chain goes unchecked
        self._canary_slots = asyncio.Semaphore(max_concurrency)
        self._canary_pending = 0
        self.max_canary_pending = CHECKS_WAITING_PER_SLOT * max_concurrency
        self.eos_token_id = tokenizer.eos_token_id
        # a generation ends at any of the model's end tokens: the tokenizer's, and those of its generation config
        # (instruct models often end a turn with another token than the tokenizer's end of sequence)
        configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        configured = configured if isinstance(configured, list | tuple) else [configured]
        self.eos_token_ids = frozenset(int(i) for i in [self.eos_token_id, *configured] if isinstance(i, int))
        self.max_length = int(getattr(model.model_config, "max_position_embeddings", 2048))
        self.max_prompt_chars = MAX_CHARS_PER_TOKEN * self.max_length
        self.max_body_bytes = 4 * self.max_prompt_chars + BODY_HEADROOM_BYTES
        self.metrics = GatewayMetrics()
        dht = model.swarm.dht
        self.metrics.dht_peers.set_function(lambda: len(dht.protocol.routing_table.uid_to_peer_id))
        self.metrics.adapters_loaded.set_function(lambda: len(self.adapters.loaded))

    # ---- requests ----------------------------------------------------------------------------------------------------

    async def resolve_model(self, name: str) -> str | None:
        """The LoRA adapter id a request's `model` names (gateway/adapters.py); None for the base model. ApiError
        404 for a name this gateway does not serve."""
        try:
            return await self.adapters.resolve(name)
        except AdapterMissingError:
            raise ApiError(
                404,
                f"The model `{shown(name)}` does not exist; this gateway serves `{self.model_name}` and its adapters "
                "(GET /v1/models lists them)",
                param="model",
                code="model_not_found",
            ) from None

    def prompt_ids(self, request: CompletionRequest | ChatRequest) -> list[int]:
        if isinstance(request, ChatRequest):
            return self._chat_ids(request)
        prompt = request.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, "this gateway takes one prompt per request", param="prompt")
            prompt = prompt[0]
        self._check_chars(len(prompt), "prompt")
        ids = self._token_ids(prompt, add_special_tokens=True, param="prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids

    def _chat_ids(self, request: ChatRequest) -> list[int]:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ApiError(
                400,
                "this model has no chat template: start the gateway with --chat-template FILE (a Jinja template), "
                "or use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        if len(request.messages) > self.max_length:  # every message is a token of the prompt at least, as rendered
            raise ApiError(
                400,
                f"{len(request.messages)} messages: more than the model's context of {self.max_length} tokens can hold",
                param="messages",
                code="context_length_exceeded",
            )
        messages = [{"role": message.role, "content": content_text(message.content)} for message in request.messages]
        self._check_chars(sum(len(message["content"]) for message in messages), "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template that fails on these messages is the request's problem
            raise ApiError(400, f"the chat template failed on these messages: {exc}", param="messages") from None
        self._check_chars(len(text), "messages")  # as rendered: many short messages make a long text
        return self._token_ids(text, add_special_tokens=False, param="messages")

    def _token_ids(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        """The tokens of `text`. A text longer than PREFIX_CHARS_PER_TOKEN characters per token of the model's context
        is first tokenized in prefixes, each twice the last, and refused (400 `context_length_exceeded`) at the first
        that has more tokens than the context holds (plus PREFIX_SLACK_TOKENS, for the word cut at the prefix's end):
        a prompt bound to be refused costs the tokenizer about what the context's worth of text costs, not its whole
        length, and one that fits less than three times its own."""
        limit = self.max_length
        chars = PREFIX_CHARS_PER_TOKEN * limit
        while chars < len(text):
            tokens = len(self.tokenizer(text[:chars], add_special_tokens=add_special_tokens).input_ids)
            if tokens > limit + PREFIX_SLACK_TOKENS:
                raise ApiError(
                    400,
                    f"the {param} has more tokens than the model's context of {limit} holds (its first {chars} "
                    f"characters have {tokens})",
                    param=param,
                    code="context_length_exceeded",
                )
            chars *= 2
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise ApiError(
                400,
                f"the {param} has {chars} characters: more than the model's context of {self.max_length} tokens "
                f"can hold (at most {self.max_prompt_chars})",
                param=param,
                code="context_length_exceeded",
            )

    def swarm_max_length(self) -> int:
        """The longest session a chain of the nodes at hand takes, at most the model's limit: for each block the
        longest session any online node serving it accepts (a node announcing none: the model's limit), the
        shortest of those over the blocks. The model's limit when no record is at hand yet."""
        longest: dict[int, int] = {}
        num_blocks = self.model.model_config.num_hidden_layers
        for record in self.model.swarm.records_at_hand():
            info = record.info
            if info.state != NodeState.online or info.end_block > num_blocks:  # not a span of this model: as routing
                continue
            accepted = min(info.max_length or self.max_length, self.max_length)
            for block in info.blocks:
                longest[block] = max(longest.get(block, 0), accepted)
        return min(longest.values(), default=self.max_length)

    def budget(self, request: CompletionRequest | ChatRequest, prompt_tokens: int) -> int:
        """New tokens for the request: what it asks (completions: 16 unless it says), at most what the swarm's longest
        session leaves after the prompt (a chat that names no limit: all of that)."""
        asked = request.max_completion_tokens or request.max_tokens
        limit = self.swarm_max_length()
        room = limit - prompt_tokens
        if room < 1:
            where = "the model's limit" if limit == self.max_length else "the longest session the swarm's nodes take"
            raise ApiError(
                400,
                f"the prompt has {prompt_tokens} tokens; {where} is {limit}",
                param="messages" if isinstance(request, ChatRequest) else "prompt",
                code="context_length_exceeded",
            )
        if asked is None:
            return min(room, DEFAULT_MAX_TOKENS if isinstance(request, CompletionRequest) else room)
        return min(asked, room)

    # ---- generation --------------------------------------------------------------------------------------------------

    async def prepare(self, request: CompletionRequest | ChatRequest, adapter: str | None = None) -> Prepared:
        """The prompt's tokens, the stop strings and the token budget; ApiError (a 400) for anything wrong, so a
        streamed request is refused before its stream starts. The tokenizer runs on a thread of its own (a long
        prompt takes it a while), one prompt at a time."""
        unsupported = unsupported_parameter(request)
        if unsupported is not None:
            raise ApiError(
                400,
                f"`{unsupported}` is not supported by this gateway (leave it out, or at its default)",
                param=unsupported,
                code="unsupported_parameter",
            )
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"at most {MAX_STOPS} stop strings", param="stop")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ApiError(400, f"a stop string has at most {MAX_STOP_CHARS} characters", param="stop")
        self.check_room(preparing=True)  # prompts waiting for the tokenizer count as waiting for a slot
        self._waiting += 1
        try:
            ids = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self.prompt_ids, request)
        finally:
            self._waiting -= 1
        return Prepared(ids, stops, self.budget(request, len(ids)), adapter)

    async def generate(
        self, request: CompletionRequest | ChatRequest, prepared: Prepared, *, wait_for_checks: bool = True
    ) -> AsyncIterator[tuple[Generation, str]]:
        """Run the request through the swarm; yields (generation, new text) as text becomes final, the last time
        with finish_reason set. With verify="canary:P" the chain's nodes are checked once the session is closed: the
        last update carries the outcome when `wait_for_checks`, else the checks go on after it (a streamed answer
        does not wait for them); either way they run to their end and are counted in the metrics."""
        ids, stops, max_new = prepared.ids, prepared.stops, prepared.max_new
        generation = Generation(prompt_tokens=len(ids), text=TextStream(self._decode, stops))
        sampling: dict[str, Any] = {"do_sample": False}
        if request.temperature > 0:
            generator = torch.Generator()
            generator.manual_seed(request.seed if request.seed is not None else int.from_bytes(uuid.uuid4().bytes[:6]))
            sampling = {"do_sample": True, "temperature": request.temperature, "top_p": request.top_p}
            sampling["generator"] = generator
        metrics = self.metrics
        label = self.adapters.label(prepared.adapter)
        arrived = last = time.perf_counter()
        self.check_room()
        metrics.requests_waiting.inc()
        metrics.adapter_requests.labels(label, "waiting").inc()
        self._waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self._waiting -= 1
            metrics.requests_waiting.dec()
            metrics.adapter_requests.labels(label, "waiting").dec()
        metrics.requests_running.inc()
        metrics.adapter_requests.labels(label, "running").inc()
        metrics.prompt_tokens_total.inc(len(ids))
        session, failovers, canary_chain = None, 0, None
        try:
            session = await self.model.open_session(
                max_length=len(ids) + max_new, prompt_tokens=len(ids), adapter=prepared.adapter
            )
            stream = self.model.stream(
                torch.tensor([ids]),
                max_new_tokens=max_new,
                eos_token_id=self.eos_token_id,
                session=session,
                send_ahead=self.model.auditor is None,  # closed below; an audit replays every step it sent
                **sampling,
            )
            async with contextlib.aclosing(stream):
                async for column in stream:
                    failovers = self._count_failovers(session, failovers)
                    now = time.perf_counter()
                    if generation.completion_tokens == 0:
                        metrics.time_to_first_token_seconds.observe(now - arrived)
                    else:
                        metrics.inter_token_latency_seconds.observe(now - last)
                    last = now
                    metrics.generation_tokens_total.inc()
                    token = int(column[0])
                    generation.completion_tokens += 1
                    if token in self.eos_token_ids:
                        generation.finish_reason = "stop"
                        break
                    piece = generation.text.push(token)
                    if generation.text.stopped:
                        generation.finish_reason = "stop"
                        yield generation, piece
                        break
                    if piece:
                        yield generation, piece
            if self.model.auditor is not None:  # verify="audit:P": checked before the nodes drop the session
                generation.verification = (await self.model.audit(session)).report()
            elif self.model.canary_checker is not None:  # verify="canary:P": once this session is closed, below
                canary_chain = session_of(session).chain
        finally:  # no await here: a request whose client went away is cancelled again at each one
            self.slots.release()
            metrics.requests_running.dec()
            metrics.adapter_requests.labels(label, "running").dec()
            metrics.request_duration_seconds.observe(time.perf_counter() - arrived)
            if session is not None:
                self._count_failovers(session, failovers)
                self._count_checks(session, generation)
                closing = asyncio.ensure_future(session.close())  # the nodes free its cache now, in a task of its own
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
        if canary_chain is not None and not wait_for_checks and self._canary_pending >= self.max_canary_pending:
            # answers streamed faster than their checks run: this one goes unchecked rather than the checks pile up
            self.metrics.verification_checks_total.labels("skipped").inc()
            canary_chain = None
        if canary_chain is not None:  # each node in a session of its own, shaped like this one
            checks = asyncio.ensure_future(self._check_canaries(canary_chain, len(ids) + max_new, len(ids)))
            self._canary_pending += 1  # until it ends, however (cancelled before it starts, too)
            checks.add_done_callback(self._canary_done)
            self._closing.add(checks)  # a request whose client went away leaves them running to their end
            checks.add_done_callback(self._closing.discard)
            if wait_for_checks:
                generation.verification = await asyncio.shield(checks)
        rest = generation.text.finish()  # a stop string may end in the tokens held back for a character's end
        if generation.finish_reason is None:
            generation.finish_reason = "stop" if generation.text.stopped else "length"
        yield generation, rest

    @property
    def contended(self) -> bool:
        """Whether the gateway holds as many requests (running, waiting, being prepared) as it has generation slots:
        callers then keep to their share (gateway/callers.py). Counted at admission, so a burst is seen at once."""
        return self.callers.total >= self.max_concurrency

    def check_room(self, *, preparing: bool = False) -> None:
        """ApiError 429 when `max_waiting` requests already wait, for a slot while every slot is taken, or for the
        tokenizer (`preparing`: a request about to be tokenized)."""
        if (preparing or self.slots.locked()) and self._waiting >= self.max_waiting:
            raise ApiError(
                429,
                f"the gateway is generating its most answers at once and {self._waiting} requests wait: retry later",
                kind="rate_limit_error",
                code="overloaded",
            )

    async def complete_while_connected(self, request, prepared: Prepared, raw: Request) -> dict | None:
        """`complete`, cancelled (its session closed, its slot freed) once the client has gone away: None then."""
        answer = asyncio.ensure_future(self.complete(request, prepared))
        try:
            while True:
                done, _ = await asyncio.wait({answer}, timeout=DISCONNECT_POLL_S)
                if done:
                    return answer.result()
                if await raw.is_disconnected():
                    logger.info("a client went away before its answer: its generation is stopped")
                    return None
        finally:
            if not answer.done():
                answer.cancel()
                await asyncio.gather(answer, return_exceptions=True)

    def _count_failovers(self, session, counted: int) -> int:
        """Count the session's node replacements after the first `counted`, with their recovery times; returns how
        many recoveries are seen now (a kept chain is not a replacement)."""
        recoveries = session.failovers
        for recovery in recoveries[counted:]:
            if recovery["kept"]:  # a slow node kept, not replaced
                continue
            self.metrics.failovers_total.inc()
            self.metrics.failover_recovery_seconds.observe(recovery["seconds"])
        return len(recoveries)

    def _count_checks(self, session, generation: Generation) -> None:
        """Keep the session's verification report on the generation and count its checks by result."""
        report = generation.verification or getattr(session, "verification", None)
        if report is None:
            return
        generation.verification = report
        self._count_report(report)

    async def _check_canaries(self, chain, max_length: int, prompt_tokens: int) -> dict:
        """The canary checks of a request's chain (verify="canary:P"), counted in the metrics, at most
        max_concurrency requests' at once: their report (with "error" when they could not run)."""
        try:
            async with self._canary_slots:
                outcome = await self.model.check_canaries(chain, max_length=max_length, prompt_tokens=prompt_tokens)
        except Exception as error:  # a task of its own: nothing else would see it
            logger.warning("canary checks of a request failed: %r", error, exc_info=not isinstance(error, NesaError))
            return {"mode": str(self.model.config.verify), "error": str(error)[:300], "checks": {}, "blamed": []}
        report = outcome.report()
        self._count_report(report)
        return report

    def _canary_done(self, _task) -> None:
        self._canary_pending -= 1

    def _count_report(self, report: dict) -> None:
        for result, count in report["checks"].items():
            if count:
                self.metrics.verification_checks_total.labels(result).inc(count)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # ---- answers -----------------------------------------------------------------------------------------------------

    async def complete(self, request: CompletionRequest | ChatRequest, prepared: Prepared) -> dict:
        generation = None
        async for update in self.generate(request, prepared):
            generation = update[0]
        return completion(generation, chat=isinstance(request, ChatRequest), model=request.model)

    def events(self, request: CompletionRequest | ChatRequest, prepared: Prepared) -> AsyncGenerator[bytes, None]:
        """The server-sent events of a streamed answer (gateway/streams.py)."""
        return answer_events(request, self.generate(request, prepared, wait_for_checks=False))


def create_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app of `gateway`."""
    app = FastAPI(title="nesa-node gateway", docs_url=None, redoc_url=None)
    quiet_cut_streams()  # no ERROR line from uvicorn for a stream cut for a stalled reader (gateway/streams.py)

    add_error_handlers(app)
    app.add_middleware(LimitBody, max_bytes=gateway.max_body_bytes, timeout_s=gateway.body_timeout_s)
    app.add_middleware(RequireKey, api_keys=gateway.api_keys, admin_keys=gateway.admin_keys)  # before the body
    app.add_middleware(CountRequests, metrics=gateway.metrics)  # outermost: refused bodies are counted too

    async def authorized(request: Request) -> str:
        """Who calls (gateway/callers.py): its API key's id, or without keys its address; ApiError 401 without a key
        of this gateway's."""
        if gateway.api_keys is None:
            return caller_address(request.client.host if request.client else "")
        authorization = request.headers.get("authorization")
        caller = gateway.api_keys.identify(authorization)
        if caller is None and gateway.admin_keys is not None:
            caller = gateway.admin_keys.identify(authorization)
        if caller is None:
            raise ApiError(401, KEY_NEEDED, code="invalid_api_key")
        return caller

    async def may_manage(request: Request) -> None:
        """With admin keys, RequireKey (gateway/middleware.py) has checked one before the body was read; checked
        here again, on the route, for an app mounted under a root path the middleware's path test would miss."""
        await authorized(request)
        if gateway.admin_keys is not None and not gateway.admin_keys.allows(request.headers.get("authorization")):
            raise ApiError(403, ADMIN_KEY_NEEDED, kind="permission_error")
        if (
            gateway.admin_keys is None
            and gateway.api_keys is None
            and not is_loopback(request.client.host if request.client else None)
        ):
            raise ApiError(403, "adapters are loaded and unloaded from this machine only, unless the gateway has "
                           "--api-key-file or --admin-key-file", kind="permission_error")  # fmt: skip

    v1 = [Depends(authorized)]

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = exposition(gateway.metrics.registry)
        return Response(body, media_type=content_type)

    dashboard = DashboardState(
        gateway.model, model_name=gateway.model_name, topology_period_s=gateway.topology_period_s
    )

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return PAGE

    @app.get("/api/swarm")
    async def swarm() -> dict:
        return await dashboard.document()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": gateway.model_name}

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict:
        base = {"id": gateway.model_name, "object": "model", "created": gateway.created, "owned_by": "nesa-node"}
        adapters = [
            {**base, "id": f"{gateway.model_name}:{name}", "parent": gateway.model_name, "root": name, "source": source}
            for name, source in await gateway.adapters.listed()
        ]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/adapters/load", dependencies=[Depends(may_manage)])
    async def load_adapter(request: LoadAdapter) -> dict:
        try:
            return await gateway.adapters.load(request)
        except PermissionError as exc:
            raise ApiError(403, str(exc), kind="permission_error", param="path") from None
        except AdapterError as exc:
            raise ApiError(400, exc.message, param="path", code=exc.code) from None

    @app.post("/v1/adapters/unload", dependencies=[Depends(may_manage)])
    async def unload_adapter(request: UnloadAdapter) -> dict:
        try:
            return gateway.adapters.unload(request)
        except AdapterMissingError as exc:
            raise ApiError(404, exc.message, param="name", code=exc.code) from None

    async def answer(request: CompletionRequest | ChatRequest, raw: Request, caller: str):
        field = unencodable_field(request)
        if field is not None:  # nothing downstream (tokenizer, JSON answers) takes such a string
            raise ApiError(400, f"`{field}` is not valid Unicode (a lone UTF-16 surrogate such as \\ud800): send "
                           "text that encodes as UTF-8", param=field, code="invalid_unicode")  # fmt: skip
        # running or waiting, until its generation is over; past its share only while slots are free
        held = gateway.callers.admit(caller, contended=gateway.contended)
        streamed = False
        try:
            adapter = await gateway.resolve_model(request.model)
            prepared = await gateway.prepare(request, adapter)
            gateway.check_room()  # a stream refused with a status while it can be
            if request.stream:
                events = gateway.events(request, prepared)
                streamed = True
                return EventStream(events, send_timeout_s=gateway.send_timeout_s, on_close=held.release)
            answered = await gateway.complete_while_connected(request, prepared, raw)
            return Response(status_code=499) if answered is None else answered  # 499: nobody is there to read it
        finally:
            if not streamed:
                held.release()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request, caller: str = Depends(authorized)):
        return await answer(request, raw, caller)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest, raw: Request, caller: str = Depends(authorized)):
        return await answer(request, raw, caller)

    return app


__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Gateway", "create_app"]
