"""The benchmarks' tests borrow the test suite's fixtures: tiny models built from configs,
a warmed-up tiny recognizer, and a real Texel server on a free port."""

from tests.conftest import server, tiny_env, tiny_models, tiny_recognizer

__all__ = ["server", "tiny_env", "tiny_models", "tiny_recognizer"]
