"""Tools for trying and testing nesa-node on one machine: process launcher for local swarms, fault injection
(chaos), accuracy evaluation, tiny seeded models and their training, and the `nesa-node demo`.

Never imported by the runtime (server, client, protocol): `make lint` checks it.
"""
