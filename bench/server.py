"""The server harness the benchmarks share with the tests: one implementation, owned by
the tests (`tests/server.py`), with the recognition cache off unless a run turns it on:
benchmark clients cycle through a fixed set of images, and what they measure is
recognition, not the cache."""

from tests.server import ROOT, free_port, otlp_sink
from tests.server import ServerProcess as _ServerProcess

__all__ = ["ROOT", "ServerProcess", "free_port", "otlp_sink"]


class ServerProcess(_ServerProcess):
    def __init__(self, env: dict[str, str], *args, **kwargs) -> None:
        super().__init__({"TEXEL_FORMULA__CACHE_MB": "0", **env}, *args, **kwargs)
