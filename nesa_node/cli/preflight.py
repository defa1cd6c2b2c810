"""Checks of a command line that need no heavy import (torch, hivemind, transformers: several seconds of a process's
start), made before the command begins: a mistyped peer address, a folder without config.json, a block range past
the model's end or settings that cannot work together are told in a fraction of a second, not after the imports.

Each check here is a necessary condition of one the command makes later with the real parser or loader, worded the
same: it never refuses a command line that the command itself would accept.
"""

from __future__ import annotations

import argparse

from nesa_node.errors import InitialPeersError
from nesa_node.sharding.model_folder import check_span, config_file, declared_blocks

# commands whose --model, when given, must be a Hugging Face model folder (and `run`'s, for a block node)
MODEL_FOLDER_COMMANDS = frozenset({"generate", "status", "gateway", "finetune", "privacy-check", "schema"})
PEER_PROTOCOLS = ("p2p", "ipfs")  # a multiaddr names its peer with /p2p/ID (/ipfs/ID is its older spelling)


def names_a_peer(address: str) -> bool:
    """Whether `address` has the form every peer multiaddr has: a leading slash and a /p2p/ID part. A necessary
    condition of nesa_node.peer.check_initial_peers, which parses the whole address."""
    if not address.startswith("/"):
        return False
    parts = address.split("/")
    return any(
        part in PEER_PROTOCOLS and index + 1 < len(parts) and parts[index + 1] for index, part in enumerate(parts)
    )


def check(args: argparse.Namespace) -> None:
    """Raise the error the command would raise later, for the mistakes that can be told now (module docstring)."""
    if args.command == "run":
        _check_run(args)
        return
    if args.command == "graph":  # a plan file is checked before the peers: `graph` makes its own checks in order
        return
    # in the order the commands check: the model folder, then the peers
    if args.command in MODEL_FOLDER_COMMANDS and isinstance(getattr(args, "model", None), str):
        config_file(args.model)  # ModelLoadError when the folder has none
    _check_peers(getattr(args, "initial_peers", None) or ())


def _check_peers(initial_peers) -> None:
    for address in initial_peers:
        if not names_a_peer(str(address)):
            raise InitialPeersError.not_an_address(address)


def _check_run(args: argparse.Namespace) -> None:
    if not (args.model and args.blocks):  # a graph stage: its plan is checked first, by the stage itself
        return
    # in the order and words of the node's own checks (server/node.py)
    if not args.initial_peers and not args.new_swarm:
        raise ValueError("give --initial-peers to join a swarm, or --new-swarm to start one")
    _check_peers(args.initial_peers)
    if args.cuda_graphs and not args.device.startswith("cuda"):
        raise ValueError(f"--cuda-graphs needs a CUDA device (--device cuda), not {args.device}")
    num_blocks = declared_blocks(args.model)
    if num_blocks is not None:
        check_span(args.blocks[0], args.blocks[1], num_blocks)


__all__ = ["check", "names_a_peer"]
