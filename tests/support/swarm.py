"""Real local swarms for tests: hivemind DHT peers and node daemons on 127.0.0.1, always shut down.

Nodes run in this process on one background event loop (each with its own p2pd and DHT node, exactly what
`nesa-node run` builds through `Node.create`); tests that need separate processes use nesa_node.devtools.launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from nesa_node.bootstrap import BootstrapPeer
from nesa_node.client.model import LoopThread
from nesa_node.client.swarm import Swarm
from nesa_node.errors import NoRouteError
from nesa_node.server.config import NodeConfig
from nesa_node.server.node import Node


class LocalSwarm:
    """A bootstrap peer plus nodes started on demand; `close` stops everything it started."""

    def __init__(self, dht_prefixes: tuple[str, ...] = ()) -> None:
        self.runner = LoopThread("test-swarm-loop", loop_factory=asyncio.new_event_loop)
        self.loop = self.runner.loop
        self.nodes: list[Node] = []
        self.bootstrap = self.run(BootstrapPeer.create(dht_prefixes=dht_prefixes))  # model keys it validates
        self.initial_peers = self.run(self.bootstrap.visible_maddrs())

    def run(self, coroutine, timeout: float = 120.0):
        return self.runner.call(coroutine, timeout=timeout)

    def peers_with(self, *nodes: Node) -> list[str]:
        """The initial peers plus `nodes`' own addresses: a raw libp2p peer given these dials the nodes directly
        instead of waiting until its daemon's routing table has learnt them."""
        return list(self.initial_peers) + [address for node in nodes for address in self.run(node.visible_maddrs())]

    def start_node(self, model_path: str, start: int, end: int, **settings) -> Node:
        config = NodeConfig(model_path=model_path, start_block=start, end_block=end).with_settings(
            initial_peers=tuple(self.initial_peers),
            measure_throughput=False,
            announce_period_s=2.0,
            # in-process nodes move only in the tests about moving (test_rebalance.py asks for it): the other tests
            # build exact layouts (spares, holes, one node per span) that a move would change under them
            trigger="off",
        )
        config = config.with_settings(**settings)
        node = self.run(Node.create(config))
        self.run(node.start())
        self.nodes.append(node)
        return node

    def stop_node(self, node: Node) -> None:
        self.run(node.shutdown())
        self.nodes.remove(node)

    def close(self) -> None:
        try:
            for node in list(self.nodes):
                try:
                    self.run(node.shutdown(), timeout=60)
                except Exception:
                    pass
            self.nodes.clear()
            self.run(self.bootstrap.shutdown(), timeout=60)
        finally:
            self.runner.stop()


def wait_for_chain(model, *, max_length: int = 0, hops: int | None = None, timeout_s: float = 60.0):
    """Wait until the client sees a chain (of `hops` nodes, if given) covering every block."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            chain = model.choose_chain(max_length=max_length)
            if hops is None or len(chain.hops) == hops:
                return chain
        except NoRouteError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"expected a chain of {hops} hops, got {chain}")
        time.sleep(0.3)


@dataclass
class HeldUp:
    steps: int = 0  # steps the node was asked to compute since the hold was set


@contextlib.contextmanager
def step_held_up(node: Node, *, at: int, seconds: float):
    """`node` (in this process) holds the `at`-th step it is asked to compute from now on for `seconds` before it
    computes it, as a busy machine would; yields a HeldUp counting the steps asked."""
    original, held = node.inference._compute_step, HeldUp()

    async def held_up(session, request, step, pushed):
        held.steps += 1
        if held.steps == at:
            await asyncio.sleep(seconds)
        return await original(session, request, step, pushed)

    node.inference._compute_step = held_up
    try:
        yield held
    finally:
        del node.inference._compute_step


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    """Poll `predicate` until true; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


class SyncSwarm:
    """A client Swarm (nesa_node.client.swarm) on a loop thread of its own, for tests that read synchronously."""

    def __init__(self, initial_peers: list[str], *, dht_prefix: str) -> None:
        self.runner = LoopThread("test-client-loop")
        try:
            self.swarm = self.runner.call(Swarm.create(list(initial_peers), dht_prefix=dht_prefix), timeout=60)
        except BaseException:
            self.runner.stop()
            raise

    @property
    def dht(self):
        return self.swarm.dht

    def call(self, coroutine, timeout: float | None = 60.0):
        return self.runner.call(coroutine, timeout=timeout)

    def node_records(self, fresh: bool = False):
        return self.call(self.swarm.node_records(fresh))

    def close(self) -> None:
        try:
            self.call(self.swarm.close(), timeout=30)
        finally:
            self.runner.stop()

    def __enter__(self) -> SyncSwarm:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def client_seeing(swarm: LocalSwarm, model_path: str, nodes, *, dht_prefix: str, **options):
    """A DistributedModelForCausalLM of `model_path` on `swarm` (`options`: from_pretrained's), returned once the
    records of every node of `nodes` are among those it reads."""
    from nesa_node import DistributedModelForCausalLM

    model = DistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, dht_prefix=dht_prefix, **options
    )
    wanted = {node.peer_id for node in nodes}
    try:
        wait_until(lambda: wanted <= {r.info.peer_id for r in model.call(model.swarm.node_records(fresh=True))}, 30)
    except BaseException:
        model.close()
        raise
    return model
