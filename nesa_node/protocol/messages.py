"""Every message peers exchange, as frozen pydantic models, and the one function that reads them from peer bytes.

A frame on the wire is a protobuf (hivemind's ExpertRequest / ExpertResponse: tensors and a metadata field); the
metadata holds one message, msgpack-encoded, whose `kind` names its model:

  session stream (protocol.rpc.INFERENCE), client -> node
    open        OpenSession     session id, blocks, batch, max_length, neighbours, output codec, lane keys
    step        Step            hidden states of new tokens at a position (also pushed node -> node, and on lanes)
    history     HistoryRequest  this node's outputs for the first `position` tokens (failover of the next node)
    retarget    Retarget        new next node and/or upstream node (failover of a neighbour)
    records_request  RecordsRequest  the node's signed hop records of this session not yet sent (verification)
  session stream, node -> client
    opened      Opened          cache reserved
    result      StepResult      a step's output (or a replayed step's, to the client)
    history     History         the outputs asked for, lossless
    retargeted  Retargeted
    records     Records         its public key and signed hop records, as byte tensors
    error       ErrorReply      a typed error (code, message), with the refused step's id when there is one
  unary and lane calls
    forward     ForwardRequest  run blocks on a whole sequence, no cache  -> ForwardResult
    info        InfoReply       a node's live NodeInfo record
    ticket      LaneTicket      a one-time FORWARD lane ticket and key
    graph       GraphForward    a graph-model stage's named inputs      -> GraphResult
  training stream (protocol.rpc.TRAIN), client -> node; node answers each in order
    train_open           OpenTraining       blocks, the slice's bytes, optimizer   -> TrainOpened
    train_forward        TrainForward       hidden states, saved for backward      -> TrainOutput
    train_backward       TrainBackward      gradient of the outputs, then a step   -> TrainGrad
    train_apply          TrainApply         the step on gathered micro-batch grads -> TrainApplied
    train_state_request  TrainStateRequest  the slice's current values             -> TrainState
  training sync stream (protocol.rpc.TRAIN_SYNC), node -> node
    train_sync           TrainSync          a replica's gradients for one update   -> TrainSynced

Reading a peer's metadata (`decode`) refuses, with BadRequestError and before any model is built: more than
MAX_METADATA_BYTES, msgpack extension types (whose decoders may recurse), nesting deeper than MAX_DEPTH, anything but
a map; then the model refuses unknown keys, wrong types (no coercion: strict) and oversized fields. Models for
later features (training passes, adapters) are added as new kinds; a peer that does not know a kind refuses it.
"""

from __future__ import annotations

import functools
import operator
from typing import Annotated, Literal, TypeVar

import msgpack
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from nesa_node.errors import BadRequestError, NesaError, error_from_code
from nesa_node.protocol import lane
from nesa_node.protocol.metadata import describe, read_map
from nesa_node.protocol.records import MAX_RECORD_BYTES, NodeInfo
from nesa_node.protocol.tensors import NO_CODEC, WireCodec

MAX_METADATA_BYTES = 16 * 1024  # a message is a handful of ids and numbers
MAX_SEALS = 128  # a step's seals, one a node after the first of a direct chain: 8.5 KiB of metadata at most
MAX_INFO_BYTES = MAX_RECORD_BYTES + 1024  # an InfoReply carries a whole NodeInfo record
MAX_DEPTH = 4  # a message, a nested map (lane keys, codec) and a list inside it
MAX_ID_LENGTH = 128  # session ids, step ids' parts, peer ids
MAX_BLOCKS = 1 << 16  # block indices: more than any model has
MAX_NAMES = 64  # tensors named in a graph-model stage call

_ID_PATTERN = r"^[0-9A-Za-z._:-]+$"  # printable, no spaces or line breaks: ids end up in logs and lane hellos


def _peer_id(value: object) -> object:
    """A base58 libp2p peer id (checked by parsing it, and its multihash)."""
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH:
        from hivemind.p2p import PeerID
        from multihash import decode as decode_multihash

        try:
            decode_multihash(PeerID.from_base58(value).to_bytes())
        except Exception:
            raise ValueError("not a valid peer id") from None
    return value


def _codec(value: object) -> object:
    if isinstance(value, WireCodec):
        return value
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        return _parse_codec(value)
    if all(isinstance(item, str | int) for item in value.values()):
        return _known_codec(tuple(sorted(value.items())))  # the same few codecs arrive on every step
    return _parse_codec(value)


def _parse_codec(value: object) -> WireCodec:
    try:
        return WireCodec.from_metadata(value)
    except BadRequestError as error:
        raise ValueError(error.message) from None


@functools.lru_cache(maxsize=64)
def _known_codec(items: tuple) -> WireCodec:
    return _parse_codec(dict(items))


Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH, pattern=_ID_PATTERN)]
StepIdText = Annotated[str, Field(min_length=1, max_length=2 * MAX_ID_LENGTH, pattern=_ID_PATTERN)]
PeerIdText = Annotated[str, BeforeValidator(_peer_id), Field(min_length=1, max_length=MAX_ID_LENGTH)]
Block = Annotated[int, Field(ge=0, le=MAX_BLOCKS)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Codec = Annotated[
    WireCodec,
    BeforeValidator(_codec),
    PlainSerializer(lambda codec: codec.to_metadata(), return_type=dict | None),
]
HexKey = Annotated[str, Field(min_length=64, max_length=64, pattern=r"^[0-9a-fA-F]+$")]
AdapterId = Annotated[str, Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]+$")]  # sha256 hex, lowercase


def _lane_address(value: object) -> object:
    """'ip:port' of a data lane (protocol/lane.py: an IP address, never a name to resolve)."""
    if isinstance(value, str):
        try:
            lane.parse_address(value)
        except BadRequestError as error:
            raise ValueError(error.message) from None
    return value


LaneAddress = Annotated[str, BeforeValidator(_lane_address), Field(min_length=1, max_length=64)]


class Message(BaseModel):
    """A message between peers: frozen, strict types, unknown keys refused."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", arbitrary_types_allowed=True)


class LaneSettings(Message):
    """Data lane settings of a session link (protocol/lane.py): the key of the link into the node, of the link out
    of it, and the next node's lane address (None: push over libp2p). Each only when given."""

    model_config = ConfigDict(populate_by_name=True)
    key_in: HexKey | None = Field(None, alias="in")
    key_out: HexKey | None = Field(None, alias="out")
    next: LaneAddress | None = None


class BlockRange(Message):
    """Blocks [start_block, end_block) a message asks a node to run: a non-empty contiguous range."""

    start_block: Block
    end_block: Block

    @model_validator(mode="after")
    def _check_blocks(self) -> BlockRange:
        if self.start_block >= self.end_block:
            raise ValueError(f"start_block {self.start_block} must be below end_block {self.end_block}")
        return self


class OpenSession(BlockRange):
    """Open a session for blocks [start_block, end_block) of the node's span (the cache is reserved for all of it)."""

    kind: Literal["open"] = "open"
    session_id: Id
    batch: int = Field(ge=1, le=1 << 16)  # rows, fixed for the session
    max_length: int = Field(ge=1, le=1 << 24)  # tokens the cache must hold
    upstream: PeerIdText | None = None  # the only peer whose pushes are taken; None: the opener
    next: PeerIdText | None = None  # where outputs are pushed; None: back to the client
    output_codec: Codec = NO_CODEC
    lane: LaneSettings | None = None
    adapter: AdapterId | None = None  # the LoRA adapter every step of the session runs with (records.AdapterInfo)
    # sign a hop record per 32-token window of this session (nesa_node/verification), as hop `commit_hop` of the chain
    commit_hop: int | None = Field(None, ge=0, le=1 << 10)
    # this node's key (protocol/push_tag.py): it tags its pushes with it, and checks the seal of a step pushed to it
    push_key: HexKey | None = None


class AdapterBlocks(BlockRange):
    """A client's own LoRA adapter for one session, sent on the session stream just before its OpenSession: the
    frame's first tensor holds the adapter's manifest (per-block hashes, sharding/lora_identity.py), then one tensor
    per block [start_block, end_block) its canonical slice bytes (protocol/tensors.py bytes_to_proto). The node checks
    the manifest against `adapter_id` and every block against the manifest, and keeps them for that session only."""

    kind: Literal["adapter_blocks"] = "adapter_blocks"
    adapter_id: AdapterId


class AdapterRequest(BlockRange):
    """A node asks a peer that announces LoRA adapter `adapter_id` for its blocks [start_block, end_block): answered
    with AdapterBlocks (the manifest, then the blocks) or an ErrorReply."""

    kind: Literal["adapter_request"] = "adapter_request"
    adapter_id: AdapterId


class Step(Message):
    """Hidden states (batch, seq, hidden) of new tokens at `position`, in one tensor. `step_id` is the same on a retry
    (a duplicate is answered from record); `compute_s`: the nodes before's time; `replay` (client only) rebuilds a
    replacement's cache, answered to the client; `session_id` and `owner` (who opened it: sessions are scoped to
    their opener) name the session on a libp2p push stream, where nothing else does."""

    kind: Literal["step"] = "step"
    step_id: StepIdText
    position: int = Field(ge=0, le=1 << 24)
    codec: Codec = NO_CODEC
    compute_s: Seconds = 0.0
    replay: bool = False
    session_id: Id | None = None
    owner: Id | None = None  # a base58 peer id; only looked up, so a malformed one just matches no session
    tag: HexKey | None = None  # a pushing node's tag of this step (protocol/push_tag.py)
    seals: tuple[HexKey, ...] = Field((), max_length=MAX_SEALS)  # the client's, for the nodes after (push_tag.py)


class HistoryRequest(Message):
    kind: Literal["history"] = "history"
    position: int = Field(ge=1, le=1 << 24)


class Retarget(Message):
    """Point a node at a replacement neighbour: `next` (push there; None: answer the client) and/or `upstream`,
    each only when given; `lane` replaces the lane settings it names; `output_codec` (null: "none"), when given,
    the codec of its outputs from now on (chosen for a new next node: it may not take the one opened with)."""

    kind: Literal["retarget"] = "retarget"
    next: PeerIdText | None = None
    upstream: PeerIdText | None = None
    lane: LaneSettings | None = None
    output_codec: Codec | None = None


class Opened(Message):
    kind: Literal["opened"] = "opened"
    cache_tokens_left: int = Field(ge=0)


class StepResult(Message):
    kind: Literal["result"] = "result"
    step_id: StepIdText
    position: int = Field(ge=0)
    compute_s: Seconds = 0.0  # this node's and those before it
    codec: Codec = NO_CODEC
    replayed: bool = False


class History(Message):
    kind: Literal["history"] = "history"
    position: int = Field(ge=1)


class Retargeted(Message):
    kind: Literal["retargeted"] = "retargeted"


class RecordsRequest(Message):
    """The node's signed hop records of the session that it has not sent yet; `final` closes the window under way
    first (the session is ending)."""

    kind: Literal["records_request"] = "records_request"
    final: bool = False


class Records(Message):
    """Answer to RecordsRequest: the frame's first tensor is the node's public key (DER), then `count` records
    (verification/receipts.py HopRecord encodings), each a byte tensor."""

    kind: Literal["records"] = "records"
    count: int = Field(ge=0, le=1 << 16)


class ErrorReply(Message):
    """A refusal. `evidence`: the tagged step a node refuses, as its previous node pushed it (its tensor in the
    frame), for the client to judge which of the two is at fault (protocol/push_tag.py)."""

    kind: Literal["error"] = "error"
    code: str = Field(max_length=64)
    message: str = Field(max_length=4096)
    step_id: StepIdText | None = None
    evidence: Step | None = None

    @classmethod
    def of(cls, error: NesaError, step_id: str | None = None) -> ErrorReply:
        return cls(code=error.code[:64], message=error.message[:4096], step_id=step_id)

    def error(self) -> NesaError:
        return error_from_code(self.code, self.message)


class ForwardRequest(BlockRange):
    kind: Literal["forward"] = "forward"
    codec: Codec = NO_CODEC
    output_codec: Codec = NO_CODEC


class ForwardResult(Message):
    kind: Literal["forward_result"] = "forward_result"
    compute_s: Seconds = 0.0
    codec: Codec = NO_CODEC


class InfoReply(Message):
    kind: Literal["info"] = "info"
    info: str = Field(max_length=MAX_RECORD_BYTES)  # NodeInfo JSON (protocol/records.py); decode with MAX_INFO_BYTES

    def node_info(self) -> NodeInfo:
        """The NodeInfo record the reply carries; BadRequestError when it is not a valid one."""
        try:
            return NodeInfo.from_wire(self.info)
        except ValueError as exc:  # from_wire's refusal (pydantic's ValidationError is one)
            raise BadRequestError(f"info reply holds no valid NodeInfo record: {str(exc)[:200]}") from None


class LaneTicket(Message):
    kind: Literal["ticket"] = "ticket"
    ticket: Annotated[str, Field(min_length=32, max_length=32, pattern=r"^[0-9a-f]+$")]
    key: HexKey
    lane: LaneAddress


class GraphForward(Message):
    kind: Literal["graph"] = "graph"
    plan: str = Field(min_length=1, max_length=128)
    stage: int = Field(ge=0, le=1024)
    names: tuple[Annotated[str, Field(max_length=128)], ...] = Field(max_length=MAX_NAMES)


class GraphResult(Message):
    kind: Literal["graph_result"] = "graph_result"
    names: tuple[Annotated[str, Field(max_length=128)], ...] = Field(max_length=MAX_NAMES)
    compute_s: Seconds = 0.0


MAX_REPLICAS = 16  # other sessions training the same blocks in one data-parallel training session


class Replica(Message):
    """A training session on another node (or this one) that trains the same blocks: `session_id` there."""

    peer: PeerIdText
    session_id: Id


class OpenTraining(BlockRange):
    """Open a LoRA training session for blocks [start_block, end_block) of the node's span (server/training.py). The
    frame's first tensor holds the slice's canonical bytes (sharding/lora.py, bytes_to_proto) for exactly those blocks,
    whose sha256 is `slice_sha256`; with `optimizer_sha256`, a second tensor holds AdamW's state to resume from
    (sharding/lora_train.py OptimizerState). The node trains its own copy with AdamW (`lr`, `betas`, `eps`,
    `weight_decay`, torch's definitions). `step` is the number of updates the slice has had (a resumed or replacement
    session)."""

    kind: Literal["train_open"] = "train_open"
    session_id: Id
    slice_sha256: AdapterId
    lr: float = Field(gt=0, le=1.0, allow_inf_nan=False)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0, le=1.0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0, le=1.0, allow_inf_nan=False)
    step: int = Field(0, ge=0, le=1 << 40)
    optimizer_sha256: AdapterId | None = None
    # data parallel: the sessions training the same blocks on other parts of each batch; before every optimizer step
    # the members sum their gradients (TrainSync), so every replica takes the same step
    replicas: tuple[Replica, ...] = Field((), max_length=MAX_REPLICAS)


class TrainForward(Message):
    """Hidden states (batch, seq, hidden) into the session's blocks, positions from 0, in one tensor; `keep` saves the
    input for the backward pass of the same `step_id` (False: an evaluation pass, nothing saved)."""

    kind: Literal["train_forward"] = "train_forward"
    step_id: StepIdText
    codec: Codec = NO_CODEC
    output_codec: Codec = NO_CODEC
    keep: bool = True


class TrainBackward(Message):
    """The loss's gradient with respect to the outputs of forward `step_id`, in one tensor; answered with the
    gradient with respect to its inputs. `apply`: then take one optimizer step on the gradients gathered since the
    last one (False: gather more micro-batches first). A step id's backward pass runs once: sent again (after a lost
    answer), it is refused, and the client reopens its chain at its last checkpoint."""

    kind: Literal["train_backward"] = "train_backward"
    step_id: StepIdText
    codec: Codec = NO_CODEC
    output_codec: Codec = NO_CODEC
    apply: bool = True


class TrainSync(Message):
    """Node -> node (protocol.rpc.TRAIN_SYNC): the sender's session `from_session_id` gives its gradients for update
    `round` to the receiver's session `session_id` of client `owner`, its replica: one float32 tensor of every LoRA
    parameter's gradient, flattened in the slice's parameter order. `probe`: no tensor, only whether the receiver
    would take them (a sender asks once per replica before its first gradients go out)."""

    kind: Literal["train_sync"] = "train_sync"
    owner: Id
    session_id: Id
    from_session_id: Id
    round: int = Field(ge=1, le=1 << 40)
    probe: bool = False


class TrainSynced(Message):
    kind: Literal["train_synced"] = "train_synced"


class TrainApply(Message):
    """Take optimizer step `update` (the session's step count + 1) on the gradients gathered by backward passes sent
    with apply=False (micro-batches), after summing the replicas' (data parallel); answered TrainApplied. Sent again
    for the step it already took, it is answered the same."""

    kind: Literal["train_apply"] = "train_apply"
    update: int = Field(ge=1, le=1 << 40)


class TrainApplied(Message):
    kind: Literal["train_applied"] = "train_applied"
    step: int = Field(ge=0)
    compute_s: Seconds = 0.0


class TrainStateRequest(Message):
    """Ask for the slice's current values (a checkpoint, or the adapter at the end)."""

    kind: Literal["train_state_request"] = "train_state_request"


class TrainOpened(Message):
    kind: Literal["train_opened"] = "train_opened"
    step: int = Field(ge=0)


class TrainOutput(Message):
    kind: Literal["train_output"] = "train_output"
    step_id: StepIdText
    compute_s: Seconds = 0.0
    codec: Codec = NO_CODEC


class TrainGrad(Message):
    """The gradient with respect to the inputs of `step_id` (one tensor); `step`: updates applied so far."""

    kind: Literal["train_grad"] = "train_grad"
    step_id: StepIdText
    step: int = Field(ge=0)
    compute_s: Seconds = 0.0
    codec: Codec = NO_CODEC


class TrainState(BlockRange):
    """The slice after `step` updates: two tensors, its canonical bytes (sha256 `slice_sha256`) and AdamW's state
    (`optimizer_sha256`), signed by the node: `signature` of `signed_bytes(session_id)` by the RSA key `public_key`
    (hivemind's serialization) whose libp2p peer id is the node's. A checkpoint keeps all of it, so who produced each
    slice can be checked later."""

    kind: Literal["train_state"] = "train_state"
    step: int = Field(ge=0)
    slice_sha256: AdapterId
    optimizer_sha256: AdapterId
    public_key: bytes = Field(b"", max_length=2048)
    signature: bytes = Field(b"", max_length=2048)

    def signed_bytes(self, session_id: str) -> bytes:
        fields = (session_id, self.start_block, self.end_block, self.step, self.slice_sha256, self.optimizer_sha256)
        return ("nesa-train-state/1|" + "|".join(str(field) for field in fields)).encode()


M = TypeVar("M", bound=Message)


_KINDS: dict[int, tuple[str, ...]] = {}  # id of a union -> the kinds it accepts


def _union(*models: type[Message]) -> TypeAdapter:
    """What a receiver accepts: one of `models`, chosen by the message's `kind`."""
    if len(models) == 1:
        union = TypeAdapter(models[0])
    else:
        union = TypeAdapter(Annotated[functools.reduce(operator.or_, models), Field(discriminator="kind")])
    _KINDS[id(union)] = tuple(model.model_fields["kind"].default for model in models)
    return union


def accepted_kinds(union: TypeAdapter) -> tuple[str, ...]:
    """The kinds a union of this module (TO_SESSION, FROM_TRAINING, ...) decodes."""
    return _KINDS[id(union)]


# what each receiver accepts, by direction
ADAPTER_REQUESTS = _union(AdapterRequest)  # on an adapter stream, from the fetching node
ADAPTER_ANSWERS = _union(AdapterBlocks, ErrorReply)
TO_SESSION = _union(OpenSession, AdapterBlocks, Step, HistoryRequest, Retarget, RecordsRequest)  # from its client
FROM_SESSION = _union(Opened, StepResult, History, Retargeted, Records, ErrorReply)  # a node's answers on its stream
PUSHED = _union(Step)  # pushed node -> node, or sent on a data lane
PUSH_ANSWERS = _union(ErrorReply)  # a next node answers a push stream only to refuse a step
FORWARD = _union(ForwardRequest)
FORWARD_ANSWERS = _union(ForwardResult, ErrorReply)
INFO_ANSWERS = _union(InfoReply, ErrorReply)
TICKET_ANSWERS = _union(LaneTicket, ErrorReply)
TO_TRAINING = _union(
    OpenTraining, TrainForward, TrainBackward, TrainApply, TrainStateRequest
)  # a training stream's client
FROM_TRAINING = _union(TrainOpened, TrainOutput, TrainGrad, TrainApplied, TrainState, ErrorReply)
TRAIN_SYNC = _union(TrainSync)
TRAIN_SYNC_ANSWERS = _union(TrainSynced, ErrorReply)
GRAPH = _union(GraphForward)
GRAPH_ANSWERS = _union(GraphResult, ErrorReply)


def decode(raw: bytes, kinds: TypeAdapter, *, max_bytes: int = MAX_METADATA_BYTES) -> Message:
    """The message in a peer's metadata bytes, as one of the models `kinds` accepts; BadRequestError otherwise (see
    the module docstring for every check, all made before anything is built from the bytes). `max_bytes`: a larger
    bound for the few answers that carry a whole record (MAX_INFO_BYTES)."""
    value = read_map(raw, max_bytes=max_bytes, max_depth=MAX_DEPTH)
    try:
        return kinds.validate_python(value)
    except ValidationError as exc:
        kind = value.get("kind")
        label = f"{kind[:32]} message" if isinstance(kind, str) else "message"
        raise BadRequestError(f"{label}: {describe(exc, kind)}") from None
    except (TypeError, ValueError) as exc:  # a value no validator expected (say, bytes where text belongs)
        raise BadRequestError(f"malformed message: {str(exc)[:200]}") from None


def encode(message: Message) -> bytes:
    """Metadata bytes of `message`: its kind and every field it was given (a field given its default value still
    travels: a Retarget's `next=None` means "answer the client", its absence "keep the next node")."""
    fields = message.model_dump(mode="python", exclude_unset=True, by_alias=True, exclude={"kind"})
    return msgpack.packb({"kind": message.kind, **fields}, use_bin_type=True)


def expect(message: Message, model: type[M]) -> M:
    """`message` if it is a `model`; BadRequestError naming both kinds otherwise."""
    if not isinstance(message, model):
        raise BadRequestError(f"expected a {model.model_fields['kind'].default} message, got {message.kind!r}")
    return message


__all__ = [
    "accepted_kinds",
    "ADAPTER_ANSWERS",
    "ADAPTER_REQUESTS",
    "AdapterBlocks",
    "AdapterRequest",
    "FORWARD",
    "FORWARD_ANSWERS",
    "FROM_SESSION",
    "GRAPH",
    "GRAPH_ANSWERS",
    "INFO_ANSWERS",
    "MAX_METADATA_BYTES",
    "PUSHED",
    "PUSH_ANSWERS",
    "TICKET_ANSWERS",
    "TO_SESSION",
    "TO_TRAINING",
    "TRAIN_SYNC",
    "TRAIN_SYNC_ANSWERS",
    "FROM_TRAINING",
    "ErrorReply",
    "ForwardRequest",
    "ForwardResult",
    "GraphForward",
    "GraphResult",
    "History",
    "HistoryRequest",
    "InfoReply",
    "LaneSettings",
    "LaneTicket",
    "Message",
    "OpenSession",
    "OpenTraining",
    "Opened",
    "Retarget",
    "Records",
    "RecordsRequest",
    "Retargeted",
    "TrainApplied",
    "TrainApply",
    "TrainBackward",
    "TrainForward",
    "TrainGrad",
    "TrainOpened",
    "TrainOutput",
    "TrainState",
    "TrainStateRequest",
    "TrainSync",
    "TrainSynced",
    "Replica",
    "MAX_REPLICAS",
    "Step",
    "StepResult",
    "decode",
    "encode",
    "expect",
]
