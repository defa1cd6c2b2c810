"""Settings of a swarm client (the SDK, the gateway, the CLI's generate): one frozen dataclass, units in names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nesa_node.compression.names import AUTO, DEFAULT_CODEC
from nesa_node.protocol.records import STEP_TOKENS_CAP, STEP_TOKENS_FLOOR
from nesa_node.protocol.tensors import WireCodec
from nesa_node.routing.cost import RoutingParams

MAX_HEAD_WAVES = 64  # ClientConfig.head_waves: more waves than sessions leaves waves empty; this is already many

MODES = ("direct", "relay")


def client_codec(name: str) -> WireCodec:
    """The codec a client names: "auto" (resolved per hop and message, never sent as such) or a wire codec
    (CodecError for an unknown one)."""
    return WireCodec(AUTO) if name == AUTO else WireCodec.of(name)


@dataclass(frozen=True)
class VerifyPolicy:
    """What a client checks of the nodes' outputs: "off"; "audit:P" (nodes sign a commitment per window, a fraction
    P of the windows is re-executed on other nodes: client/audit.py); "canary:P" (after a generation, each node of
    its chain is sent a known-answer canary with probability P: client/canaries.py); or "majority:N[@A:B]" (the
    spans overlapping blocks [A, B), default all, run by N disjoint replicas each, a strict majority deciding:
    client/majority.py)."""

    mode: str = "off"
    replicas: int = 1
    blocks: tuple[int, int] | None = None
    rate: float = 0.0  # audit: the fraction of windows re-executed; canary: the chance each node is checked

    @classmethod
    def parse(cls, text: str) -> VerifyPolicy:
        """The policy `text` names; ValueError for anything but "off", "audit:P" or "canary:P" with 0 < P <= 1, or
        "majority:N[@A:B]" with N >= 3."""
        text = str(text).strip()
        if text == "off":
            return cls()
        kind, _, rest = text.partition(":")
        if kind in ("audit", "canary"):
            try:
                rate = float(rest)
            except ValueError:
                rate = 0.0
            if 0 < rate <= 1:
                return cls(kind, rate=rate)
        if kind == "majority":
            count, _, blocks = rest.partition("@")
            span = None
            try:
                replicas = int(count)
                if blocks:
                    first, end = (int(part) for part in blocks.split(":"))
                    span = (first, end)
            except ValueError:
                replicas = 0
            if replicas >= 3 and (span is None or 0 <= span[0] < span[1]):
                return cls("majority", replicas, span)
        raise ValueError(
            f'verify must be "off", "audit:P" (a fraction 0 < P <= 1 of windows re-executed), "canary:P" (each node '
            f'checked with a known answer with chance 0 < P <= 1) or "majority:N" (N >= 3 replicas, optionally "@A:B" '
            f"for the spans of blocks A:B), got {text!r}"
        )

    def __str__(self) -> str:
        if self.mode == "off":
            return "off"
        if self.mode in ("audit", "canary"):
            return f"{self.mode}:{self.rate:g}"
        return f"majority:{self.replicas}" + (f"@{self.blocks[0]}:{self.blocks[1]}" if self.blocks else "")


@dataclass(frozen=True)
class ClientConfig:
    # direct: each node pushes to the next (fig. 2 of the Nesa paper); relay: the client forwards between nodes
    mode: str = "direct"
    # hidden-state codec asked of every hop that accepts it (others get "none"); see compression/codec.py CODECS.
    # "auto" (default): per hop and message, lossless unless the 8-bit codec saves time there (compression/auto.py)
    compression: WireCodec = field(default_factory=lambda: client_codec(DEFAULT_CODEC))
    # direct mode: hidden states over the nodes' data lanes (encrypted TCP, protocol/lane.py) where offered; False
    # keeps every message, forwards included, on libp2p
    lanes: bool = True
    request_timeout_s: float = 30.0  # every call to a node or the DHT
    routing_params: RoutingParams = field(default_factory=RoutingParams)  # eq. 18 exponents (`nesa-node tune`)
    partial_spans: bool = True  # a chain may use part of a node's span
    # recoveries of a step from failed nodes (each banned and its span replaced); one cut short by another node lost
    # (a neighbour whose outputs it needed) is not counted, and a step makes at most twice this many in all
    max_failovers: int = 3
    # nodes announcing a step limit (NodeInfo.max_step_tokens) below this many tokens a row (the session's max_length
    # when less; at most STEP_TOKENS_CAP rows x tokens in all) are not routed to: each would make every prompt go a
    # few tokens a step; a node announcing none is sent prompts within this, and fails if it refuses one. 0: any node
    min_step_tokens: int = STEP_TOKENS_FLOOR
    # chains tried when opening a session, and replacements tried in one failover: records of crashed nodes linger
    # until they expire (3 announce periods + 10 s), so after a burst of crashes many dead nodes can be met in a row;
    # each one that fails is banned, so every attempt removes a candidate
    max_open_attempts: int = 32
    # first-block candidates pinged per session open (those with no round trip measured in the last minute), on
    # their data lanes: a TCP socket the client closes itself, so a dead candidate leaves nothing behind. 0: no
    # pings; routing then uses the links nodes publish
    max_pinged_candidates: int = 8
    probe_timeout_s: float = 1.0  # asking a node for its NodeInfo directly when routing finds no chain
    # while unexpired records are at hand, a DHT read slower than this is not waited for (guess: a healthy read takes
    # 20-40 ms on loopback, a few 100 ms on a WAN)
    records_wait_s: float = 0.5
    # records read less than records_stale_s ago serve routing without a new read; once they are records_fresh_s
    # old, a call or a session's close reads them again in the background (guess: nodes announce every 10 s, and a
    # node gone since the read is caught by the ping before a session opens on it, or by failover)
    records_fresh_s: float = 1.0
    records_stale_s: float = 10.0
    step_timeout_s: float | None = None  # a step's deadline; None: adaptive (see InferenceSession.deadline)
    # sec. 3.1: share of the gap to full reliability a node's stability over the client's recent snapshots closes
    # (client/stability.py; 0: off), and the seconds between the snapshots kept for it
    stability_weight: float = 0.5
    stability_period_s: float = 10.0
    # what the client checks of the nodes' outputs: "off" or "majority:N[@A:B]" (VerifyPolicy; client/majority.py)
    verify: VerifyPolicy = field(default_factory=VerifyPolicy)
    # with several sessions stepping, the LM head waits up to this (and at most half a session's round) for the other
    # sessions' answers expected by then, to score them in one pass (client/head_batch.py, nesa_node/batching.py;
    # the nodes' --batch-window-ms is the same rule); 0: never
    head_batch_window_ms: float = 25.0
    # groups of sessions the LM head's passes keep apart (client/head_batch.py): with several, the waves go round the
    # chain one behind the other, the client scoring one while the nodes compute another (best with the nodes'
    # --batch-window-ms 0, which would otherwise merge them); 1: every session in one wave
    head_waves: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.compression, WireCodec):
            object.__setattr__(self, "compression", client_codec(str(self.compression)))
        if not isinstance(self.verify, VerifyPolicy):
            object.__setattr__(self, "verify", VerifyPolicy.parse(self.verify))
        for name in ("request_timeout_s", "probe_timeout_s", "records_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0")
        if not 0 <= self.records_fresh_s <= self.records_stale_s:
            raise ValueError("need 0 <= records_fresh_s <= records_stale_s")
        if not 0.0 <= self.stability_weight <= 1.0 or not self.stability_period_s > 0:
            raise ValueError("stability_weight must be in [0, 1] and stability_period_s above 0")
        if not self.head_batch_window_ms >= 0:
            raise ValueError("head_batch_window_ms must be 0 or more")
        if not 1 <= self.head_waves <= MAX_HEAD_WAVES:
            raise ValueError(f"head_waves must be 1 to {MAX_HEAD_WAVES}")
        if self.max_failovers < 0 or self.max_open_attempts < 1 or self.max_pinged_candidates < 0:
            raise ValueError("max_failovers and max_pinged_candidates must be >= 0, max_open_attempts >= 1")
        if not 0 <= self.min_step_tokens <= STEP_TOKENS_CAP:
            raise ValueError(
                f"min_step_tokens must be in 0..{STEP_TOKENS_CAP} (tokens a row), got {self.min_step_tokens}"
            )

    def step_tokens(self, batch: int, max_length: int) -> int:
        """Rows x tokens of a step every node of a session's chain must announce it takes: `min_step_tokens` (or
        max_length) tokens a row, at most STEP_TOKENS_CAP (a node with the default limit takes any session's), never
        below a token a row; 0 (any) for a cacheless forward or with min_step_tokens 0."""
        if not max_length or not self.min_step_tokens:
            return 0
        return max(batch, min(batch * min(self.min_step_tokens, max_length), STEP_TOKENS_CAP))

    def replace(self, **changes) -> ClientConfig:
        return dataclasses.replace(self, **changes)


CONFIG_FIELDS = frozenset(item.name for item in dataclasses.fields(ClientConfig))


def client_config(config: ClientConfig | None = None, **settings) -> ClientConfig:
    """`config` (default: the defaults) with `settings` by field name. `compression` may be a codec name,
    `routing_params` the path of a JSON file `nesa-node tune` wrote. TypeError for a name ClientConfig has not;
    ValueError for a bad value (CodecError for an unknown codec)."""
    unknown = sorted(set(settings) - CONFIG_FIELDS)
    if unknown:
        raise TypeError(f"unknown client settings {unknown}; known: {', '.join(sorted(CONFIG_FIELDS))}")
    if isinstance(settings.get("compression"), str):
        settings["compression"] = client_codec(settings["compression"])
    params = settings.get("routing_params")
    if params is not None and not isinstance(params, RoutingParams):
        from nesa_node.routing.ga import load_params

        settings["routing_params"] = load_params(params)
    elif "routing_params" in settings and params is None:
        settings["routing_params"] = RoutingParams()
    return (config or ClientConfig()).replace(**settings)


__all__ = ["client_config", "MODES", "ClientConfig", "VerifyPolicy", "client_codec"]
