"""bench.mixed's loads and shares of the alone figures, and bench.compare's engine-only
mode on the tiny formula model."""

from __future__ import annotations

import argparse
import json

from bench.common import commit
from bench.compare import engine_only, gpu_name
from bench.mixed import alone_figures, parse_loads, shares, with_shares
from tests.conftest import formula_png


def test_loads_are_formula_clients_plus_image_clients():
    assert parse_loads("128+0,0+8,128+8,16+8") == [(128, 0), (0, 8), (128, 8), (16, 8)]
    assert parse_loads("32") == [(32, 0)]


def test_clients_are_split_over_processes_none_of_them_empty():
    assert shares(128, 4) == [32, 32, 32, 32]
    assert shares(10, 4) == [3, 3, 2, 2]
    assert shares(2, 4) == [1, 1]


def alone(sharing: str, formula_clients: int, image_clients: int, rate: float) -> dict:
    side = "formula" if formula_clients else "image"
    return {"scenario": "mixed", "commit": commit(), "gpu": gpu_name(), "sharing": sharing,
            "formula_clients": formula_clients, "image_clients": image_clients,
            side: {"throughput_rps": rate}}  # fmt: skip


def test_a_mixed_load_is_measured_against_each_model_alone(tmp_path):
    records = [alone("priority", 128, 0, 1000.0), alone("priority", 0, 8, 6.0)]
    mixed = {"formula": {"throughput_rps": 600.0}, "image": {"throughput_rps": 3.0}}
    record = with_shares(mixed, alone_figures(records, tmp_path / "none.jsonl", "priority"))
    assert record["share_of_alone"] == {"formula": 0.6, "image": 0.5, "sum": 1.1}
    assert record["alone_sharing"] == "priority"


def test_a_run_without_alone_loads_takes_those_of_an_earlier_run_of_the_commit(tmp_path):
    out = tmp_path / "h200.jsonl"
    earlier = [alone("priority", 128, 0, 900.0), alone("priority", 0, 8, 5.0)]
    other_commit = {**alone("off", 128, 0, 1.0), "commit": "another"}
    out.write_text("".join(json.dumps(r) + "\n" for r in [*earlier, other_commit]))
    figures, sharing = alone_figures([], out, "off")
    assert (figures, sharing) == ({"formula": 900.0, "image": 5.0}, "priority")


def test_engine_only_serves_preprocessed_formulas_at_each_concurrency(tiny_models, tmp_path):
    images = [formula_png(text, size=(60 + 30 * i, 40)) for i, text in enumerate("abcd")]
    args = argparse.Namespace(
        model=str(tiny_models["formula"]), max_batch_size=4, max_wait_ms=10.0,
        concurrency=[2, 4], rates=[20.0], duration=1.0, warmup=0.2,
        out=tmp_path / "cpu.jsonl", argv=[],
    )  # fmt: skip
    records = engine_only(args, images)
    assert [(r["server"], r["concurrency"], r["mode"]) for r in records] == [
        ("engine-only", 2, "closed"), ("engine-only", 4, "closed"),
        ("engine-only", "poisson@20.0", "open"),
    ]  # fmt: skip
    for r in records:
        assert r["throughput_rps"] > 0 and r["errors"] == {}
        assert 1 <= r["server_mean_batch_size"] <= 4
    # Poisson arrivals at 20 a second for a second: about 20 requests, each answered.
    assert 5 <= records[-1]["requests"] <= 45
    assert len((tmp_path / "cpu.jsonl").read_text().splitlines()) == 3
