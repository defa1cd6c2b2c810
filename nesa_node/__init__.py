"""nesa-node: a peer-to-peer swarm that serves large language models split by transformer blocks.

Packages, each importing only those listed before it (checked by `make lint`, contracts in pyproject.toml):
  errors, version      the error tree and the release: import nothing of the project
  compression, routing pure math over frozen inputs (numpy, torch); no networking
  sharding             what runs where: block spans, KV cache accounting, partitioning, rebalancing plans
  topology             persistent homology of swarm snapshots (gudhi, networkx); no networking
  protocol             what travels between peers: typed messages, records, tensors, framing, lanes
  peer, swarm_view     shared by node and client: starting a P2P host and DHT node, records -> routing snapshot
  server, client       the node daemon and the client SDK; neither imports the other
  graph                the computation-graph wing (stage nodes and their client)
  devtools             local swarms, fault injection, tiny models: tools never imported by server or client
  cli                  the `nesa-node` command
Heavy pieces (torch, transformers, hivemind) are imported by the modules that need them, not here.
"""

from nesa_node.version import __version__

__all__ = ["AsyncDistributedModel", "DistributedModelForCausalLM", "__version__"]


def __getattr__(name: str):
    if name == "DistributedModelForCausalLM":
        from nesa_node.client.model import DistributedModelForCausalLM

        return DistributedModelForCausalLM
    if name == "AsyncDistributedModel":
        from nesa_node.client.async_model import AsyncDistributedModel

        return AsyncDistributedModel
    raise AttributeError(f"module 'nesa_node' has no attribute {name!r}")
