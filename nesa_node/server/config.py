"""Settings of one node daemon (units in each field's comment)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeConfig:
    model_path: str
    start_block: int
    end_block: int
    dht_prefix: str | None = None  # model key on the DHT; default: the model folder's name
    initial_peers: tuple[str, ...] = ()  # multiaddrs of peers already in the swarm
    new_swarm: bool = False  # start a swarm alone (no initial peers needed)
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    identity_path: str | None = None  # RSA key file; created if missing; None: a fresh key per run
    device: str = "cpu"
    dtype: str = "float32"
    max_cache_tokens: int = 8192  # KV cache budget in tokens of batch 1 (converted to bytes with eq. 4)
    max_length: int = 4096  # longest inference session accepted, tokens
    max_batch: int = 64  # rows per session
    max_sessions: int = 256  # open inference sessions at once
    max_tokens_per_step: int = 8192  # batch * seq of one step or forward call
    announce_period_s: float = 10.0  # how often the NodeInfo record is refreshed
    session_timeout_s: float = 300.0  # an idle inference session is closed after this
    peer_timeout_s: float = 30.0  # every await on another peer
    address_file: str | None = None  # written with the listening multiaddrs once ready
    throughput_cache: str | None = None  # JSON file of measured throughputs; None: ~/.cache/nesa-node
    measure_throughput: bool = True  # False: announce 0 tokens/s (tests that start many nodes)

    @property
    def record_ttl_s(self) -> float:
        return max(3 * self.announce_period_s, 5.0)
