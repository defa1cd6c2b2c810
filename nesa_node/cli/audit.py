"""`nesa-node audit RECEIPTS.json`: check a client's receipts offline.

Checks every node key against the peer id it is listed under, every hop record's signature under its node's key,
every session's Merkle root recomputed from its records, the file's digest, and that the file is the canonical
spelling of its content (nesa_node/verification/audit.py lists the checks). Exit status: 0 when every check passes,
1 when one fails (each failure is listed), 2 when the file cannot be read or is not a receipts file.

The receipts say what each node signed it computed; whether it computed it correctly is tested by re-executing
windows, at the rate the receipts record.
"""

from __future__ import annotations

import argparse
import json

CHECK_FAILED = 1


def add_parser(commands) -> None:
    audit = commands.add_parser(
        "audit",
        help="check a receipts file offline: node signatures, peer ids, Merkle session roots",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    audit.add_argument("receipts", metavar="RECEIPTS.json", help="receipts file a client saved")
    audit.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run_audit(args) -> int:
    """Audit `args.receipts`; an unreadable or malformed file raises (OSError, ReceiptError), which the CLI's one
    error path prints as `error: [code] ...` with status 2."""
    from nesa_node.verification.audit import audit_file

    report = audit_file(args.receipts)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        _print_summary(args.receipts, report)
    return 0 if report.ok else CHECK_FAILED


def _print_summary(path: str, report) -> None:
    print(
        f"{path}: {report.records} records from {report.nodes} nodes in {report.sessions} sessions; "
        f"roots {report.roots_ok}/{report.sessions} recomputed equal; client re-executed "
        f"{report.audit_rate:.1%} of windows"
    )
    if report.ok:
        print("all signatures, peer ids, roots and the file digest check")
        return
    print(f"{len(report.failures)} failed checks:")
    for failure in report.failures:
        print(f"  {failure.check}: {failure.where}: {failure.detail}")
