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


# The files that keep a worker busiest (`pytest --durations=0`), first: `make test` gives
# the workers whole files in collection order (`--dist loadfile --no-loadscope-reorder`),
# and one of these left for the end keeps one worker busy while the other has finished.
LONGEST_FIRST = (
    "tests/test_processes.py",
    "tests/test_default_models.py",
    "tests/test_serving_behaviour.py",
    "tests/test_image_adapter.py",
    "bench/tests/test_bench_image.py",
    "tests/test_startup_errors.py",
    "tests/test_hostile_input.py",
    "tests/test_cli_recognize.py",
    "tests/test_fast_decode.py",
    "tests/test_backends_phoenix.py",
    "tests/test_api.py",
    "tests/test_observability_processes.py",
)


def pytest_collection_modifyitems(items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
