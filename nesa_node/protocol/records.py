"""Records that cross peer boundaries: the `NodeInfo` a node announces on the DHT, and the swarm snapshot.

DHT records ignore unknown fields so that newer peers stay readable; types are strict so a peer cannot sneak a
string where a number belongs.
"""

from __future__ import annotations

import enum
from typing import Annotated, NewType

from pydantic import BaseModel, ConfigDict, Field, model_validator

PeerIdText = NewType("PeerIdText", str)  # base58 libp2p peer id
SessionId = NewType("SessionId", str)
BlockIndex = NewType("BlockIndex", int)

MAX_RECORD_BYTES = 32 * 1024  # a record with every list full stays far below this
MAX_LIST_ITEMS = 64  # codecs, adapters, links: enough for any real node, small enough to bound a record
# names a node chooses (dtype, quantization, codecs, version): a word of letters, digits and `_.+-`, nothing that a
# page or a log line could read as markup or as a second line
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$"
# every integer has a ceiling: routing packs them in int64 arrays and sums and multiplies them (a record claiming
# 10**400 steps queued or 2**63 cache tokens must be refused here, not overflow in every client's routing)
MAX_COUNT = 1 << 31  # queued steps, sessions, session lengths
MAX_BLOCKS = 1 << 20  # block indices
MAX_CACHE_TOKENS = 1 << 40
LANE_ADDRESS = r"^[0-9A-Za-z.:\[\]-]+$"  # host:port, [v6]:port
# tokens a row a client asks by default of every node of a session's chain to take in one step (ClientConfig
# min_step_tokens): a node announcing less (max_step_tokens) is routed around
STEP_TOKENS_FLOOR = 256
STEP_TOKENS_CAP = 8192  # the most rows x tokens a client asks so: a node's default --max-tokens-per-step


class NodeState(enum.StrEnum):
    joining = "joining"
    online = "online"
    draining = "draining"
    offline = "offline"


class LoadInfo(BaseModel):
    """C_A of eq. 18: how busy the node is."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")
    cpu_percent: float = Field(0.0, ge=0, le=100 * 1024)  # summed over cores
    gpu_percent: float = Field(0.0, ge=0, le=100)
    queue: int = Field(0, ge=0, le=MAX_COUNT)  # steps waiting
    sessions: int = Field(0, ge=0, le=MAX_COUNT)  # open inference sessions


class LinkInfo(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")
    peer_id: str = Field(max_length=128)
    rtt_ms: float = Field(ge=0, allow_inf_nan=False)
    bandwidth_mbps: float | None = Field(None, ge=0, allow_inf_nan=False)


MEASURABLE_SHARE = 0.1  # a payload's part of a loaded round trip below this share is lost in the pings' noise


def bandwidth_from_pings(payload_bytes: int, rtt_s: float, loaded_s: float) -> float:
    """Mbit/s of a link, from an empty round trip `rtt_s` (the least of a few) and one carrying `payload_bytes`,
    `loaded_s`: the payload took the difference. Where that difference is under MEASURABLE_SHARE of the loaded round
    trip (a fast link, or a long one: a 256 KiB payload adds 2 ms to a 50 ms round trip at 1 Gbit/s), the payload
    took at most that share, so the figure is a bound from below that the measurement supports. Taking the whole
    loaded round trip instead would rate every long link by its latency (a 1 Gbit/s link 50 ms away at 40 Mbit/s)
    and have the "auto" codec compress over it."""
    transfer_s = max(loaded_s - rtt_s, MEASURABLE_SHARE * loaded_s)
    return payload_bytes * 8 / transfer_s / 1e6


SHA256_HEX = r"^[0-9a-f]{64}$"


class AdapterInfo(BaseModel):
    """A LoRA adapter a node holds for its blocks (sharding/lora.py): `adapter_id` names the whole adapter (the
    sha256 of its manifest of per-block hashes, the same on every node), `slice_sha256` the bytes of this node's slice
    of it; `name` is what people call it (a folder's name), for display and lookup only."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")
    adapter_id: str = Field(pattern=SHA256_HEX)
    name: str = Field(min_length=1, max_length=64)
    slice_sha256: str = Field(pattern=SHA256_HEX)
    rank: int = Field(ge=1, le=1 << 16)
    slice_bytes: int = Field(0, ge=0, le=1 << 40)  # bytes of this node's slice (what fetching it moves)


class NodeInfo(BaseModel):
    """What a node announces about itself every announce period."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore", use_enum_values=False)

    peer_id: str = Field(min_length=1, max_length=128)
    state: NodeState
    start_block: int = Field(ge=0, lt=MAX_BLOCKS)
    end_block: int = Field(ge=1, le=MAX_BLOCKS)
    dtype: str = Field(max_length=16, pattern=NAME)
    quantization: str = Field("none", max_length=16, pattern=NAME)
    codecs: tuple[Annotated[str, Field(max_length=32, pattern=NAME)], ...] = Field(
        ("none",), max_length=MAX_LIST_ITEMS
    )  # hidden-state codecs it accepts
    weights_hash: str = Field("", max_length=64)
    # the span's weights as stored in the checkpoint, before quantization: what a weights manifest predicts
    # (sharding/weights_manifest.py)
    source_hash: str = Field("", max_length=64)
    gpu_total_mb: float = Field(0.0, ge=0, allow_inf_nan=False)
    gpu_free_mb: float = Field(0.0, ge=0, allow_inf_nan=False)  # G_A of eq. 18
    load: LoadInfo = LoadInfo()
    ram_total_mb: float = Field(0.0, ge=0, allow_inf_nan=False)
    ram_free_mb: float = Field(0.0, ge=0, allow_inf_nan=False)
    forward_tps: float = Field(0.0, ge=0, allow_inf_nan=False)  # tokens/s, batch forward
    inference_tps: float = Field(0.0, ge=0, allow_inf_nan=False)  # tokens/s, one token at a time
    block_ms: float = Field(0.0, ge=0, allow_inf_nan=False)  # ms per block of a one-token step, per-call part apart
    cache_tokens_left: int = Field(0, ge=0, le=MAX_CACHE_TOKENS)
    uptime_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    reputation: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)
    adapters: tuple[AdapterInfo, ...] = Field((), max_length=MAX_LIST_ITEMS)  # LoRA adapters resident on the node
    version: str = Field("", max_length=32, pattern=r"^$|" + NAME)
    location: tuple[float, float] | None = None  # (lat, lon)
    links: tuple[LinkInfo, ...] = Field((), max_length=MAX_LIST_ITEMS)
    max_length: int = Field(0, ge=0, le=MAX_COUNT)  # longest session the node accepts, tokens
    # rows x tokens of the largest step (or replayed chunk) the node takes; 0: not announced. Clients split longer
    # prompts into steps within it, and a node refusing a step within what it announced has failed, not the caller
    max_step_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    lane: str | None = Field(
        None, max_length=64, pattern=LANE_ADDRESS
    )  # "ip:port" of the node's data lane (nesa_node.protocol.lane); None: none

    @model_validator(mode="after")
    def _check_span(self) -> NodeInfo:
        if self.start_block >= self.end_block:
            raise ValueError(f"start_block {self.start_block} must be < end_block {self.end_block}")
        return self

    @property
    def blocks(self) -> range:
        return range(self.start_block, self.end_block)

    def to_wire(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_wire(cls, value: object) -> NodeInfo:
        """Parse a record read from the DHT or a peer; strict JSON typing, bounded size.

        Raises ValueError (pydantic's ValidationError is one) for anything that is not a valid record.
        """
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="strict")
        if not isinstance(value, str):
            raise ValueError(f"a NodeInfo record is JSON text, got {type(value).__name__}")
        if len(value) > MAX_RECORD_BYTES:
            raise ValueError(f"record of {len(value)} bytes exceeds {MAX_RECORD_BYTES}")
        return cls.model_validate_json(value, strict=True)
