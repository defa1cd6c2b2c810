"""The node daemon's composition root: `Node.create(config)` wires every component explicitly.

Components: the BlockSpan (weights of this node's blocks), the KV cache budget, a hivemind P2P host (one p2pd
process shared by the DHT and the block handlers), a DHTNode whose records are signed with the node's identity
key, the BlockHandler serving RPCs, the announcer that refreshes the node's NodeInfo record, and the Rebalancer
that moves the node to other blocks when the swarm needs it (server/rebalance.py; none with rebalance "off").
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from pathlib import Path

import psutil

from nesa_node.peer import SHUTDOWN_STEP_S, Peer, start_peer, write_address_file
from nesa_node.protocol.dht import default_dht_prefix, fetch_node_infos, store_node_info
from nesa_node.protocol.lane import format_address
from nesa_node.protocol.records import LoadInfo, NodeInfo, NodeState
from nesa_node.server.config import NodeConfig
from nesa_node.server.handler import BlockHandler
from nesa_node.server.link_probe import LinkProber
from nesa_node.server.rebalance import Rebalancer, make_trigger
from nesa_node.server.throughput import cached_measure
from nesa_node.sharding.blocks import DTYPES, SpanSpec, load_block_span, load_config
from nesa_node.sharding.kv_cache import CacheBudget, kv_bytes_per_token_for
from nesa_node.version import __version__

logger = logging.getLogger(__name__)


def cache_budget(config: NodeConfig, model_config, blocks: int) -> CacheBudget:
    """The KV cache budget of a span of `blocks` blocks (eq. 4 bytes per token depend on the span's length)."""
    element_bytes = DTYPES[config.dtype].itemsize
    bytes_per_token = kv_bytes_per_token_for(model_config, blocks, element_bytes)
    # plus this span's output per token, kept while a next node may need it to rebuild its cache (failover):
    # for a short span with grouped-query attention it can exceed the span's own KV cache
    bytes_per_token += model_config.hidden_size * element_bytes
    return CacheBudget.for_tokens(config.max_cache_tokens, bytes_per_token)


class Node:
    def __init__(self, config, span, budget, peer: Peer, handler, throughput):
        self.config = config
        self.span = span  # None while the node loads other blocks (rebalancing)
        self.start_block, self.end_block = config.start_block, config.end_block  # the span served or being loaded
        self.budget = budget
        self.peer = peer
        self.p2p, self.dht = peer.p2p, peer.dht
        self.handler = handler
        self.signature_validator = peer.signature_validator
        self.throughput = throughput
        self.dht_prefix = config.dht_prefix or default_dht_prefix(config.model_path)
        self.started_at = time.monotonic()
        self.state = NodeState.joining
        self._stopped = asyncio.Event()
        self._announcer: asyncio.Task | None = None
        self._prober_task: asyncio.Task | None = None
        self.prober = LinkProber(peer.p2p)
        self._process = psutil.Process()
        self.rebalancer: Rebalancer | None = None
        self._rebalancer_task: asyncio.Task | None = None
        self._lane_server: asyncio.Server | None = None
        self.lane_address: str | None = None

    @classmethod
    async def create(cls, config: NodeConfig) -> Node:
        """Load the blocks, measure them, start P2P and the DHT, register the handlers. Announces nothing yet."""
        model_config = load_config(config.model_path)
        span = await asyncio.to_thread(
            load_block_span,
            config.model_path,
            SpanSpec(config.start_block, config.end_block, config.dtype, config.device, config.quant),
            config=model_config,
        )
        if config.measure_throughput:
            cache_path = Path(config.throughput_cache) if config.throughput_cache else None
            throughput = await asyncio.to_thread(cached_measure, span, cache_path)
        else:
            throughput = {"forward_tps": 0.0, "inference_tps": 0.0}
        budget = cache_budget(config, model_config, config.end_block - config.start_block)

        if not config.initial_peers and not config.new_swarm:
            raise ValueError("give --initial-peers to join a swarm, or --new-swarm to start one")
        dht_prefix = config.dht_prefix or default_dht_prefix(config.model_path)
        peer = await start_peer(
            initial_peers=config.initial_peers,
            host=config.host,
            port=config.port,
            identity_path=config.identity_path,
            dht_prefixes=(dht_prefix,),
            signs_records=True,
        )
        try:
            node = cls(config, span, budget, peer, None, throughput)
            node.handler = BlockHandler(span, config, budget, node.current_info, peer.p2p)
            await node.handler.add_p2p_handlers(peer.p2p)
            if config.lane_port is not None:
                await node._start_lane()
            if config.rebalance != "off":
                node.rebalancer = Rebalancer(
                    node,
                    make_trigger(config.rebalance, period_s=config.rebalance_period_s),
                    num_blocks=model_config.num_hidden_layers,
                    period_s=config.rebalance_period_s,
                    drain_timeout_s=config.drain_timeout_s,
                )
        except BaseException:
            await peer.shutdown()
            raise
        return node

    async def _start_lane(self) -> None:
        """Listen for data lanes on the node's host; the record announces the address."""
        self._lane_server = await asyncio.start_server(self.handler.serve_lane, self.config.host, self.config.lane_port)
        port = self._lane_server.sockets[0].getsockname()[1]
        host = self.config.host
        if host in ("0.0.0.0", "::"):  # listening everywhere: announce the address peers reach the node's p2p on
            host = next(
                (str(addr).split("/")[2] for addr in await self.p2p.get_visible_maddrs() if "/ip4/" in str(addr)),
                "127.0.0.1",
            )
        self.lane_address = self.handler.lane_address = format_address(host, port)
        logger.info("data lane on %s", self.lane_address)

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def visible_maddrs(self) -> list[str]:
        return [str(addr) for addr in await self.p2p.get_visible_maddrs()]

    def current_info(self) -> NodeInfo:
        memory = psutil.virtual_memory()
        return NodeInfo(
            peer_id=self.peer_id,
            state=self.state,
            start_block=self.start_block,
            end_block=self.end_block,
            dtype=self.config.dtype,
            compression=self.handler.accepted_codecs,
            quantization=self.config.quant,
            weights_hash=self.span.weights_hash if self.span is not None else "",
            ram_total_mb=memory.total / 2**20,
            ram_free_mb=memory.available / 2**20,
            load=LoadInfo(
                cpu_percent=min(self._process.cpu_percent(None), 100.0 * 1024),
                queue=sum(session.inbox.qsize() for session in self.handler.sessions.values()),
                sessions=len(self.handler.sessions),
            ),
            forward_tps=float(self.throughput["forward_tps"]),
            inference_tps=float(self.throughput["inference_tps"]),
            cache_tokens_left=self.budget.tokens_left,
            uptime_s=time.monotonic() - self.started_at,
            version=__version__,
            max_length=self.config.max_length,
            links=tuple(self.prober.links.values()),
            lane=self.lane_address,
        )

    def release_span(self) -> None:
        """Drop the blocks' weights (no session may be open); requests naming blocks are refused until load_span."""
        self.span = None
        self.handler.use_span(None, self.budget)
        gc.collect()  # the layers may sit in reference cycles (nn.Module); free them before loading others
        if self.config.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    async def load_span(self, start: int, end: int) -> None:
        """Load blocks [start, end) and serve them with a cache budget sized for them."""
        spec = SpanSpec(start, end, self.config.dtype, self.config.device, self.config.quant)
        span = await asyncio.to_thread(load_block_span, self.config.model_path, spec)
        self.span, self.budget = span, cache_budget(self.config, span.config, end - start)
        self.handler.use_span(span, self.budget)

    async def announce(self) -> bool:
        ok = await store_node_info(
            self.dht, self.dht_prefix, self.current_info(), self.signature_validator, self.config.record_ttl_s
        )
        if not ok:
            logger.debug("no DHT peer stored the announcement")
        return ok

    async def _announce_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                await asyncio.wait_for(self.announce(), timeout=self.config.peer_timeout_s)
            except Exception as exc:
                logger.warning("announce failed: %r", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), timeout=self.config.announce_period_s)

    async def _probe_loop(self) -> None:
        """Measure links every link_probe_period_s, the first time one announce period after going online (once
        the neighbours' records are likely out); the next announcement carries them."""
        delay = self.config.announce_period_s
        while not self._stopped.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), timeout=delay)
                return
            try:
                records = await asyncio.wait_for(
                    fetch_node_infos(self.dht, self.dht_prefix), self.config.peer_timeout_s
                )
                await self.prober.probe(self.current_info(), [record.info for record in records])
            except Exception as exc:
                logger.debug("link measurement failed: %r", exc)
            delay = self.config.link_probe_period_s

    async def start(self) -> None:
        """Go online: announce now and every announce period; measure links; write the address file."""
        self.state = NodeState.online
        await self.announce()
        self._announcer = asyncio.create_task(self._announce_loop())
        self._prober_task = asyncio.create_task(self._probe_loop())
        if self.rebalancer is not None:
            self._rebalancer_task = asyncio.create_task(self.rebalancer.run())
        if self.config.address_file:
            await asyncio.to_thread(write_address_file, self.config.address_file, await self.visible_maddrs())

    async def run(self) -> None:
        await self.start()
        await self._stopped.wait()

    def request_stop(self) -> None:
        self._stopped.set()

    async def shutdown(self, *, drain_s: float = 5.0) -> None:
        """Drain, then stop: announce `draining` and refuse new sessions, let the steps already queued finish and
        end every session (clients re-route), wait up to `drain_s` for them to close, announce `offline`, stop the
        DHT and P2P. Each step on the network gets SHUTDOWN_STEP_S: announcements are a courtesy (records expire
        anyway), and DHT peers that are gone too must not hold a stopping node (about drain_s + 8 s at most)."""
        self._stopped.set()
        if self.rebalancer is not None:
            await self.rebalancer.shutdown()
        if self._rebalancer_task is not None:  # a move cut short leaves the node draining: it stops anyway
            self._rebalancer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._rebalancer_task
        if self._prober_task is not None:
            self._prober_task.cancel()
        if self._announcer is not None:
            self._announcer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._announcer
        if self.handler is not None:
            self.state = NodeState.draining
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.announce(), timeout=SHUTDOWN_STEP_S)
            await self.handler.shutdown()  # refuses new sessions; ends each after the steps already in its queue
            if self.handler.sessions:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.handler.idle.wait(), timeout=drain_s)
            self.handler.close()
        if self._lane_server is not None:
            self._lane_server.close()
        self.state = NodeState.offline
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.announce(), timeout=SHUTDOWN_STEP_S)
        await self.peer.shutdown(SHUTDOWN_STEP_S)
