"""Settings of one node daemon (units in each field's comment)."""

from __future__ import annotations

from dataclasses import dataclass

from nesa_node.compression.codec import CODECS


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
    # TCP port of the data lane (hidden states of open sessions, encrypted: nesa_node.protocol.lane); 0: any free port;
    # None: no lane, every step goes over libp2p
    lane_port: int | None = 0
    identity_path: str | None = None  # RSA key file; created if missing; None: a fresh key per run
    device: str = "cpu"
    dtype: str = "float32"
    quant: str = "none"  # weights of the blocks' linear layers: none, int8 (LLM.int8 with outliers) or nf4
    max_cache_tokens: int = 8192  # KV cache budget in tokens of batch 1 (converted to bytes with eq. 4)
    max_length: int = 4096  # longest inference session accepted, tokens
    max_batch: int = 64  # rows per session
    max_sessions: int = 256  # open inference sessions at once
    max_tokens_per_step: int = 8192  # batch * seq of one step or forward call
    # longest frame a peer may send on a stream, bytes; 0: room for max_tokens_per_step float32 hidden states
    max_message_bytes: int = 0
    # one peer's share of this node (a guess at fairness: two busy clients can always both be served)
    max_sessions_per_peer: int = 32
    max_cache_share_per_peer: float = 0.5  # fraction of the KV cache budget one peer may reserve
    max_queued_steps: int = 8  # steps of one session waiting for compute; more from a pusher are refused
    max_step_errors: int = 16  # consecutive refused steps after which the node ends the session
    announce_period_s: float = 10.0  # how often the NodeInfo record is refreshed
    session_timeout_s: float = 300.0  # an idle inference session is closed after this
    step_timeout_s: float = 30.0  # a step not computed and handed on within this closes its session
    peer_timeout_s: float = 30.0  # every await on another peer
    address_file: str | None = None  # written with the listening multiaddrs once ready
    throughput_cache: str | None = None  # JSON file of measured throughputs; None: ~/.cache/nesa-node
    measure_throughput: bool = True  # False: announce 0 tokens/s (tests that start many nodes)
    # A step expected to compute for less than this runs on the event loop itself: handing it to the compute
    # thread and back costs two thread wake-ups (0.2-0.6 ms measured on a loaded 2-core host), more than a short
    # stall of the loop costs. 0 sends every step to the compute thread.
    inline_compute_ms: float = 15.0
    link_probe_period_s: float = 60.0  # how often the links to a sample of peers are measured (rpc_ping)
    # test option: answer every RPC (pings included) this much later, so a node on loopback looks far away to
    # routing and to the link measurements alike (the kernel here has no netem to add real delay)
    inject_delay_ms: float = 0.0
    # codecs the node accepts for hidden states (and will produce when a client asks); "none" is always included
    compression: tuple[str, ...] = CODECS
    # what makes the node move to other blocks (server/rebalance.py): homology (persistent homology of the swarm,
    # the design's trigger), load-cv (per-block load imbalance), periodic, or off (never moves); with any but off a
    # block no node serves (a coverage hole) makes one node move to it at once
    rebalance: str = "homology"
    rebalance_period_s: float = 30.0  # how often the swarm's records are read to decide (three announce periods)
    # how long a node moving for throughput lets its sessions finish before ending them (clients then fail over);
    # a typical session is about a minute (topology/life.py SESSION_S). A hole move ends them at once.
    drain_timeout_s: float = 60.0

    @property
    def record_ttl_s(self) -> float:
        """Lifetime of each announcement: two may be missed, and a store slowed by unresponsive DHT peers (hivemind
        waits 3 s per request before giving up on one) still lands before the previous record expires."""
        return min(3 * self.announce_period_s + 10.0, 600.0)  # 600: protocol.dht.MAX_RECORD_TTL_S, what peers accept
