"""The server harness the benchmarks share with the tests: one implementation, owned by
the tests (`tests/server.py`)."""

from tests.server import ROOT, ServerProcess, free_port, otlp_sink

__all__ = ["ROOT", "ServerProcess", "free_port", "otlp_sink"]
