"""What a server's start costs: seconds until /livez and /readyz answer 200, and each
process's CPU seconds and memory (RSS, and PSS, which splits pages that processes share
between them) once it is ready. Runs `texel serve` as it is in this checkout, so a
worktree of another commit measures that commit the same way.

    python -m bench.startup --http-processes 2 --runs 3 [--formula DIR --image DIR]

Without models given, the tests' tiny models are built from their configs (no weights
downloaded); a table is printed and, with --out, one JSON line per run appended."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from bench.common import commit as git_commit
from bench.server import ServerProcess


def tiny_models(root: Path) -> dict[str, str]:
    from training.tiny import build_tiny_formula_model, build_tiny_image_pipeline

    return {
        "formula": str(build_tiny_formula_model(root / "formula")),
        "image": str(build_tiny_image_pipeline(root / "image")),
    }


def measure(env: dict[str, str]) -> dict:
    started = time.monotonic()
    server = ServerProcess(env, wait_ready=False)
    try:
        live = time.monotonic() - started
        server.wait_ready()
        ready = time.monotonic() - started
        launcher = psutil.Process(server.process.pid)
        processes = {}
        for process in [launcher, *launcher.children(recursive=True)]:
            with process.oneshot():
                name = "launcher" if process.pid == launcher.pid else process.name()
                memory = process.memory_full_info()
                processes[name] = {
                    "cpu_s": round(sum(process.cpu_times()[:2]), 2),
                    "rss_mb": round(memory.rss / 2**20),
                    "pss_mb": round(memory.pss / 2**20),
                }
        return {"live_s": round(live, 2), "ready_s": round(ready, 2), "processes": processes}
    finally:
        server.stop()


def measure_runs(args: argparse.Namespace, models: dict[str, str]) -> list[dict]:
    env = {
        "TEXEL_DEVICE": "cpu",
        "TEXEL_HTTP_PROCESSES": str(args.http_processes),
        "TEXEL_FORMULA__MODEL": args.formula or models["formula"],
        "TEXEL_IMAGE__MODEL": args.image or models["image"],
        "OTEL_SDK_DISABLED": "true",
    }
    commit = git_commit()
    runs = []
    for run in range(args.runs):
        result = measure(env)
        runs.append(result)
        if args.out:
            record = {"bench": "startup", "commit": commit, "run": run, **result,
                      "http_processes": args.http_processes}  # fmt: skip
            with args.out.open("a") as out:
                out.write(json.dumps(record) + "\n")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-processes", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--formula", help="formula model folder (default: a tiny one)")
    parser.add_argument("--image", help="image model folder (default: a tiny one)")
    parser.add_argument("--out", type=Path, help="append one JSON line per run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="texel-startup-") as scratch:
        models = tiny_models(Path(scratch)) if not (args.formula and args.image) else {}
        runs = measure_runs(args, models)
    names = sorted({name for result in runs for name in result["processes"]})
    count = len(runs)
    print(f"commit {git_commit()}, {args.http_processes} HTTP processes, median of {count} runs")
    print(f"{'':16} {'CPU s':>7} {'RSS MB':>7} {'PSS MB':>7}")
    for name in names:
        rows = [r["processes"][name] for r in runs if name in r["processes"]]
        cells = [
            statistics.median(row[key] for row in rows) for key in ("cpu_s", "rss_mb", "pss_mb")
        ]
        print(f"{name:16} {cells[0]:7.2f} {cells[1]:7.0f} {cells[2]:7.0f}")
    total = [sum(p["cpu_s"] for p in r["processes"].values()) for r in runs]
    pss = [sum(p["pss_mb"] for p in r["processes"].values()) for r in runs]
    print(f"{'all':16} {statistics.median(total):7.2f} {'':>7} {statistics.median(pss):7.0f}")
    live = statistics.median(r["live_s"] for r in runs)
    ready = statistics.median(r["ready_s"] for r in runs)
    print(f"/livez 200 after {live:.1f} s, /readyz 200 after {ready:.1f} s")


if __name__ == "__main__":
    main()
