"""Topology: the swarm graph, persistent-homology snapshots, change detection, node stability and triggers.

Pure: numpy, scipy, networkx and gudhi math over frozen snapshots; no sockets, clocks, global RNG or hivemind. May
import nesa_node.routing (snapshots; the simulator, in life.py only) and nesa_node.sharding.balancing (pure). gudhi
is imported lazily inside the functions that need it, so importing this package does not load it.

Modules: graph (snapshot -> weighted graph and metric space), homology (H0/H1 diagrams, features, distances),
monitor (change threshold learned from noise, snapshot history, per-node stability for eq. 18's R_A), triggers
(homology, load variation, periodic), life (hours of swarm life on routing/simulate.py under a trigger), schemas
(precomputed sharding schemas per topology class and the classifier that picks one, sec. 2.7.1).
"""
