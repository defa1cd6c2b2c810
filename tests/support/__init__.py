"""Helpers shared by the tests: local swarms, tiny models, random graphs. Imported, never collected."""
