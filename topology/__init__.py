"""Topology: the swarm graph, persistent-homology snapshots and change detection.

Pure: numpy, networkx and gudhi math over frozen snapshots; no sockets, clocks, global RNG or hivemind.
"""
