"""The image benchmarks on the tiny pipeline: bench.image_unet times each variant of the
UNet, and bench.compare_image times the raw pipeline compiled as Texel compiles it."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.compare_image import TINY, build_pipeline, raw_throughput
from bench.server import ROOT


def run_bench(module: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repository root, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, check=check, capture_output=True, text=True
    )


def test_image_unet_records_each_variant_with_the_command_and_commit(tmp_path):
    out = tmp_path / "cpu.jsonl"
    run_bench(
        "bench.image_unet",
        *["--size", "tiny", "--batch-sizes", "1,2", "--steps", "2", "--repeats", "1"],
        *["--variants", "eager,channels_last", "--out", str(out)],
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["batch_size"]) for r in records] == [
        ("eager", 1), ("eager", 2), ("channels_last", 1), ("channels_last", 2)
    ]  # fmt: skip
    for r in records:
        assert r["scenario"] == "image-unet" and r["images_per_s"] > 0
        assert r["command"].startswith("python -m bench.image_unet --size tiny")
        assert r["commit"] and r["gpu"]


def test_image_unet_refuses_an_unknown_variant():
    result = run_bench("bench.image_unet", "--variants", "eager,fast", check=False)
    assert result.returncode == 2 and "unknown variants ['fast']" in result.stderr


def test_raw_throughput_compiles_the_unet_when_asked(tmp_path, monkeypatch):
    """Compiled as Texel compiles it; the compilation itself is tested with the adapter
    (tests/test_image_adapter.py), so here the module is left as it is."""
    import torch

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compiled.append(kw) or m)
    model = build_pipeline(tmp_path, TINY, steps=2, guidance=7.5)
    assert raw_throughput(model, [1], 2, 7.5, repeats=1)[1] > 0
    assert not compiled
    assert raw_throughput(model, [1], 2, 7.5, repeats=1, compile="dynamic")[1] > 0
    assert compiled == [{"dynamic": True}]


def test_compare_image_records_each_level_with_texels_stage_times(tmp_path):
    """A real Texel serving the tiny pipeline over a socket: every record is in the
    results file, Texel's with the stage times its /metrics gave, and the built pipeline
    stays in --model-dir for the next run."""
    out, model = tmp_path / "cpu.jsonl", tmp_path / "sd"
    args = "--size tiny --batch-sizes 1,2 --steps 2 --repeats 1 --duration 2 --warmup 0.5"
    args += " --skip-nobatch --client-processes 2"
    run_bench("bench.compare_image", *args.split(), "--model-dir", str(model), "--out", str(out))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["server"], r["concurrency"]) for r in records] == [
        ("raw", 1), ("raw", 2), ("texel", 1), ("texel", 2)
    ]  # fmt: skip
    for r in records[2:]:
        assert r["client_processes"] == 2 and not r["errors"] and r["throughput_rps"] > 0
        assert r["stage_mean_ms"]["generate"] > 0 and "queue.wait" in r["stage_mean_ms"]
        assert r["server_mean_batch_size"] >= 1 and r["share_of_raw"] > 0
    assert (model / "model_index.json").exists() and (model / "unet").is_dir()
