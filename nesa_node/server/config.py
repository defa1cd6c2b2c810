"""Settings of one node daemon: a frozen dataclass per concern, each field with its unit and its help text.

`nesa-node run`'s options are generated from these fields (nesa_node/cli/options.py), so every default lives here
once. Field metadata: "help" (the option's help), "flag" (the option name when it is not the field's name with
dashes), "parse" (a function from the option's text, raising argparse.ArgumentTypeError), "choices".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nesa_node.compression.names import CODECS

REBALANCE_TRIGGERS = ("homology", "load-cv", "periodic", "off")


def option(default, help: str, **extra):
    """A config field with its command-line help (and optional flag, parse, choices, none_flag)."""
    kind = {"default_factory": default} if callable(default) else {"default": default}
    return field(**kind, metadata={"help": help, **extra})


@dataclass(frozen=True)
class NetworkConfig:
    initial_peers: tuple[str, ...] = option((), "multiaddrs of peers already in the swarm", metavar="MADDR")
    new_swarm: bool = option(False, "start a new swarm (no initial peers)")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(0, "TCP port of the libp2p host (0: any free port)", parse="port")
    announce_host: str | None = option(
        None,
        "the IP address other machines reach this node at, when it is not --host's (listening on 0.0.0.0, behind "
        "NAT or port forwarding, in a container): its libp2p address and its data lane are announced there, on "
        "--port and --lane-port (a free port is picked for a port of 0)",
        parse="ip",
        metavar="IP",
    )
    lane_port: int | None = option(
        0,
        "TCP port of the data lane: hidden states of open sessions straight between peers, AES-GCM encrypted with "
        "keys the client hands out over libp2p (0: any free port)",
        parse="port",
        none_flag=("--no-lane", "no data lane: every step goes over libp2p (slower, one port less)"),
    )
    identity_path: str | None = option(
        None, "RSA key file; created if missing, keeps the peer id (default: a fresh key per run)", flag="--identity"
    )
    dht_prefix: str | None = option(None, "model key on the DHT (default: the model folder's name)")
    announce_period_s: float = option(10.0, "seconds between announcements of this node's record", parse="positive")
    link_probe_period_s: float = option(
        60.0,
        "seconds between measurements of the links (RTT, bandwidth) to neighbours and a few peers",
        parse="positive",
    )
    peer_timeout_s: float = option(30.0, "seconds any call to another peer may take", parse="positive")
    dht_storage_mb: float | None = option(
        None,
        "most memory other peers together may fill in this peer's DHT storage, MiB, each sender 1/16 of it; the "
        "oldest records of the heaviest sender go first (default 64)",
        parse="positive",
        metavar="MB",
    )
    # Data lane connections before their hello is authenticated cost an attacker one TCP connect each; these caps
    # keep the node's file descriptors for its own work (server/lane_gate.py). A client holds 2 lanes per session
    # and a few forward lanes; a hello takes one round trip (a WAN's 5 s is a dead peer).
    lane_hello_timeout_s: float = option(
        5.0, "seconds a data lane connection may take to complete its authenticated hello", parse="positive"
    )
    max_pending_lanes: int = option(
        256,
        "data lane connections whose hello is not done yet, from all addresses; past it the oldest is closed",
        parse="positive_int",
    )
    max_pending_lanes_per_host: int = option(
        32,
        "data lane connections whose hello is not done yet, from one IP address (an IPv6 /64); past it new ones are "
        "closed unread",
        parse="positive_int",
    )
    max_lanes: int = option(
        1024,
        "data lane connections open at once after their hello (2 per session, plus forward lanes)",
        parse="positive_int",
    )
    address_file: str | None = option(None, "write the listening multiaddrs here once ready")
    metrics_port: int | None = option(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics and a health check at /health (200 while the node "
        "serves, 503 when stuck or offline; 0: any free port; default: not served; needs the gateway extra: "
        "prometheus-client)",
        parse="port",
    )
    # the kernel here has no netem to delay packets, so a node on one machine looks far away only this way
    inject_delay_ms: float = option(
        0.0,
        "testing: answer every RPC, pings included, this much later, so a node on one machine looks far away to "
        "routing and link measurement",
        parse="non_negative",
    )


@dataclass(frozen=True)
class LimitsConfig:
    """What one node takes on, checked before anything is allocated (RELIABILITY.md D and G)."""

    max_cache_tokens: int = option(8192, "KV cache budget, tokens of batch 1 (bytes by eq. 4)", parse="positive_int")
    max_length: int = option(4096, "longest session accepted, tokens", parse="positive_int")
    max_batch: int = option(64, "rows per session", parse="positive_int")
    max_sessions: int = option(256, "open inference sessions at once", parse="positive_int")
    max_tokens_per_step: int = option(
        8192,
        "batch x tokens of one step or forward call, announced (as max_step_tokens) so clients split longer prompts; "
        "below 8192 clients with default settings route sessions asking more (256 tokens a row) around this node",
        parse="positive_int",
    )
    max_message_bytes: int = option(
        0,
        "longest frame a peer may send, bytes (0: room for the largest step in float32); a smaller one lowers the step "
        "limit announced to what it carries, and one that cannot carry a token is refused at start",
        parse="non_negative_int",
    )
    # one peer's share of this node (a guess at fairness: two busy clients can always both be served)
    max_sessions_per_peer: int = option(32, "open sessions one peer may hold here", parse="positive_int")
    max_cache_share_per_peer: float = option(
        0.5,
        "fraction of the KV cache budget one peer's sessions open within; as they grow they may borrow past it from "
        "free cache, taken back (newest borrower first) when a peer within its share needs it; also of the adapter "
        "budget its sessions' adapters may hold, and of the training memory (max_training_mb), borrowed the same way",
        parse="fraction",
    )
    max_queued_steps: int = option(
        8, "steps of one session waiting for compute; more from a pusher are refused", parse="positive_int"
    )
    max_step_errors: int = option(
        16, "refused steps in a row after which the node ends a session", parse="positive_int"
    )
    session_timeout_s: float = option(
        300.0, "close an inference session after this many seconds without a step", parse="positive"
    )
    # opening costs a peer nothing but a fresh identity: a session that never steps must not hold a place for long
    first_step_timeout_s: float = option(
        30.0, "close an inference session that takes no step within this many seconds of opening", parse="positive"
    )
    # an honest session steps every few ms to seconds while it generates (guess: 5 s covers a slow prefill upstream)
    preempt_idle_s: float = option(
        5.0,
        "when the node is full, end sessions without a step for this many seconds (their owners fail over) to admit "
        "a new one",
        parse="positive",
    )
    step_timeout_s: float = option(
        30.0,
        "close a session whose step is not computed and handed to the next node within this many seconds",
        parse="positive",
    )
    max_training_sessions: int = option(8, "open LoRA training sessions at once", parse="positive_int")
    # a rank-16 adapter on every projection of 8 blocks of a 7B Llama is about 20 MB; x4 for AdamW (guess: a few)
    max_training_mb: float = option(
        1024.0,
        "memory training sessions may take together: parameters, gradients, AdamW moments, room for replicas' "
        "gradients, saved inputs and their graphs, MiB",
        parse="positive",
        metavar="MB",
    )


@dataclass(frozen=True)
class ComputeConfig:
    device: str = option("cpu", "where the blocks run", choices=("cpu", "cuda"))
    dtype: str = option("float32", "dtype of the blocks' weights", choices=("float32", "bfloat16", "float16"))
    quant: str = option(
        "none",
        "quantize the blocks' linear layers with bitsandbytes: int8 (LLM.int8, outliers kept in 16/32 bit) or nf4 "
        "(4-bit NormalFloat); refused at start where this device cannot run it. Quantizing saves memory, not time: "
        "int8 decode steps ran about 3.5x slower than bfloat16 ones on an H100 (bitsandbytes' int8 kernel)",
        choices=("none", "int8", "nf4"),
    )
    # codecs the node accepts for hidden states (and will produce when a client asks); "none" is always included
    codecs: tuple[str, ...] = option(
        CODECS,
        f"hidden-state codecs this node accepts from clients and peers (none is always accepted; all of "
        f"{', '.join(CODECS)} by default)",
        flag="--compression",
        choices=CODECS,
        metavar="CODEC",
    )
    # A step expected to compute for less than this runs on the event loop itself: handing it to the compute
    # thread and back costs two thread wake-ups (0.2-0.6 ms measured on a loaded 2-core host), more than a short
    # stall of the loop costs. "Expected": the median of the last small steps, timed synchronized with the device
    # (server/compute.py StepPlacement). 0 sends every step to the compute thread.
    inline_compute_ms: float = option(
        15.0,
        "decode steps expected to take less than this (the median of recent ones, device-synchronized) run on the "
        "event loop, saving two thread hand-offs (0: always use the compute thread)",
        parse="non_negative",
    )
    batch_decode: bool = option(
        True,
        "run concurrent sessions' one-token steps on the same blocks together",
        none_flag=(
            "--no-batch-decode",
            "run every session's step on its own (by default one-token steps of concurrent sessions on the same "
            "blocks that are waiting together run as one batch)",
        ),
    )
    # off by default: on the 2-core CPU 8 prompts in one pass took 127 ms against 207 ms one by one, but the median
    # first token of 8 sessions started together came later (every prompt of a pass waits for the whole pass); a GPU,
    # whose prompt passes cost about what a one-token step costs, is where it should pay (bench/gpu.sh measures it)
    batch_prompts: bool = option(
        False,
        "also run the prompts of sessions that arrive together as one pass (spans of full-attention blocks, with "
        "decode batching on): more prompt tokens a second, but each prompt's output waits for the whole pass (off "
        "by default: on a CPU the median first token comes later)",
    )
    # sessions half a round apart merge only if a pass may wait that long: CPU rounds of the bench model through two
    # or three nodes take 30-100 ms (measured); the wait is also at most half of the waiting sessions' own round
    # (nesa_node/batching.py), so on a GPU's shorter rounds the bound is that
    batch_window_ms: float = option(
        25.0,
        "a one-token step waits up to this (and at most half its session's round) for the steps of other sessions "
        "expected by then, so they run in one pass; a lone session never waits (0: never wait)",
        parse="non_negative",
    )
    # a cap splits a round's steps into passes that follow each other down the chain: while the next node runs the
    # first, this one runs the second (the stages of a chain overlap where each has cores and device time of its own)
    max_pass_steps: int = option(
        0,
        "a batched pass takes at most N sessions' steps, and starts without waiting once N are queued; the rest form "
        "the next pass (0: no cap, one pass takes every step waiting)",
        parse="non_negative_int",
        metavar="N",
    )
    measure_throughput: bool = option(
        True, "measure the span's throughput at start", none_flag=("--no-measure", "skip the throughput measurement")
    )
    throughput_cache: str | None = option(None, "file caching measured throughput (default ~/.cache/nesa-node)")
    # on a GPU the first step at each new cache length is slow (the caching allocator's first blocks of that size,
    # the kernels' first choice), so a node's first generation ran at a fraction of later ones
    warmup_tokens: int | None = option(
        None,
        "one-token steps run once at start (and after a move), from an empty cache up to N cached tokens, then a "
        "few prompts of up to N tokens and one batched pass, so the first sessions run warm (default: 512 on a GPU, "
        "0 on the CPU, where a new length costs nothing extra)",
        parse="non_negative_int",
        metavar="N",
    )
    cuda_graphs: bool = option(
        False,
        "run a session's one-token steps as CUDA graphs (--device cuda; unquantized blocks of full attention): "
        "captured at the session's first step on each cache buffer, then replayed with one launch",
    )
    adapters: tuple[str, ...] = option(
        (),
        "PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors) to serve: the node keeps the "
        "slice of its blocks and announces it; a client names one per request",
        metavar="DIR",
    )
    # a rank-16 adapter on every projection of a 7B Llama's 32 blocks is about 80 MB (guess: room for a dozen)
    adapter_budget_mb: float = option(
        1024.0,
        "memory the adapters' slices may take together, MiB, counting the float32 copies that run them on a GPU",
        parse="positive",
        metavar="MB",
    )


@dataclass(frozen=True)
class RebalanceConfig:
    # what makes the node move to other blocks (server/rebalance.py): homology (persistent homology of the swarm,
    # the design's trigger), load-cv (per-block load imbalance), periodic, or off (never moves); with any but off a
    # block no node serves (a coverage hole) makes one node move to it at once
    trigger: str = option(
        "homology",
        "what makes this node move to other blocks: homology (the swarm's topology changed), load-cv (per-block "
        "load uneven), periodic, or off (never move); all but off also cover a block no node serves",
        flag="--rebalance",
        choices=REBALANCE_TRIGGERS,
    )
    period_s: float = option(
        30.0,
        "seconds between reads of the swarm's records to decide whether to move (three announce periods)",
        flag="--rebalance-period",
        parse="positive",
    )
    schema_book: str | None = option(
        None,
        "topology schema book (`nesa-node schema build`): when the swarm's topology class changes, the nodes move "
        "toward the block assignment the book holds for the new class; far from every class they recompute. Give "
        "every node the same book",
        metavar="FILE",
    )
    # a typical session is about a minute (topology/life.py SESSION_S); a hole move ends sessions at once
    drain_timeout_s: float = option(
        60.0,
        "before moving, seconds the sessions in flight may take to finish; the rest are ended and their clients "
        "fail over",
        parse="positive",
    )


@dataclass(frozen=True)
class NodeConfig:
    model_path: str
    start_block: int
    end_block: int
    network: NetworkConfig = field(default_factory=NetworkConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)

    @property
    def record_ttl_s(self) -> float:
        """Lifetime of each announcement: two may be missed, and a store slowed by unresponsive DHT peers (hivemind
        waits 3 s per request before giving up on one) still lands before the previous record expires."""
        return min(3 * self.network.announce_period_s + 10.0, 600.0)  # 600: protocol.dht.MAX_RECORD_TTL_S

    def with_settings(self, **settings) -> NodeConfig:
        """A copy with `settings` given by field name, whichever section holds each. Raises TypeError for a name
        no section has."""
        top = {name: value for name, value in settings.items() if name in _TOP_FIELDS}
        by_section: dict[str, dict] = {}
        for name, value in settings.items():
            if name in top:
                continue
            section = _SECTION_OF.get(name)
            if section is None:
                raise TypeError(f"unknown node setting {name!r}")
            by_section.setdefault(section, {})[name] = value
        changes = {
            section: dataclasses.replace(getattr(self, section), **values) for section, values in by_section.items()
        }
        return dataclasses.replace(self, **top, **changes)


_TOP_FIELDS = {"model_path", "start_block", "end_block"}
_SECTION_OF = {
    item.name: section
    for section, kind in (
        ("network", NetworkConfig),
        ("limits", LimitsConfig),
        ("compute", ComputeConfig),
        ("rebalance", RebalanceConfig),
    )
    for item in dataclasses.fields(kind)
}
if len(_SECTION_OF) != sum(len(dataclasses.fields(kind)) for kind in (NetworkConfig, LimitsConfig, ComputeConfig,
                                                                      RebalanceConfig)):  # fmt: skip
    raise RuntimeError("two node config sections share a field name")

__all__ = ["ComputeConfig", "LimitsConfig", "NetworkConfig", "NodeConfig", "RebalanceConfig", "REBALANCE_TRIGGERS"]
