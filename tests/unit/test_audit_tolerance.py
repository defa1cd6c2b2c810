"""The tolerance an audit compares a node's committed window with: from the dtypes of the node, its auditors and
the client (client/audit.py `Auditor.tolerance`), not the client's alone."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nesa_node.client.audit import Auditor
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
