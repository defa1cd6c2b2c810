"""A request's token budget at the gateway (nesa_node/gateway/app.py `Gateway.budget`): bounded by the longest session
the swarm's nodes take, not only by the model's context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nesa_node.gateway.app import ApiError, ChatRequest, CompletionRequest, Gateway
from nesa_node.protocol.dht import NodeRecord
from nesa_node.protocol.records import NodeInfo, NodeState


def record(start: int, end: int, max_length: int, state: NodeState = NodeState.online) -> NodeRecord:
    info = NodeInfo(peer_id=f"Qm{start}{end}{max_length}", state=state, start_block=start, end_block=end,
                    dtype="float32", max_length=max_length)  # fmt: skip
    return NodeRecord(info, expiration_time=0.0)


def gateway(records: list[NodeRecord], model_limit: int = 32768) -> Gateway:
    gateway = Gateway.__new__(Gateway)  # budget reads the model's limit and the records at hand, nothing else
    gateway.max_length = model_limit
    gateway.model = SimpleNamespace(
        swarm=SimpleNamespace(records_at_hand=lambda: records), model_config=SimpleNamespace(num_hidden_layers=4)
    )
    return gateway


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_chat_without_max_tokens_gets_what_the_swarms_longest_session_leaves():
    # blocks 0:2 by a node of 4096 and one of 8192; blocks 2:4 by nodes of 4096 and 2048: a chain takes 4096
    records = [record(0, 2, 4096), record(0, 2, 8192), record(2, 4, 4096), record(2, 4, 2048)]
    assert gateway(records).swarm_max_length() == 4096
    assert gateway(records).budget(ChatRequest(**CHAT), prompt_tokens=96) == 4000
    assert gateway(records).budget(ChatRequest(**CHAT, max_tokens=10_000), prompt_tokens=96) == 4000
    assert gateway(records).budget(CompletionRequest(model="m", prompt="x"), prompt_tokens=96) == 16


def test_nodes_without_a_limit_draining_nodes_and_no_records():
    assert gateway([]).swarm_max_length() == 32768  # nothing at hand yet: the model's limit
    assert gateway([record(0, 4, 0)]).swarm_max_length() == 32768  # a node naming no limit: the model's
    assert gateway([record(0, 4, 1 << 20)], model_limit=2048).swarm_max_length() == 2048  # never past the model
    # a draining node takes no new session: the online one's limit counts
    assert gateway([record(0, 4, 8192, NodeState.draining), record(0, 4, 1024)]).swarm_max_length() == 1024
    # a record of blocks this model does not have (a forged one, another model's) sets no limit, as routing ignores it
    assert gateway([record(0, 4, 4096), record(1000, 1001, 1), record(3, 1 << 20, 1)]).swarm_max_length() == 4096


def test_a_prompt_past_the_swarms_limit_is_refused_naming_it():
    with pytest.raises(ApiError) as refused:
        gateway([record(0, 4, 512)]).budget(ChatRequest(**CHAT), prompt_tokens=600)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert "the longest session the swarm's nodes take is 512" in refused.value.message
