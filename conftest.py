"""The fixtures that the tests and the benchmarks' tests share (tests/fixtures.py), loaded
here at the root so that each session fixture exists once for both folders."""

import os

# Under pytest-xdist (`make test`) each worker, and every server it starts, computes on
# its share of the cores: torch's threads waiting for each other on cores that the other
# worker holds make both slower. Set here, before anything imports torch.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))

pytest_plugins = ["tests.fixtures"]
