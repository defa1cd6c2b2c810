"""Typed peer messages (nesa_node.protocol.messages): every kind round-trips, and `decode` refuses what a hostile peer
sends (unknown keys, wrong types, oversized fields, deep nesting, extension types, too many bytes) with a typed error
before any model is built. The same checks against a live node are tests/swarm/test_bad_input.py's
`test_g_*_messages_refuse_*`."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.errors import BadRequestError, QuotaExceededError, RequestError
from nesa_node.protocol.messages import (
    FORWARD,
    FORWARD_ANSWERS,
    FROM_SESSION,
    GRAPH,
    GRAPH_ANSWERS,
    INFO_ANSWERS,
    MAX_METADATA_BYTES,
    PUSHED,
    TICKET_ANSWERS,
    TO_SESSION,
    ErrorReply,
    ForwardRequest,
    ForwardResult,
    GraphForward,
    GraphResult,
    History,
    HistoryRequest,
    InfoReply,
    LaneSettings,
    LaneTicket,
    Opened,
    OpenSession,
    Retarget,
    Retargeted,
    Step,
    StepResult,
    decode,
    encode,
)
from nesa_node.protocol.tensors import WireCodec

PEER = "QmNRt2vWaWd4WctxmbWiyNSt6SRdkaBhYfTm7ogJnu1Mp5"  # a valid base58 libp2p peer id
KEY = "ab" * 32

EXAMPLES = [
    (TO_SESSION, OpenSession(session_id="s1", start_block=0, end_block=2, batch=1, max_length=16)),
    (
        TO_SESSION,
        OpenSession(
            session_id="s1",
            start_block=1,
            end_block=3,
            batch=2,
            max_length=64,
            upstream=PEER,
            next=PEER,
            output_codec=WireCodec.of("blockwise8", block_size=128),
            lane=LaneSettings(key_in=KEY, key_out=KEY, next="127.0.0.1:4000"),
        ),
    ),
    (TO_SESSION, Step(step_id="s1:0", position=0, codec=WireCodec.of("fp16"), compute_s=0.25, replay=True)),
    (TO_SESSION, HistoryRequest(position=5)),
    (TO_SESSION, Retarget(next=None, lane=LaneSettings(key_out=KEY, next=None))),
    (TO_SESSION, Retarget(upstream=PEER)),
    (PUSHED, Step(step_id="s1:3", position=3, session_id="s1")),
    (FROM_SESSION, Opened(cache_tokens_left=100)),
    (FROM_SESSION, StepResult(step_id="s1:0", position=0, compute_s=0.1, codec=WireCodec.of("bf16"), replayed=True)),
    (FROM_SESSION, History(position=4)),
    (FROM_SESSION, Retargeted()),
    (FROM_SESSION, ErrorReply(code="bad_request", message="no", step_id="s1:0")),
    (FORWARD, ForwardRequest(start_block=0, end_block=4, codec=WireCodec.of("dynamic8"))),
    (FORWARD_ANSWERS, ForwardResult(compute_s=0.5)),
    (INFO_ANSWERS, InfoReply(info="{}")),
    (TICKET_ANSWERS, LaneTicket(ticket="0f" * 16, key=KEY, lane="[::1]:80")),
    (GRAPH, GraphForward(plan="graph-x", stage=1, names=("x", "y"))),
    (GRAPH_ANSWERS, GraphResult(names=("z",), compute_s=0.0)),
]


@pytest.mark.parametrize(("kinds", "message"), EXAMPLES, ids=[f"{m.kind}-{i}" for i, (_, m) in enumerate(EXAMPLES)])
def test_every_message_kind_round_trips(kinds, message):
    decoded = decode(encode(message), kinds)
    assert decoded == message
    assert decoded.model_fields_set - {"kind"} == message.model_fields_set - {"kind"}  # given fields stay given


def test_a_field_given_its_default_still_travels():
    """Retarget(next=None) means "answer the client", a Retarget without next "keep the next node"."""
    assert "next" in decode(encode(Retarget(next=None)), TO_SESSION).model_fields_set
    assert "next" not in decode(encode(Retarget(upstream=PEER)), TO_SESSION).model_fields_set


def raw(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


OPEN = {"kind": "open", "session_id": "s1", "start_block": 0, "end_block": 2, "batch": 1, "max_length": 16}
STEP = {"kind": "step", "step_id": "s1:0", "position": 0}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({**OPEN, "sideways": 1}, "sideways: Extra inputs are not permitted"),
        ({**OPEN, "lane": {"in": KEY, "up": 1}}, "lane.up: Extra inputs are not permitted"),
        ({**STEP, "replay": 1}, "replay: Input should be a valid boolean"),
        ({**OPEN, "batch": True}, "batch: Input should be a valid integer"),
        ({**OPEN, "batch": "1"}, "batch: Input should be a valid integer"),
        ({**STEP, "position": 1.0}, "position: Input should be a valid integer"),
        ({**OPEN, "session_id": "s" * 129}, "session_id: String should have at most 128 characters"),
        ({**OPEN, "session_id": "a\r\nb"}, "session_id: String should match pattern"),
        ({**OPEN, "max_length": 1 << 40}, "max_length: Input should be less than or equal to"),
        ({**OPEN, "start_block": 3}, "start_block 3 must be below end_block 2"),
        ({**OPEN, "next": "not-a-peer-id"}, "next: Value error, not a valid peer id"),
        ({**STEP, "codec": {"name": "zstd"}}, "codec: Value error, unknown codec"),
        ({**STEP, "compute_s": float("nan")}, "compute_s: Input should be a finite number"),
        ({"kind": "shutdown"}, "does not match any of the expected tags"),
        ({"step_id": "x"}, "Unable to extract tag using discriminator 'kind'"),
    ],
)
def test_unknown_keys_wrong_types_and_oversized_fields_are_typed_errors(value, message):
    with pytest.raises(BadRequestError, match=message.replace("(", r"\(")) as error:
        decode(raw(value), TO_SESSION)
    assert error.value.code == "bad_request"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (raw([1, 2, 3]), "a message is a map"),
        (b"\xc1", "not valid msgpack"),
        (b"\xd4\x01\x00", "extension type 1 is not accepted"),  # hivemind's tuple extension, which recursed
        (raw({**STEP, "nested": [[[[["deep"]]]]]}), "nested deeper than 4 levels"),
        (raw({1: "a"}), "not valid msgpack"),  # integer keys
        (raw({**STEP, "pad": "x" * MAX_METADATA_BYTES}), f"exceeds {MAX_METADATA_BYTES}"),
    ],
)
def test_bytes_that_are_not_a_small_message_are_refused_before_validation(payload, message):
    with pytest.raises(BadRequestError, match=message):
        decode(payload, TO_SESSION)


def test_a_message_of_another_direction_is_refused():
    with pytest.raises(BadRequestError, match="does not match any of the expected tags"):
        decode(encode(Opened(cache_tokens_left=1)), TO_SESSION)
    with pytest.raises(BadRequestError, match="Input should be 'step'"):
        decode(encode(HistoryRequest(position=1)), PUSHED)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_give_a_typed_error_or_a_message(payload):
    for kinds in (TO_SESSION, FROM_SESSION, PUSHED, FORWARD):
        try:
            decode(payload, kinds)
        except BadRequestError:
            pass


nested = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["kind", "step_id", "position", "codec", "lane", "x"]), nested, max_size=6))
def test_random_maps_give_a_typed_error_or_a_valid_message(value):
    try:
        message = decode(raw(value), TO_SESSION)
    except BadRequestError:
        return
    assert decode(encode(message), TO_SESSION) == message


def test_bytes_where_text_belongs_is_a_typed_error():
    """msgpack's strict_map_key still admits bytes keys: a codec map with one is refused like any bad field."""
    for value in ({**STEP, "codec": {"name": "none", b"x": 1}}, {**STEP, "codec": {b"name": "none"}}):
        with pytest.raises(BadRequestError):
            decode(raw(value), TO_SESSION)
    with pytest.raises(BadRequestError):
        decode(raw({**STEP, b"replay": True}), TO_SESSION)


def test_the_design_document_lists_the_kinds_each_receiver_accepts():
    """docs/ARCHITECTURE.md's table of unions names exactly the kinds each union of messages.py decodes."""
    import re
    from pathlib import Path

    from pydantic import TypeAdapter

    from nesa_node.protocol import messages

    text = (Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| `([A-Z_]+)` \| [^|]+ \| ([^|]+) \|$", text, flags=re.M)
    documented = {name: set(re.findall(r"`(\w+)`", kinds)) for name, kinds in rows}
    unions = {name: value for name, value in vars(messages).items() if isinstance(value, TypeAdapter)}
    assert set(documented) == set(unions)
    assert {name: set(messages.accepted_kinds(union)) for name, union in unions.items()} == documented


@pytest.mark.parametrize("code", ["no_route", "model_load", "device", "port_in_use", "identity", "session_state"])
def test_a_peer_cannot_name_an_error_only_this_process_can_meet(code):
    """A node's ErrorReply naming, say, `no_route` is a refusal of the request by that node, not the client's own
    finding that no route exists: it is rebuilt as a RequestError that keeps the code."""
    error = ErrorReply(code=code, message="from a peer").error()
    assert type(error) is RequestError and error.code == code
    assert type(ErrorReply(code="quota", message="full").error()) is QuotaExceededError
