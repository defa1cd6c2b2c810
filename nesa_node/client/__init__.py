"""The client SDK: async first, with a synchronous Hugging Face style face over it.

  config         ClientConfig, one frozen settings object
  swarm          Swarm: one P2P host and client-mode DHT node, records, bans, round trips, unary calls
  routing        Router: eq. 18 chains on a live snapshot, with fallbacks
  session        InferenceSession: steps through a chain; session_chain: its links; failover: recovery
  async_model    AsyncDistributedModel: embeddings and LM head on the client, generation, many sessions at once
  model          DistributedModelForCausalLM: transformers' generate over AsyncDistributedModel

Never imports nesa_node.server (checked by `make lint`).
"""
