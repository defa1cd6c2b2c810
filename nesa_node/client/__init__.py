"""The client SDK: swarm access (P2P host and client-mode DHT), inference sessions, and the HF-style model.

Never imports nesa_node.server.
"""
