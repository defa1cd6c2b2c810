"""The tolerance an audit compares a node's committed window with: from the dtypes of the node, its auditors and
the client (client/audit.py `Auditor.tolerance`), not the client's alone; and what an audit carries from one hop to
the next once an auditor is found to have lied."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nesa_node.client.audit import Auditor, AuditOutcome
from nesa_node.verification.commitment import BFLOAT16_TOLERANCE, DEFAULT_TOLERANCE

ANY = ("float32", "float16", "bfloat16")  # Swarm.answer_dtypes of a node whose record is not at hand


def auditor(client_dtype: torch.dtype, records: dict[str, str]) -> Auditor:
    """An auditor of a client computing in `client_dtype` that sees the nodes' records `records` (peer id: the dtype
    it announces; "bogus": one no node computes in)."""

    def answer_dtypes(peer_id: str) -> tuple[str, ...]:
        if peer_id not in records:
            return ANY
        return (records[peer_id],) if records[peer_id] in ANY else ()

    return Auditor(SimpleNamespace(dtype=client_dtype, swarm=SimpleNamespace(answer_dtypes=answer_dtypes)), 1.0)


def test_a_bfloat16_node_audited_by_float32_nodes_gets_bfloat16s_tolerance_whatever_the_clients_dtype():
    records = {"node": "bfloat16", "auditor": "float32", "other": "float32"}
    assert auditor(torch.float32, records).tolerance({"node", "auditor"}) == BFLOAT16_TOLERANCE
    assert auditor(torch.float32, records).tolerance({"other", "auditor"}) == DEFAULT_TOLERANCE
    assert auditor(torch.float16, records).tolerance({"auditor"}) == DEFAULT_TOLERANCE


def test_a_bfloat16_client_or_a_node_of_unknown_dtype_widens_it():
    records = {"auditor": "float32", "bogus": "float64"}
    assert auditor(torch.bfloat16, records).tolerance({"auditor"}) == BFLOAT16_TOLERANCE
    assert auditor(torch.float32, records).tolerance({"auditor", "unseen"}) == BFLOAT16_TOLERANCE
    assert auditor(torch.float32, records).tolerance({"auditor", "bogus"}) == BFLOAT16_TOLERANCE


INPUTS = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))  # the first node's input: 4 tokens
HONEST = [lambda hidden: hidden * 2.0 + 1.0, lambda hidden: hidden.tanh() * 3.0]  # hop 0's blocks, hop 1's


def two_hop_audit(inputs: list[torch.Tensor], outputs: list[torch.Tensor], *, direct: bool, reexecute):
    """The outcome of auditing a session of two hops (blocks 0:2 and 2:4, one window of 4 tokens) whose nodes
    committed to `outputs`, the client having kept `inputs` (the first node's; in relay mode, each node's), with
    `reexecute` standing for the auditors; and the peers the swarm was told to blame."""
    import asyncio

    from nesa_node.verification.commitment import commit_window
    from nesa_node.verification.receipts import HopRecord

    hops = [SimpleNamespace(peer_id=f"node{index}", start_block=2 * index, end_block=2 * index + 2) for index in (0, 1)]
    records = [
        HopRecord("s", index, 2 * index, 2 * index + 2, 0, 0, 4, b"\0" * 32, commit_window(outputs[index]).to_bytes(),
                  "w", "", "none", f"node{index}")
        for index in (0, 1)
    ]  # fmt: skip
    session = SimpleNamespace(
        chain=SimpleNamespace(hops=hops), records=records, links=SimpleNamespace(recoded=set(), direct=direct),
        position=4, _inputs=[[each] for each in inputs], output_codecs={},
    )  # fmt: skip
    blamed: list[str] = []
    model = SimpleNamespace(
        dtype=torch.float32,
        swarm=SimpleNamespace(answer_dtypes=lambda peer_id: ("float32",), blame=lambda peer, **_: blamed.append(peer)),
    )
    audit = Auditor(model, 1.0)
    audit._reexecute = reexecute
    return asyncio.run(audit._audit(session, AuditOutcome(1.0))), blamed


def test_a_check_an_auditor_lied_in_stops_the_audit_before_it_feeds_a_later_hop():
    """Hop 0's first auditor lies (its re-execution differs from the honest commitment), and the confirmation on
    another node clears the audited node: inconclusive. That auditor's output must not become hop 1's input, or the
    honest node of hop 1, checked against a lie, would be blamed. The audit stops there; nobody is blamed."""

    async def reexecute(session_, start, end, hidden, *, exclude):
        index = start // 2
        if index == 0 and exclude == {"node0"}:  # the first auditor of hop 0: a liar
            return hidden * 5.0, {"liar"}
        return HONEST[index](hidden), {f"auditor{index}-{len(exclude)}"}

    outputs = [HONEST[0](INPUTS), HONEST[1](HONEST[0](INPUTS))]
    outcome, blamed = two_hop_audit([INPUTS], outputs, direct=True, reexecute=reexecute)
    assert blamed == [] and outcome.blamed == []
    assert outcome.checks["inconclusive"] == 2 and outcome.checks["passed"] == 0  # hop 0's window, hop 1's unchecked


def test_a_relay_chain_is_audited_on_what_the_client_sent_each_node():
    """In relay mode the client sends every node its input (re-encoded per hop: with `auto`, a prefill may go out
    compressed though the node before answered lossless). Each hop is re-executed on the input the client kept, as
    that node decoded it, not on a model of it from the hop before, which would fail an honest node's window."""

    async def reexecute(session_, start, end, hidden, *, exclude):
        return HONEST[start // 2](hidden), {f"auditor-{start}-{len(exclude)}"}

    second_input = HONEST[0](INPUTS) * 1.02  # what the second node decoded: the first's output, sent re-encoded
    outputs = [HONEST[0](INPUTS), HONEST[1](second_input)]
    outcome, blamed = two_hop_audit([INPUTS, second_input], outputs, direct=False, reexecute=reexecute)
    assert blamed == [] and outcome.checks["passed"] == 2 and outcome.checks["failed"] == 0
