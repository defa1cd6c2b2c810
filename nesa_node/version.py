"""The release of nesa-node, announced in every NodeInfo record. Imports nothing."""

__version__ = "0.1.0"
