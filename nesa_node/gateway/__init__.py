"""The OpenAI-compatible gateway: one process that is an async client of the swarm and serves HTTP (FastAPI)."""
