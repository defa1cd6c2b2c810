"""The node daemon's composition root and lifecycle.

`Node.create(config)` builds every component and wires it explicitly, each depending only on those built before it:

  BlockSpan, CacheBudget   the blocks' weights (sharding/blocks.py) and the KV cache budget (eq. 4)
  Peer                     P2P host and DHT node with the record validators (nesa_node/peer.py)
  SessionTable             open sessions, quotas, step ingress (server/sessions.py)
  BlockCompute             the span, the compute thread, input checks (server/compute.py)
  PushSender               outputs to the next node (server/push.py)
  InferenceService         session streams, steps, control, forwards (server/inference.py)
  TrainingService          LoRA training sessions: forward, backward, AdamW on the node's slice (server/training.py)
  LaneServer               data lane connections and tickets (server/lanes.py)
  NodeRpc                  the RPC entries on the P2P host (server/rpc.py)
  LinkProber, Rebalancer   link measurement (server/link_probe.py), when to move (server/rebalance.py)

Once started, the announcer, the link prober and the rebalancer run as tasks of one TaskGroup until shutdown. The
node owns its lifecycle: `drain` (refuse new sessions, let or make the open ones end), `move_to` (serve other blocks),
`shutdown`; the rebalancer only decides when to move.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from pathlib import Path

import psutil

from nesa_node.metrics import NodeMetrics, serve_registry
from nesa_node.peer import (
    SHUTDOWN_STEP_S,
    Peer,
    check_initial_peers,
    check_port_free,
    start_peer,
    write_address_file,
)
from nesa_node.protocol.dht import default_dht_prefix, fetch_node_infos, store_node_info
from nesa_node.protocol.dht_storage import limits_of_mib, set_storage_limits
from nesa_node.protocol.messages import MAX_METADATA_BYTES
from nesa_node.protocol.records import MAX_COUNT, STEP_TOKENS_CAP, STEP_TOKENS_FLOOR, LoadInfo, NodeInfo, NodeState
from nesa_node.server.adapter_fetch import AdapterFetcher
from nesa_node.server.adapters import NodeAdapters
from nesa_node.server.compute import BlockCompute
from nesa_node.server.config import NodeConfig
from nesa_node.server.inference import InferenceService
from nesa_node.server.lanes import LaneServer
from nesa_node.server.link_probe import LinkProber
from nesa_node.server.push import PushSender
from nesa_node.server.rebalance import Rebalancer, load_schema_book, make_trigger
from nesa_node.server.rpc import NodeRpc
from nesa_node.server.sessions import MAX_ADMISSION_WAIT_S, SessionTable
from nesa_node.server.throughput import cached_measure, warm_up, warmup_tokens
from nesa_node.server.training import TrainingService
from nesa_node.sharding.blocks import DTYPES, SpanSpec, load_block_span, load_config
from nesa_node.sharding.kv_cache import CacheBudget, kv_bytes_per_token_for
from nesa_node.verification.receipts import RecordSigner
from nesa_node.version import __version__

logger = logging.getLogger(__name__)
events = logging.getLogger("nesa_node.events")  # what an operator sees at the default log level: moves

END_SESSIONS_S = 5.0  # for sessions to close once ended: their queued steps (guess: a few decode steps)
# /health: how long the event loop may take to run a no-op before the node counts as stuck (guess: steps run on the
# compute thread, so a loop that cannot run a no-op in 5 s is blocked, not busy)
HEALTH_LOOP_TIMEOUT_S = 5.0


def node_metrics(required: bool) -> NodeMetrics | None:
    """The node's metrics when prometheus-client is installed (None otherwise); ValueError naming the extra when
    metrics were asked for (--metrics-port) and it is not."""
    try:
        return NodeMetrics()
    except ImportError:
        if required:
            raise ValueError("--metrics-port needs prometheus-client: pip install 'nesa-node[gateway]'") from None
        return None


def cache_budget(config: NodeConfig, model_config, blocks: int) -> CacheBudget:
    """The KV cache budget of a span of `blocks` blocks (eq. 4 bytes per token depend on the span's length)."""
    element_bytes = DTYPES[config.compute.dtype].itemsize
    bytes_per_token = kv_bytes_per_token_for(model_config, blocks, element_bytes)
    # plus this span's output per token, kept while a next node may need it to rebuild its cache (failover):
    # for a short span with grouped-query attention it can exceed the span's own KV cache
    bytes_per_token += model_config.hidden_size * element_bytes
    return CacheBudget.for_tokens(config.limits.max_cache_tokens, bytes_per_token)


def max_frame_bytes(config: NodeConfig, hidden_size: int) -> int:
    """The longest frame a peer may send: float32 hidden states of the largest step, plus its message and framing."""
    limits = config.limits
    return limits.max_message_bytes or limits.max_tokens_per_step * hidden_size * 4 + MAX_METADATA_BYTES + 1024


def max_step_tokens(config: NodeConfig, hidden_size: int) -> int:
    """Rows x tokens of the largest step the node takes (announced as `NodeInfo.max_step_tokens`): its step limit, or
    fewer where a frame limit set by hand cannot carry that many in float32 (the widest a codec sends). ValueError
    for a frame limit that cannot carry one token."""
    limits = config.limits
    if not limits.max_message_bytes or hidden_size <= 0:
        return limits.max_tokens_per_step
    room = (limits.max_message_bytes - MAX_METADATA_BYTES - 1024) // (hidden_size * 4)
    if room < 1:
        least = MAX_METADATA_BYTES + 1024 + hidden_size * 4
        raise ValueError(
            f"--max-message-bytes {limits.max_message_bytes} cannot carry one token of this model's hidden states "
            f"(at least {least} bytes: give more, or 0 for room for the largest step)"
        )
    return min(limits.max_tokens_per_step, room)


class Node:
    def __init__(self, config: NodeConfig, model_config, peer: Peer, throughput: dict[str, float]):
        self.config = config
        self.model_config = model_config
        self.start_block, self.end_block = config.start_block, config.end_block  # the span served or being loaded
        self.peer = peer
        self.p2p, self.dht = peer.p2p, peer.dht
        self.throughput = throughput
        self.dht_prefix = config.network.dht_prefix or default_dht_prefix(config.model_path)
        self.started_at = time.monotonic()
        self.state = NodeState.joining
        self.prober = LinkProber(peer.p2p)
        self.moves: list[dict] = []  # what this node did: {from, to, reason, drained_s, ended_sessions, seconds}
        self.rebalancer: Rebalancer | None = None
        self.metrics: NodeMetrics | None = None
        self.metrics_url: str | None = None  # where the node serves its metrics, once it does (--metrics-port)
        self._metrics_server = None
        self._process = psutil.Process()
        self._stopped = asyncio.Event()
        self._moving = asyncio.Lock()  # one move at a time (the rebalancer's, or one an operator asked for)
        self._tasks: asyncio.Task | None = None
        # the components, wired by create()
        self.sessions: SessionTable
        self.compute: BlockCompute
        self.adapters: NodeAdapters
        self.inference: InferenceService
        self.training: TrainingService
        self.lanes: LaneServer
        self.rpc: NodeRpc

    @classmethod
    async def create(cls, config: NodeConfig) -> Node:
        """Load the blocks, measure them, start P2P and the DHT, register the RPCs, open the data lane. Announces
        nothing yet (see start). Raises ModelLoadError and its kinds for a bad model folder or span, ValueError for
        settings that cannot work together, InitialPeersError for malformed or silent initial peers, PortInUseError
        for a taken --port or --lane-port, OSError when a port cannot be opened otherwise."""
        network, compute = config.network, config.compute
        if not network.initial_peers and not network.new_swarm:
            raise ValueError("give --initial-peers to join a swarm, or --new-swarm to start one")
        check_initial_peers(network.initial_peers)  # before loading the model: mistakes show at once
        if compute.cuda_graphs and not compute.device.startswith("cuda"):
            raise ValueError(f"--cuda-graphs needs a CUDA device (--device cuda), not {compute.device}")
        check_port_free(network.host, network.port, "--port")
        if network.lane_port:
            check_port_free(network.host, network.lane_port, "--lane-port")
        trigger = None
        if config.rebalance.trigger != "off":
            trigger = make_trigger(config.rebalance.trigger, period_s=config.rebalance.period_s)
        model_config = load_config(config.model_path)
        step_tokens = max_step_tokens(config, model_config.hidden_size)  # a frame limit too small: said at once
        book = load_schema_book(config.rebalance, model_config.num_hidden_layers)
        spec = SpanSpec(
            config.start_block, config.end_block, compute.dtype, compute.device, compute.quant, compute.cuda_graphs
        )
        span = await asyncio.to_thread(load_block_span, config.model_path, spec, config=model_config)
        if compute.measure_throughput:
            cache_path = Path(compute.throughput_cache) if compute.throughput_cache else None
            throughput = await asyncio.to_thread(cached_measure, span, cache_path)
        else:
            throughput = {"forward_tps": 0.0, "inference_tps": 0.0}
        await asyncio.to_thread(warm_up, span, warmup_tokens(compute.warmup_tokens, compute.device))
        adapters = NodeAdapters(
            model_config, compute.adapters, budget_bytes=int(compute.adapter_budget_mb * 2**20), device=compute.device
        )
        await adapters.load_span(config.start_block, config.end_block)
        budget = cache_budget(config, model_config, config.end_block - config.start_block)
        if network.dht_storage_mb is not None:  # the process's peers from now on: a daemon runs one
            set_storage_limits(limits_of_mib(network.dht_storage_mb))
        peer = await start_peer(
            initial_peers=network.initial_peers,
            host=network.host,
            port=network.port,
            identity_path=network.identity_path,
            dht_prefixes=(network.dht_prefix or default_dht_prefix(config.model_path),),
            signs_records=True,
            announce_host=network.announce_host,
        )
        node = cls(config, model_config, peer, throughput)
        node.adapters = adapters

        async def records() -> list:
            return [record.info for record in await fetch_node_infos(peer.dht, node.dht_prefix)]

        frame_bytes = max_frame_bytes(config, model_config.hidden_size)
        fetcher = AdapterFetcher(
            peer.p2p,
            peer.peer_id,
            records,
            model_config,
            deadline_s=network.peer_timeout_s / 2,  # a client waits peer_timeout_s (30 s by default) for its open
            peer_s=network.peer_timeout_s / 6,
            max_frame_bytes=frame_bytes,
        )
        node.metrics = node_metrics(network.metrics_port is not None)
        node.sessions = SessionTable(config.limits, budget, metrics=node.metrics)
        node.sessions.step_tokens = step_tokens
        if node.sessions.step_tokens < STEP_TOKENS_CAP:
            logger.warning(
                "this node takes %d rows x tokens a step (--max-tokens-per-step, --max-message-bytes): clients with "
                "default settings route around it sessions asking more (%d tokens a row, or the session's length, at "
                "most %d in all)",
                node.sessions.step_tokens,
                STEP_TOKENS_FLOOR,
                STEP_TOKENS_CAP,
            )
        adapters.connect(  # an open waits for an idle session holding an adapter as for the KV cache
            fetcher,
            request_timeout_s=network.peer_timeout_s,
            sessions=node.sessions,
            max_wait_s=min(config.limits.preempt_idle_s, MAX_ADMISSION_WAIT_S),
        )
        node.compute = BlockCompute(span, compute, config.limits)
        push = PushSender(
            peer.p2p,
            node.sessions,
            peer_timeout_s=network.peer_timeout_s,
            max_frame_bytes=frame_bytes,
            own_host=network.announce_host or network.host,
        )
        signer = peer.signature_validator._private_key if peer.signature_validator is not None else None
        node.inference = InferenceService(
            node.sessions,
            node.compute,
            push,
            config.limits,
            network,
            adapters=adapters,
            metrics=node.metrics,
            signer=RecordSigner(signer) if signer is not None else None,
        )
        node.training = TrainingService(
            node.compute,
            config.limits,
            network,
            model_config,
            signer=signer,
            p2p=peer.p2p,
            records=records,
        )
        node.lanes = LaneServer(
            node.sessions,
            node.inference.forward,
            network,
            session_timeout_s=config.limits.session_timeout_s,
            max_frame_bytes=frame_bytes,
            injected_delay=node.inference.injected_delay,
            train=node.training.serve_session,
            prover=RecordSigner(signer) if signer is not None else None,
        )
        node.rpc = NodeRpc(
            node.inference,
            node.training,
            node.sessions,
            node.lanes,
            node.current_info,
            max_frame_bytes=frame_bytes,
            metrics=node.metrics,
        )
        try:
            await node.rpc.register(peer.p2p)
            if network.lane_port is not None:
                await node.lanes.start(node._visible_host)
        except BaseException:
            node.compute.close()
            await peer.shutdown()
            raise
        if trigger is not None:
            node.rebalancer = Rebalancer(
                node,
                trigger,
                num_blocks=model_config.num_hidden_layers,
                period_s=config.rebalance.period_s,
                drain_timeout_s=config.rebalance.drain_timeout_s,
                book=book,
            )
        return node

    async def _visible_host(self) -> str:
        """The IPv4 address peers reach this node's P2P host on (for a lane listening on every interface)."""
        if self.config.network.announce_host is not None:
            return self.config.network.announce_host
        addresses = [str(addr) for addr in await self.p2p.get_visible_maddrs() if "/ip4/" in str(addr)]
        return addresses[0].split("/")[2] if addresses else "127.0.0.1"

    # ---- what the node is ----------------------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    @property
    def span(self):
        """The blocks served (None while the node loads others)."""
        return self.compute.span

    @property
    def budget(self) -> CacheBudget:
        return self.sessions.budget

    @property
    def lane_address(self) -> str | None:
        return self.lanes.address

    async def visible_maddrs(self) -> list[str]:
        return await self.peer.visible_maddrs()

    def current_info(self) -> NodeInfo:
        memory = psutil.virtual_memory()
        span = self.compute.span
        return NodeInfo(
            peer_id=self.peer_id,
            state=self.state,
            start_block=self.start_block,
            end_block=self.end_block,
            dtype=self.config.compute.dtype,
            codecs=self.compute.accepted_codecs,
            quantization=self.config.compute.quant,
            weights_hash=span.weights_hash if span is not None else "",
            source_hash=span.source_hash if span is not None else "",
            ram_total_mb=memory.total / 2**20,
            ram_free_mb=memory.available / 2**20,
            load=LoadInfo(
                cpu_percent=min(self._process.cpu_percent(None), 100.0 * 1024),
                queue=self.sessions.queued_steps(),
                sessions=len(self.sessions),
            ),
            forward_tps=float(self.throughput["forward_tps"]),
            inference_tps=float(self.throughput["inference_tps"]),
            block_ms=float(self.throughput.get("block_ms", 0.0)),
            cache_tokens_left=self.sessions.tokens_available(),
            uptime_s=time.monotonic() - self.started_at,
            version=__version__,
            max_length=min(self.config.limits.max_length, MAX_COUNT),  # a record's ceiling: beyond, "unlimited"
            max_step_tokens=min(self.sessions.step_tokens, MAX_COUNT),
            links=tuple(self.prober.links.values()),
            lane=self.lanes.address,
            adapters=self.adapters.announced(),
        )

    # ---- announcing ----------------------------------------------------------------------------------------------

    async def announce(self) -> bool:
        ok = await store_node_info(
            self.dht, self.dht_prefix, self.current_info(), self.peer.signature_validator, self.config.record_ttl_s
        )
        if not ok:
            logger.debug("no DHT peer stored the announcement")
        return ok

    async def announce_now(self, timeout_s: float | None = None) -> None:
        """Store the record at once (a state change); a failure is left to the announce loop's next round."""
        try:
            await asyncio.wait_for(self.announce(), timeout=timeout_s or self.config.network.peer_timeout_s)
        except Exception as exc:
            logger.debug("announcement failed: %r", exc)

    async def _until_stopped(self, seconds: float) -> bool:
        """Wait `seconds` or until the node stops; whether it stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), timeout=seconds)
        return self._stopped.is_set()

    async def _announce_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                await asyncio.wait_for(self.announce(), timeout=self.config.network.peer_timeout_s)
            except Exception as exc:
                logger.warning("announce failed: %r", exc)
            await self._until_stopped(self.config.network.announce_period_s)

    async def _contact_loop(self) -> None:
        """Dial the initial peers every announce period: a bootstrap peer restarted after being down learns this
        node again (Peer.contact_initial_peers). Its own task: an unreachable peer's dial never delays announcing."""
        while not await self._until_stopped(self.config.network.announce_period_s):
            await self.peer.contact_initial_peers()

    async def _probe_loop(self) -> None:
        """Measure links every link_probe_period_s, the first time one announce period after going online (once
        the neighbours' records are likely out); the next announcement carries them."""
        delay = self.config.network.announce_period_s
        while not await self._until_stopped(delay):
            try:
                records = await asyncio.wait_for(
                    fetch_node_infos(self.dht, self.dht_prefix), self.config.network.peer_timeout_s
                )
                await self.prober.probe(self.current_info(), [record.info for record in records])
            except Exception as exc:
                logger.debug("link measurement failed: %r", exc)
            delay = self.config.network.link_probe_period_s

    # ---- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Go online: announce now, then run the announcer, link prober and rebalancer; write the address file."""
        self.state = NodeState.online
        await self.announce()
        self._tasks = asyncio.create_task(self._run_tasks(), name=f"node-{self.peer_id[-6:]}")
        if self.metrics is not None and self.config.network.metrics_port is not None:
            self._metrics_server = self._serve_metrics()
        if self.config.network.address_file:
            await asyncio.to_thread(write_address_file, self.config.network.address_file, await self.visible_maddrs())

    def _serve_metrics(self):
        """Serve the node's metrics and /health over HTTP (a thread of their own); the gauges read this node."""
        self.metrics.bind(
            sessions=lambda: len(self.sessions),
            cache_used=lambda: self.budget.used_bytes,
            cache_free=lambda: self.budget.free_bytes,
            queued=self.sessions.queued_steps,
            dht_peers=lambda: len(self.dht.protocol.routing_table.uid_to_peer_id),
            adapters=self.adapters,
            compute=self.compute,
        )
        network = self.config.network
        loop = asyncio.get_running_loop()
        server, _, port = serve_registry(
            self.metrics.registry, network.host, network.metrics_port, health=lambda: self.health(loop)
        )
        self.metrics_url = f"http://{network.host}:{port}/metrics"
        logger.info("metrics on %s, health on /health", self.metrics_url)
        return server

    def health(self, loop: asyncio.AbstractEventLoop, timeout_s: float = HEALTH_LOOP_TIMEOUT_S) -> tuple[bool, dict]:
        """What /health answers, (healthy, body); called from another thread than `loop`, the node's event loop.
        Healthy while the loop runs a no-op within `timeout_s` and the node is not offline: online, or joining or
        draining during a move, is a working node; a stuck loop serves no step and answers no RPC."""
        body = {
            "state": self.state.value,
            "peer_id": self.peer_id,
            "start_block": self.start_block,
            "end_block": self.end_block,
        }
        answered = threading.Event()
        try:
            loop.call_soon_threadsafe(answered.set)
            responsive = answered.wait(timeout_s)
        except RuntimeError:  # the loop is closed
            responsive = False
        healthy = responsive and self.state != NodeState.offline
        body["event_loop"] = "responsive" if responsive else f"no answer within {timeout_s:g} s"
        return healthy, {"status": "ok" if healthy else "unavailable", **body}

    async def _run_tasks(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._announce_loop())
            tasks.create_task(self._contact_loop())
            tasks.create_task(self._probe_loop())
            if self.rebalancer is not None:
                tasks.create_task(self.rebalancer.run(self._stopped))

    async def drain(self, *, finish_s: float, end_s: float, announce: bool = True) -> int:
        """Announce draining (unless `announce` is false) and refuse new sessions; give the open ones up to
        `finish_s` to end on their own, then end the rest after the steps already in their queues (their clients fail
        over) and wait up to `end_s` for them to close. Returns how many were ended."""
        self.sessions.draining = True
        self.training.draining = True
        self.training.end_all("the node is draining")  # clients reopen their chain elsewhere at their checkpoint
        self.state = NodeState.draining
        if announce:
            await self.announce_now(SHUTDOWN_STEP_S if self._stopped.is_set() else None)
        if self.sessions.sessions and finish_s > 0:
            await self.sessions.wait_idle(finish_s)
        ended = len(self.sessions)
        if ended:
            self.sessions.end_all()
            await self.sessions.wait_idle(end_s)
        return ended

    async def move_to(self, start: int, *, reason: str = "operator", drain_timeout_s: float | None = None) -> None:
        """Serve blocks [start, start + span length) instead: drain (a hole move ends its sessions at once: while a
        block has no server no chain through it can go on), release the old span, announce joining with the new one,
        load it with a cache budget sized for it, announce online. If loading fails, the old span is loaded again.
        Raises ValueError for a span outside the model."""
        length = self.end_block - self.start_block
        num_blocks = self.model_config.num_hidden_layers
        if not 0 <= start <= num_blocks - length:
            raise ValueError(f"a span of {length} blocks cannot start at block {start} of {num_blocks}")
        drain_s = self.config.rebalance.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        async with self._moving:
            if start == self.start_block or self._stopped.is_set():  # a stopping node moves nowhere
                return
            began = time.monotonic()
            old = (self.start_block, self.end_block)
            events.info("moving from blocks %d:%d to %d:%d (%s)", *old, start, start + length, reason)
            ended = await self.drain(finish_s=0.0 if reason == "hole" else drain_s, end_s=END_SESSIONS_S)
            drained_s = time.monotonic() - began
            self.sessions.drop_all()  # any still open (a step stuck in compute) lose their cache now
            self._release_span()
            self.start_block, self.end_block = start, start + length
            self.state = NodeState.joining
            await self.announce_now()
            try:
                await self._load_span(start, start + length)
            except Exception as exc:
                logger.error("loading blocks %d:%d failed (%r); reloading %d:%d", start, start + length, exc, *old)
                self.start_block, self.end_block = old
                await self._load_span(*old)
            self.sessions.draining = False
            self.training.draining = False
            seconds = time.monotonic() - began
            self.moves.append(
                {"from": old, "to": (self.start_block, self.end_block), "reason": reason, "drained_s": drained_s}
                | {"ended_sessions": ended, "seconds": seconds}
            )
            self.state = NodeState.online
            await self.announce_now()
            events.info("now serving blocks %d:%d (move took %.1f s)", self.start_block, self.end_block, seconds)

    @property
    def moving(self) -> bool:
        return self._moving.locked()

    def _release_span(self) -> None:
        """Drop the blocks' weights (no session may be open); requests naming blocks are refused until loaded."""
        self.compute.use_span(None)
        gc.collect()  # the layers may sit in reference cycles (nn.Module); free them before loading others
        if self.config.compute.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    async def _load_span(self, start: int, end: int) -> None:
        compute = self.config.compute
        spec = SpanSpec(start, end, compute.dtype, compute.device, compute.quant, compute.cuda_graphs)
        span = await asyncio.to_thread(load_block_span, self.config.model_path, spec, config=self.model_config)
        await asyncio.to_thread(warm_up, span, warmup_tokens(compute.warmup_tokens, compute.device))
        await self.adapters.load_span(start, end)
        self.sessions.use_budget(cache_budget(self.config, self.model_config, end - start))
        self.compute.use_span(span)

    async def shutdown(self, *, drain_s: float = 5.0) -> None:
        """Drain, then stop: announce `draining` and refuse new sessions, end every session after the steps already
        queued (clients re-route) and wait up to `drain_s` for them to close, announce `offline`, stop the DHT and
        P2P. Each step on the network gets SHUTDOWN_STEP_S: announcements are a courtesy (records expire anyway),
        and DHT peers that are gone too must not hold a stopping node (about drain_s + 12 s at most: the tasks, three
        announcements, the DHT and P2P). An online node refuses new sessions and announces first of all, before its
        background tasks wind down: `offline` when no session is open (nothing to drain: clients and every planner,
        the schema book's classifier included, stop counting it at once), else `draining` (clients route around it;
        rebalancing counts a draining node at its span, as it does a mover's, until it is offline)."""
        self._stopped.set()
        left_at_once = False
        if self.state == NodeState.online:
            self.sessions.draining = self.training.draining = True
            left_at_once = not self.sessions.sessions and not self.training.sessions
            self.state = NodeState.offline if left_at_once else NodeState.draining
            await self.announce_now(SHUTDOWN_STEP_S)
        if self._tasks is not None:  # a move cut short leaves the node draining: it stops anyway
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._tasks), timeout=SHUTDOWN_STEP_S)
            self._tasks.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._tasks
        # a node that left at once announces no draining after it (a move that ended meanwhile put it online again)
        await self.drain(finish_s=0.0, end_s=drain_s, announce=not (left_at_once and self.state == NodeState.offline))
        self.compute.close()
        self.lanes.close()
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.shutdown)
            self._metrics_server.server_close()
            self._metrics_server = None
        self.state = NodeState.offline
        await self.announce_now(SHUTDOWN_STEP_S)
        await self.peer.shutdown(SHUTDOWN_STEP_S)


__all__ = ["Node", "cache_budget", "max_frame_bytes"]
