"""What travels between peers: typed session messages and their safe decoding, the NodeInfo record and its DHT
storage, the tensor wire format, stream framing with limits, data lanes, and peer identities.

Shared by the node (nesa_node.server) and the client (nesa_node.client); imports neither. May import hivemind,
pydantic, msgpack, cryptography, torch (tensors) and nesa_node.compression (codecs).
"""
