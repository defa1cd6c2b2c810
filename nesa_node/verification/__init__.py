"""Verification of untrusted nodes: per-hop commitments, signed hop records, Merkle session roots and receipts.

    commitment  WindowCommitment of a 32-token window's output, its check against a re-execution, input hashes
    merkle      domain-separated Merkle roots and inclusion proofs
    receipts    HopRecord (signed per hop and window), RecordSigner, ReceiptsBuilder, SessionReceipts and its file
    audit       audit(receipts) / audit_file(path): signatures, peer ids and roots, checked offline

Pure apart from reading and writing a receipts file: no network, no clock. May import nesa_node.errors,
nesa_node.protocol (identity keys and id types), torch, numpy, msgpack and cryptography; never the client, server or
cli. Nothing is re-exported here, so importing the package does not import torch.
"""
