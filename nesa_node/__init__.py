"""nesa-node: a peer-to-peer swarm that serves large language models split by transformer blocks.

The composition root: node daemon (server/), client SDK (client/), CLI, DHT records, wire messages.
Subpackages routing, topology and compression are pure; sharding has no networking; only this package talks to
the network. Heavy pieces (torch, transformers, hivemind) are imported by the modules that need them, not here.
"""

__version__ = "0.1.0"

__all__ = ["DistributedModelForCausalLM", "__version__"]


def __getattr__(name: str):
    if name == "DistributedModelForCausalLM":
        from nesa_node.client.model import DistributedModelForCausalLM

        return DistributedModelForCausalLM
    raise AttributeError(f"module 'nesa_node' has no attribute {name!r}")
