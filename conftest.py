"""The fixtures that the tests and the benchmarks' tests share (tests/fixtures.py), loaded
here at the root so that each session fixture exists once for both folders."""

pytest_plugins = ["tests.fixtures"]
