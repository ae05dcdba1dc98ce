"""bench.compare: the model-only ceiling (every image decoded once, in width-sorted
batches), and the stage and request percentiles read from a real server's /metrics."""

from __future__ import annotations

import numpy as np

from bench.compare import model_only, model_only_batches, quantile, scrape, texel_extras
from models.formula.preprocess import FormulaInput
from tests.conftest import formula_png


def strip(width: int) -> FormulaInput:
    return FormulaInput(np.zeros((8, width), np.uint8), width)


def test_model_only_batches_decode_every_image_once_sorted_by_width():
    items = [strip(w) for w in (300, 40, 520, 40, 96, 700, 64)]
    batches = model_only_batches(items, 3)
    assert [len(b) for b in batches] == [3, 3, 1]
    flat = [item for batch in batches for item in batch]
    assert sorted(map(id, flat)) == sorted(map(id, items)), "each image exactly once"
    assert [item.width for item in flat] == [40, 40, 64, 96, 300, 520, 700]


def test_a_lone_image_of_a_bucket_is_not_repeated_to_fill_a_batch():
    items = [strip(40)] * 5 + [strip(900)]
    batches = model_only_batches(items, 4)
    assert [len(b) for b in batches] == [4, 2]
    assert [item.width for item in batches[1]] == [40, 900]


def test_model_only_runs_the_tiny_model_on_a_cpu(tiny_models):
    images = [formula_png(text, size=(60 + 40 * i, 40)) for i, text in enumerate("abcde")]
    results = model_only(str(tiny_models["formula"]), images, [1, 4], budget_s=30)
    assert [r["batch_size"] for r in results] == [1, 4]
    assert all(r["throughput_rps"] > 0 for r in results)


def test_quantile_interpolates_within_the_bucket_of_the_rank_as_prometheus_does():
    before = {"request_le:0.1": 10.0, "request_le:0.2": 10.0, "request_le:+Inf": 10.0}
    after = {"request_le:0.1": 60.0, "request_le:0.2": 100.0, "request_le:+Inf": 110.0}
    # 100 new observations: 50 under 0.1 s, 40 in (0.1, 0.2], 10 past every bound.
    assert quantile(0.5, "request", before, after) == 0.1
    assert abs(quantile(0.7, "request", before, after) - 0.15) < 1e-9
    assert quantile(0.99, "request", before, after) == 0.2  # past the largest bound
    assert quantile(0.99, "request", after, after) is None  # nothing observed between


def test_stage_percentiles_come_from_a_real_servers_metrics(server):
    before = scrape(server.url)
    with server.client() as client:
        for i in range(6):
            files = {"image": ("f.png", formula_png(f"x^{i}"), "image/png")}
            response = client.post("/recognize", files=files)
            assert response.status_code == 200, response.text
    extras = texel_extras(before, scrape(server.url))
    p99 = extras["stage_p99_ms"]
    assert {"generate", "preprocess", "queue.wait", "request"} <= set(p99)
    assert all(value is not None and value >= 0 for value in p99.values())
    # A whole request takes longer than any one of its stages, so its p99 does too.
    assert p99["request"] >= max(value for stage, value in p99.items() if stage != "request")
    assert extras["event_loop_lag_p99_ms"] is not None  # sampled every 100 ms
    # The garbage collector's pauses are reported (how many collections fall in a window
    # is the interpreter's business, so no count is asserted).
    assert {"gc_pauses", "gc_pause_mean_ms", "gc_pause_p99_ms"} <= set(extras)
