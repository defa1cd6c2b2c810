"""Sharding: what runs where. Loading a span of transformer blocks from a model folder, KV cache accounting, LoRA
adapter slices on a span, block assignment and rebalancing, and partitioning arbitrary computation graphs.

May import torch, transformers, safetensors, peft and bitsandbytes (both lazily) and nesa_node.routing snapshots;
never networking or hivemind. balancing, partition and brkga are pure (numpy over frozen inputs, explicit Generators); graph traces
modules with torch.fx and profiles them.

Modules: blocks (spans of decoder blocks), model_folder (what a model folder's files tell without torch), kv_cache (eq. 4 budget), lora (PEFT adapter slices of a span, eq. 6),
lora_identity (adapter manifests: per-block hashes, the adapter id), lora_rows (adapters applied per row of a pass), balancing (eq. 3: where a node joins, when
nodes move), graph (fx operation graph, stage split), partition (MTPP eq. 8-11, Algorithm 1's DP and a fast exact
DP), brkga (the biased random-key GA over topological orders), weights_manifest (per-block weight hashes), sparsity
(activation-sparsity predictors for ReLU models, off by default).
"""
