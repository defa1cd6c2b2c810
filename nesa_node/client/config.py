"""Settings of a swarm client (the SDK, the gateway, the CLI's generate): one frozen dataclass, units in names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nesa_node.compression.names import AUTO, DEFAULT_CODEC
from nesa_node.protocol.tensors import WireCodec
from nesa_node.routing.cost import RoutingParams

MODES = ("direct", "relay")


def client_codec(name: str) -> WireCodec:
    """The codec a client names: "auto" (resolved per hop and message, never sent as such) or a wire codec
    (CodecError for an unknown one)."""
    return WireCodec(AUTO) if name == AUTO else WireCodec.of(name)


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
    max_failovers: int = 3  # node failures survived per step (each bans the node and replaces its span)
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
    step_timeout_s: float | None = None  # a step's deadline; None: adaptive (see InferenceSession.deadline)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.compression, WireCodec):
            object.__setattr__(self, "compression", client_codec(str(self.compression)))
        for name in ("request_timeout_s", "probe_timeout_s", "records_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0")
        if self.max_failovers < 0 or self.max_open_attempts < 1 or self.max_pinged_candidates < 0:
            raise ValueError("max_failovers and max_pinged_candidates must be >= 0, max_open_attempts >= 1")

    def replace(self, **changes) -> ClientConfig:
        return dataclasses.replace(self, **changes)


__all__ = ["MODES", "ClientConfig", "client_codec"]
