"""A seeded simulator of a heterogeneous internet swarm, and the true latency of a chain for a request.

The truth (`Simulator`): nodes scattered around cities (scenarios.py); one-way latency between two places is the
great-circle distance at 2/3 of light speed in fibre, times a route inflation, plus each end's last mile, times a
per-request jitter; a link carries min(bandwidth) of its ends. GPU classes give each node its span (the blocks that
fit in 85% of its memory, placed where the swarm is thinnest, as petals nodes do) and its compute time per block:
decode reads the block's weights once (memory-bandwidth bound), prefill is compute bound. Each node's background
load follows a daily cycle plus a mean-reverting (Ornstein-Uhlenbeck) noise, and slows its compute by 1 / (1 - load)
(M/M/1). With churn, nodes leave and come back; a request whose chain holds a node that is gone, or leaves before
the request ends, pays a failover (detection plus a replay of the session's tokens through that hop).

The router's view (`Simulator.snapshot`): what the nodes announced at the last announce tick, with measurement
noise: throughput measured once at start, load as of the tick, last mile and bandwidth measured with error, region
latencies between city centres measured with error, reliability from past uptime. Records outlive a node that
left by up to the record ttl, so routers can pick nodes that are gone.

Events (scenarios.py): regional outages take every node of some cities offline for a while, cluster joins bring
extra nodes around a new city online at a given time, link degradations multiply the backbone latency between two
cities. `snapshot(..., starts=...)` shows the swarm with moved spans and `snapshot(..., remeasure_seed=...)` a
repeated, independently jittered measurement of it (topology/ calibrates its change detection on those).

Times in ms inside, request latencies in seconds outside.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nesa_node.errors import NoRouteError
from nesa_node.routing.cost import bytes_per_element
from nesa_node.routing.scenarios import GPUS, Scenario
from nesa_node.routing.snapshot import Chain, ChainRequest, NodeView, SwarmSnapshot

FIBRE_KM_PER_MS = 200.0  # light in fibre, 2/3 c
ROUTE_INFLATION = 1.5  # internet paths are ~1.5-2x the great-circle distance (published measurements)
WEIGHT_SHARE = 0.85  # share of GPU memory a node gives to weights; the rest holds KV cache (guess)
KV_BYTES_PER_TOKEN_BLOCK = 4096  # 2 * 8 kv heads * 128 head_dim * 2 bytes: Llama-70B and Mixtral (GQA)
LAUNCH_MS_PER_BLOCK = 0.1  # kernel launches and framework overhead per block per pass (guess)
PREFILL_EFFICIENCY = 0.5  # share of peak TFLOP/s prefill reaches (guess)
FAILOVER_DETECT_MS = 2000.0  # a silent node is noticed at the step deadline (guess)
LOAD_CAP = 0.95  # a node never gets busier than this (keeps 1 / (1 - load) finite)
LOAD_STEP_S = 30.0  # resolution of the simulated load
CODEC = "blockwise8"  # the client's default codec


@dataclass(frozen=True)
class SimRequest:
    index: int
    time_s: float
    client_lat: float
    client_lon: float
    client_region: int
    client_access_ms: float
    client_bandwidth_mbps: float
    prompt_tokens: int
    new_tokens: int
    seed: int  # draws this request's jitter


Router = Callable[[SwarmSnapshot, ChainRequest, np.random.Generator], Chain]


def great_circle_km(lat1, lon1, lat2, lon2):
    lat1, lon1, lat2, lon2 = map(np.radians, (lat1, lon1, lat2, lon2))
    inner = np.sin((lat2 - lat1) / 2) ** 2 + np.cos(lat1) * np.cos(lat2) * np.sin((lon2 - lon1) / 2) ** 2
    return 2 * 6371.0 * np.arcsin(np.sqrt(np.clip(inner, 0.0, 1.0)))


def _scatter(rng: np.random.Generator, lat: np.ndarray, lon: np.ndarray, km: float) -> tuple[np.ndarray, np.ndarray]:
    north, east = rng.normal(0.0, km, lat.size), rng.normal(0.0, km, lat.size)
    lat = np.clip(lat + north / 111.0, -89.0, 89.0)
    return lat, lon + east / (111.0 * np.cos(np.radians(lat)))


def place_spans(rng: np.random.Generator, blocks: np.ndarray, tps: np.ndarray, num_blocks: int) -> np.ndarray:
    """Start block of each node: in turn, each takes the span whose weakest block has the least throughput so far
    (petals' block selection), ties broken at random."""
    coverage = np.zeros(num_blocks)
    start = np.zeros(blocks.size, np.int64)
    for node in range(blocks.size):
        length = int(blocks[node])
        weakest = np.lib.stride_tricks.sliding_window_view(coverage, length).min(axis=1)
        candidates = np.flatnonzero(weakest == weakest.min())
        start[node] = candidates[rng.integers(candidates.size)]
        coverage[start[node] : start[node] + length] += tps[node]
    return start


class Simulator:
    """One seeded swarm. Immutable after construction except for a memo of snapshots per announce tick."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        rng = np.random.default_rng(scenario.seed)
        model = scenario.model
        # nodes of cluster joins come after the scenario's own nodes, around their own cities (no joins: unchanged)
        count = scenario.num_nodes + sum(join.nodes for join in scenario.joins)
        cities = scenario.cities + tuple(join.city for join in scenario.joins)
        self.num_nodes = count
        names = [name for name, _ in scenario.gpu_mix]
        shares = np.array([share for _, share in scenario.gpu_mix])
        gpu = rng.choice(len(names), size=count, p=shares / shares.sum())
        classes = [GPUS[name] for name in names]
        self.datacentre = np.array([classes[index].datacentre for index in gpu])
        self.city = rng.integers(0, len(scenario.cities), count)
        self.join_at = np.zeros(count)
        first = scenario.num_nodes
        for offset, join in enumerate(scenario.joins):
            self.city[first : first + join.nodes] = len(scenario.cities) + offset
            self.join_at[first : first + join.nodes] = join.at_s
            first += join.nodes
        city_lat, city_lon = np.array([c.lat for c in cities]), np.array([c.lon for c in cities])
        self.lat, self.lon = _scatter(rng, city_lat[self.city], city_lon[self.city], scenario.city_spread_km)
        # last mile (one-way ms) and access bandwidth (Mbit/s): data centres vs homes (guesses from public surveys)
        self.access_ms = np.where(
            self.datacentre, rng.lognormal(np.log(0.5), 0.5, count), rng.lognormal(np.log(6), 0.6, count)
        )
        self.bandwidth_mbps = np.where(
            self.datacentre, rng.lognormal(np.log(2000), 0.5, count), rng.lognormal(np.log(80), 0.8, count)
        )
        memory = np.array([classes[index].memory_gb for index in gpu])
        bandwidth_gbs = np.array([classes[index].memory_bandwidth_gbs for index in gpu])
        tflops = np.array([classes[index].tflops for index in gpu])
        self.decode_ms = model.active_gb / bandwidth_gbs * 1000 + LAUNCH_MS_PER_BLOCK  # per block, one token
        self.prefill_ms_per_token = model.active_gb * 2 / (tflops * PREFILL_EFFICIENCY)  # 2 flops/param, ms
        blocks = np.clip(np.floor(WEIGHT_SHARE * memory / model.block_gb).astype(int), 1, model.num_blocks)
        self.start = place_spans(rng, blocks, 1000.0 / (self.decode_ms * blocks), model.num_blocks)
        self.end = self.start + blocks
        free_bytes = np.maximum(memory * 1e9 - blocks * model.block_gb * 1e9, 0.0)
        self.cache_tokens = (free_bytes / (KV_BYTES_PER_TOKEN_BLOCK * blocks)).astype(np.int64)
        self._build_load(rng)
        self._build_churn(rng)
        # what the router sees of the fixed properties: measured once, with error (guesses)
        self.seen_access_ms = self.access_ms * rng.lognormal(0.0, 0.3, count)
        self.seen_bandwidth_mbps = self.bandwidth_mbps * rng.lognormal(0.0, 0.3, count)
        self.seen_tps = 1000.0 / (self.decode_ms * blocks) * rng.lognormal(0.0, 0.15, count)
        centre = great_circle_km(city_lat[:, None], city_lon[:, None], city_lat[None], city_lon[None])
        measured = centre / FIBRE_KM_PER_MS * ROUTE_INFLATION * rng.lognormal(0.0, 0.1, centre.shape)
        self.region_latency_ms = tuple(tuple(float(x) for x in row) for row in (measured + measured.T) / 2)
        self.peer_ids = tuple(f"node{index:06d}" for index in range(count))
        self._snapshots: dict[int, SwarmSnapshot] = {}

    def _build_load(self, rng: np.random.Generator) -> None:
        s, count = self.scenario, self.num_nodes
        steps = int(math.ceil(s.duration_s / LOAD_STEP_S)) + 2
        base = np.clip(rng.beta(2.0, 2.0 * (1 - s.load_mean) / s.load_mean, count), 0.0, LOAD_CAP)
        decay = math.exp(-LOAD_STEP_S / s.load_correlation_s)
        noise = np.empty((steps, count))
        noise[0] = rng.normal(0.0, s.load_noise, count)
        shocks = rng.normal(0.0, s.load_noise * math.sqrt(1 - decay**2), (steps, count))
        for step in range(1, steps):
            noise[step] = decay * noise[step - 1] + shocks[step]
        hours = np.arange(steps)[:, None] * LOAD_STEP_S / 3600.0
        daily = s.load_swing * np.sin(2 * np.pi * (hours / 24.0 + self.lon[None] / 360.0))
        self.load = np.clip(base[None] + daily + noise, 0.0, LOAD_CAP)  # (steps, nodes)
        self.load_seen_noise = rng.normal(0.0, 0.05, (steps, count))  # the announced figure's error (guess)

    def _build_churn(self, rng: np.random.Generator) -> None:
        """Times each node leaves or comes back (alternating from its initial state); data-centre nodes stay 4x
        longer than home ones. The announced reliability is the node's availability, estimated with error."""
        s, count = self.scenario, self.num_nodes
        self.session_s = np.full(count, np.inf)
        self.toggles = np.full((count, 1), np.inf)
        self.initially_online = np.ones(count, bool)
        if s.churn_per_hour <= 0:
            self.reliability = np.where(self.datacentre, 0.99, 0.95)
            return
        share_dc = self.datacentre.mean()
        home_session = 3600.0 / s.churn_per_hour * (share_dc / 4 + (1 - share_dc))  # population rate = churn_per_hour
        mean_session = np.where(self.datacentre, 4 * home_session, home_session) * rng.lognormal(0.0, 0.7, count)
        self.session_s = mean_session
        self.initially_online = rng.random(count) < mean_session / (mean_session + s.offline_s)  # steady state
        events = []
        for index in range(count):
            online = bool(self.initially_online[index])
            times = []  # memoryless: the time left of the current session or absence is drawn afresh
            now = rng.exponential(mean_session[index] if online else s.offline_s)
            while now < s.duration_s + 3600.0:
                times.append(now)
                now += rng.exponential(s.offline_s if online else mean_session[index])
                online = not online
            events.append(times)
        width = max(1, max(len(times) for times in events))
        self.toggles = np.full((count, width), np.inf)
        for index, times in enumerate(events):
            self.toggles[index, : len(times)] = times
        availability = mean_session / (mean_session + s.offline_s)
        self.reliability = np.clip(availability + rng.normal(0.0, 0.05, count), 0.0, 1.0)  # (guess)

    def online(self, time_s: float) -> np.ndarray:
        online = self.initially_online ^ ((self.toggles <= time_s).sum(axis=1) % 2 == 1)
        if self.scenario.joins:
            online &= self.join_at <= time_s
        for outage in self.scenario.outages:
            if outage.start_s <= time_s < outage.end_s:
                online &= ~np.isin(self.city, outage.cities)
        return online

    def leaves_at(self, node: int, time_s: float) -> float:
        """When `node` next goes offline after `time_s`: `time_s` if it is offline then, inf if never."""
        toggles = self.toggles[node]
        passed = int((toggles <= time_s).sum())
        if self.initially_online[node] == bool(passed % 2):  # offline now
            return time_s
        leaves = float(toggles[passed]) if passed < toggles.size else math.inf
        if self.join_at[node] > time_s:
            return time_s
        for outage in self.scenario.outages:
            if self.city[node] in outage.cities and outage.end_s > time_s:
                leaves = min(leaves, max(outage.start_s, time_s))
        return leaves

    def backbone_factor(self, time_s: float) -> np.ndarray:
        """(cities, cities) multiplier of the backbone latency at `time_s` (link degradations; 1 elsewhere)."""
        cities = len(self.region_latency_ms)
        factor = np.ones((cities, cities))
        for link in self.scenario.degradations:
            if link.start_s <= time_s < link.end_s:
                factor[np.ix_(link.first, link.second)] = link.factor
                factor[np.ix_(link.second, link.first)] = link.factor
        return factor

    def load_at(self, time_s: float) -> np.ndarray:
        return self.load[min(int(time_s // LOAD_STEP_S), self.load.shape[0] - 1)]

    # ---- the router's view ---------------------------------------------------------------------------------

    def snapshot(
        self, time_s: float, *, starts: np.ndarray | None = None, remeasure_seed: int | None = None
    ) -> SwarmSnapshot:
        """What a client reading the records at `time_s` sees (the records of the last announce tick).

        `starts` (one start block per node) replaces the nodes' spans, for swarms that move blocks.
        `remeasure_seed` draws a repeated measurement: latencies, bandwidths and throughputs jitter by
        `scenario.remeasure_jitter` (log-normal) and the announced load's error is drawn afresh. Snapshots with
        either are not memoised."""
        s = self.scenario
        tick = int(time_s // s.announce_period_s)
        memoise = starts is None and remeasure_seed is None
        cached = self._snapshots.get(tick) if memoise else None
        if cached is not None:
            return cached
        announced = tick * s.announce_period_s
        listed = np.zeros(self.num_nodes, bool)
        for back in range(int(s.record_ttl_s // s.announce_period_s) + 1):  # records of recent ticks still live
            listed |= self.online(max(announced - back * s.announce_period_s, 0.0))
        step = min(int(announced // LOAD_STEP_S), self.load.shape[0] - 1)
        load_noise = self.load_seen_noise[step]
        access, bandwidth, tps = self.seen_access_ms, self.seen_bandwidth_mbps, self.seen_tps
        region_latency = np.asarray(self.region_latency_ms) * self.backbone_factor(announced)
        if remeasure_seed is not None:
            rng = np.random.default_rng([s.seed, remeasure_seed, tick])
            jitter = s.remeasure_jitter
            access = access * rng.lognormal(0.0, jitter, self.num_nodes)
            bandwidth = bandwidth * rng.lognormal(0.0, jitter, self.num_nodes)
            tps = tps * rng.lognormal(0.0, jitter / 2, self.num_nodes)
            load_noise = rng.normal(0.0, 0.05, self.num_nodes)  # as _build_load's announced-figure error
            noise = rng.lognormal(0.0, jitter, region_latency.shape)
            region_latency = region_latency * (noise + noise.T) / 2
        load = np.clip(self.load[step] + load_noise, 0.0, 1.0)
        cache_left = (self.cache_tokens * (1.0 - load)).astype(np.int64)  # other sessions hold the rest (guess)
        start = self.start if starts is None else np.asarray(starts, np.int64)
        end = start + (self.end - self.start)
        nodes = tuple(
            NodeView(
                peer_id=self.peer_ids[index],
                start_block=int(start[index]),
                end_block=int(end[index]),
                inference_tps=float(tps[index]),
                cache_tokens_left=int(cache_left[index]),
                codecs=("none", CODEC),
                region=int(self.city[index]),
                access_ms=float(access[index]),
                bandwidth_mbps=float(bandwidth[index]),
                load=float(load[index]),
                reliability=float(self.reliability[index]),
                lat=float(self.lat[index]),
                lon=float(self.lon[index]),
            )
            for index in np.flatnonzero(listed)
        )
        snapshot = SwarmSnapshot(
            num_blocks=s.model.num_blocks,
            nodes=nodes,
            hidden_size=s.model.hidden_size,
            region_latency_ms=tuple(tuple(float(x) for x in row) for row in region_latency),
        )
        if memoise:
            self._snapshots[tick] = snapshot
        return snapshot

    def requests(self, count: int, seed: int) -> tuple[SimRequest, ...]:
        """`count` requests arriving uniformly after the first announce period, from clients near the cities."""
        s = self.scenario
        rng = np.random.default_rng([s.seed, seed])
        times = np.sort(rng.uniform(s.announce_period_s, s.duration_s, count))
        city = rng.integers(0, len(s.cities), count)
        lat, lon = _scatter(
            rng, np.array([s.cities[c].lat for c in city]), np.array([s.cities[c].lon for c in city]), s.city_spread_km
        )
        prompt = np.clip(rng.lognormal(math.log(s.prompt_median), 1.0, count), 16, 4000).astype(int)
        new = np.clip(rng.lognormal(math.log(s.new_tokens_median), 0.8, count), 8, 1024).astype(int)
        access = rng.lognormal(math.log(6), 0.6, count)
        bandwidth = rng.lognormal(math.log(80), 0.8, count)
        return tuple(
            SimRequest(
                index,
                float(times[index]),
                float(lat[index]),
                float(lon[index]),
                int(city[index]),
                float(access[index]),
                float(bandwidth[index]),
                int(prompt[index]),
                int(new[index]),
                int(rng.integers(2**31)),
            )
            for index in range(count)
        )

    def chain_request(self, request: SimRequest) -> ChainRequest:
        """The request as a router sees it: partial spans allowed, the client's own region and link."""
        return ChainRequest(
            max_length=request.prompt_tokens + request.new_tokens,
            partial_spans=True,
            prompt_tokens=request.prompt_tokens,
            new_tokens=request.new_tokens,
            codec=CODEC,
            client_region=request.client_region,
            client_access_ms=request.client_access_ms,
            client_bandwidth_mbps=request.client_bandwidth_mbps,
        )

    # ---- the truth -----------------------------------------------------------------------------------------

    def latency_s(self, chain: Chain, request: SimRequest) -> float:
        """True end-to-end latency of `request` on `chain`: a prefill pass, then one pass per new token, each the
        client -> first node transfer, every hop's compute at its current load, the transfers between hops, and the
        way back; plus a failover for every hop that is gone at the start or leaves before the end."""
        index = [int(peer[4:]) for peer in chain.peer_ids]  # "node000123"
        blocks = np.array([hop.end_block - hop.start_block for hop in chain.hops])
        rng = np.random.default_rng([self.scenario.seed, request.seed])
        lat = np.r_[request.client_lat, self.lat[index], request.client_lat]
        lon = np.r_[request.client_lon, self.lon[index], request.client_lon]
        access = np.r_[request.client_access_ms, self.access_ms[index], request.client_access_ms]
        bandwidth = np.r_[request.client_bandwidth_mbps, self.bandwidth_mbps[index], request.client_bandwidth_mbps]
        distance = great_circle_km(lat[:-1], lon[:-1], lat[1:], lon[1:])
        if self.scenario.degradations:
            city = np.r_[request.client_region, self.city[index], request.client_region]
            distance = distance * self.backbone_factor(request.time_s)[city[:-1], city[1:]]
        latency = distance / FIBRE_KM_PER_MS * ROUTE_INFLATION + access[:-1] + access[1:]
        latency *= rng.lognormal(0.0, 0.15, latency.size)  # jitter: this request's share of congestion (guess)
        megabits_per_token = self.scenario.model.hidden_size * bytes_per_element(CODEC, 2.0) * 8 / 1e6
        per_token_ms = megabits_per_token / np.minimum(bandwidth[:-1], bandwidth[1:]) * 1000.0
        slowdown = 1.0 / (1.0 - self.load_at(request.time_s)[index])

        def one_pass(tokens: int) -> tuple[float, np.ndarray]:
            compute = blocks * np.maximum(self.decode_ms[index], tokens * self.prefill_ms_per_token[index]) * slowdown
            links = latency + tokens * per_token_ms
            return float(compute.sum() + links.sum()), compute + links[:-1]

        prefill, _ = one_pass(request.prompt_tokens)
        decode, _ = one_pass(1)
        total = prefill + request.new_tokens * decode
        for position, node in enumerate(index):
            leaves = self.leaves_at(node, request.time_s)
            if leaves < request.time_s + total / 1000.0:
                done = (leaves - request.time_s) * 1000.0
                tokens_done = 0 if done < prefill else min(int((done - prefill) / decode), request.new_tokens)
                _, per_hop = one_pass(request.prompt_tokens + tokens_done)  # replay into the replacement
                total += FAILOVER_DETECT_MS + float(per_hop[position])
        return total / 1000.0

    def evaluate(self, router: Router, requests: tuple[SimRequest, ...]) -> np.ndarray:
        """True latency (s) of each request on the chain `router` picks from the snapshot at its arrival; inf where
        the router found no chain."""
        latencies = np.empty(len(requests))
        for position, request in enumerate(requests):
            rng = np.random.default_rng([self.scenario.seed, request.seed, 1])
            try:
                chain = router(self.snapshot(request.time_s), self.chain_request(request), rng)
            except NoRouteError:
                latencies[position] = math.inf
                continue
            latencies[position] = self.latency_s(chain, request)
        return latencies
