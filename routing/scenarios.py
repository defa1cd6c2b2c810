"""Scenarios for the swarm simulator: where nodes are, what GPUs they have, the model they serve, how they churn.

Numbers are public figures or stated guesses, fixed before any router was run on them (do not tune a scenario to a
method). GPU classes follow the paper's mix of data-centre and consumer cards.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GpuClass:
    name: str
    memory_gb: float  # device memory
    memory_bandwidth_gbs: float  # GB/s, vendor figure: decode is bound by reading the weights
    tflops: float  # dense fp16 tensor TFLOP/s, vendor figure: prefill is bound by compute
    datacentre: bool  # data-centre links and uptime, or a home machine


GPUS = {
    gpu.name: gpu
    for gpu in (
        GpuClass("H100", 80, 3350, 990, True),
        GpuClass("A100", 80, 2039, 312, True),
        GpuClass("L4", 24, 300, 121, True),
        GpuClass("RTX4090", 24, 1008, 165, False),
        GpuClass("RTX3090", 24, 936, 71, False),
        GpuClass("RTX3060", 12, 360, 25, False),
    )
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_blocks: int
    hidden_size: int
    block_gb: float  # weights of one block in memory (fp16)
    active_gb: float  # weights one token reads per block (all of them for a dense model, 2 of 8 experts for MoE)


LLAMA_70B = ModelShape("llama-70b", 80, 8192, 1.71, 1.71)  # 69B params / 80 layers * 2 bytes
MIXTRAL_8X7B = ModelShape("mixtral-8x7b", 32, 4096, 1.41, 0.39)  # 45B params / 32 layers; 13B active


@dataclass(frozen=True)
class City:
    name: str
    lat: float
    lon: float


EUROPE = (
    City("Frankfurt", 50.1, 8.7),
    City("London", 51.5, -0.1),
    City("Paris", 48.9, 2.4),
    City("Amsterdam", 52.4, 4.9),
    City("Stockholm", 59.3, 18.1),
    City("Warsaw", 52.2, 21.0),
    City("Madrid", 40.4, -3.7),
)
NORTH_AMERICA = (
    City("Ashburn", 39.0, -77.5),
    City("Chicago", 41.9, -87.6),
    City("Dallas", 32.8, -96.8),
    City("San Jose", 37.3, -121.9),
    City("Toronto", 43.7, -79.4),
)
ASIA = (
    City("Tokyo", 35.7, 139.7),
    City("Singapore", 1.35, 103.8),
    City("Seoul", 37.6, 127.0),
    City("Mumbai", 19.1, 72.9),
    City("Hong Kong", 22.3, 114.2),
)


@dataclass(frozen=True)
class Outage:
    """Every node in `cities` (indices into Scenario.cities) is offline during [start_s, end_s): a regional outage."""

    cities: tuple[int, ...]
    start_s: float
    end_s: float = float("inf")


@dataclass(frozen=True)
class ClusterJoin:
    """`nodes` extra nodes around `city` (it need not be among Scenario.cities) come online at `at_s`."""

    city: City
    nodes: int
    at_s: float


@dataclass(frozen=True)
class LinkDegradation:
    """From `start_s` on, the backbone latency between every city of `first` and every city of `second` (indices into
    Scenario.cities) is `factor` times its normal value, in the truth and in what the nodes measure: a cable between
    two regions in trouble."""

    first: tuple[int, ...]
    second: tuple[int, ...]
    factor: float
    start_s: float
    end_s: float = float("inf")


@dataclass(frozen=True)
class Scenario:
    name: str
    num_nodes: int
    model: ModelShape
    cities: tuple[City, ...]
    gpu_mix: tuple[tuple[str, float], ...]  # (GPU class, share of nodes)
    churn_per_hour: float = 0.0  # share of nodes that leave per hour (they come back after `offline_s`)
    offline_s: float = 1800.0  # mean time a node that left stays away (guess)
    duration_s: float = 3600.0  # simulated time; requests arrive after the first announce period
    announce_period_s: float = 60.0  # as `nesa-node run --announce-period` (default)
    record_ttl_s: float = 190.0  # records live 3 announce periods + 10 s (nesa_node records)
    city_spread_km: float = 150.0  # nodes scatter around their city (guess: a metro area and its region)
    load_mean: float = 0.35  # mean background utilisation of a node (guess: a busy public swarm)
    load_swing: float = 0.15  # amplitude of the daily load cycle (guess)
    load_noise: float = 0.12  # standard deviation of the fast load changes (guess)
    load_correlation_s: float = 300.0  # how long a load change lasts (guess: a few sessions)
    prompt_median: float = 400.0  # tokens (guess: chat with some context)
    new_tokens_median: float = 128.0  # tokens (guess)
    seed: int = 0
    outages: tuple[Outage, ...] = ()
    joins: tuple[ClusterJoin, ...] = ()
    degradations: tuple[LinkDegradation, ...] = ()
    remeasure_jitter: float = 0.1  # log-normal sigma of a repeated latency/bandwidth measurement (guess: ping jitter)


CONSUMER_AND_DATACENTRE = (
    ("H100", 0.05),
    ("A100", 0.10),
    ("L4", 0.10),
    ("RTX4090", 0.25),
    ("RTX3090", 0.30),
    ("RTX3060", 0.20),
)

SCENARIOS = {
    scenario.name: scenario
    for scenario in (
        Scenario("continent-200", 200, MIXTRAL_8X7B, EUROPE, CONSUMER_AND_DATACENTRE),
        Scenario("global-1000", 1000, LLAMA_70B, EUROPE + NORTH_AMERICA + ASIA, CONSUMER_AND_DATACENTRE),
    )
}
SCENARIOS["global-1000-churn"] = replace(SCENARIOS["global-1000"], name="global-1000-churn", churn_per_hour=0.10)
# Six hours of a global swarm (topology's trigger comparison): churn, Asia down for an hour, a cluster joining in
# Sao Paulo, three west-European cities down for half an hour, then the transatlantic backbone four times slower.
# Cities: 0-6 Europe, 7-11 North America, 12-16 Asia (the order of EUROPE + NORTH_AMERICA + ASIA).
SCENARIOS["global-600-six-hours"] = replace(
    SCENARIOS["global-1000"],
    name="global-600-six-hours",
    num_nodes=600,
    churn_per_hour=0.10,
    duration_s=6 * 3600.0,
    outages=(Outage((12, 13, 14, 15, 16), 1.5 * 3600, 2.5 * 3600), Outage((1, 2, 3), 4.0 * 3600, 4.5 * 3600)),
    joins=(ClusterJoin(City("Sao Paulo", -23.5, -46.6), 60, 3.0 * 3600),),
    degradations=(LinkDegradation((0, 1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11), 4.0, 5.0 * 3600),),
)


def scenario(name: str) -> Scenario:
    """Raises KeyError naming the known scenarios."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
