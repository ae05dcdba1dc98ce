"""Metrics in prometheus_client's multiprocess mode, as the launcher runs them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

# Collections run often (cycles, a low threshold) while labelled children are created:
# every child's creation takes prometheus_client's one multiprocess lock and allocates.
GC_DURING_UPDATES = textwrap.dedent(
    """
    import faulthandler, gc, os, tempfile
    faulthandler.dump_traceback_later(60, exit=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
    from telemetry import bottleneck, metrics
    bottleneck.watch_garbage_collector()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50, 1, 1)
    for i in range(3000):
        junk = [[] for _ in range(3)]
        junk[0].append(junk)
        metrics.STAGE_DURATION.labels(f"m{i % 500}", f"s{i}").observe(0.001)
    bottleneck.record_collections()
    paused = sum(
        s.value for f in metrics.families() for s in f.samples
        if s.name == "texel_gc_pause_seconds_count"
    )
    print("collections", int(paused))
    """
)


def test_a_garbage_collection_inside_a_metric_update_does_not_deadlock() -> None:
    done = subprocess.run(
        [sys.executable, "-c", GC_DURING_UPDATES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0, "the collections reach the histogram"
