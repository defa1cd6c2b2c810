"""The node daemon: configuration, the RPC handler with per-session KV caches, and the `Node` composition root.

Never imported by the client.
"""
