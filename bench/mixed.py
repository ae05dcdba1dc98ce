"""Formulas and images from one Texel on one GPU at once: how the two models share it.

    python -m bench.mixed --data ../shared/data --loads 128+0,0+8,128+8,16+8

One server with the formula model (`--model`, the shipped one by default, batches of at
most `--max-batch-size`) and a Stable Diffusion pipeline with random weights (`--size
sd15`: SD 1.5's shapes at 512x512, `--steps` steps, batches of at most
`--image-batch-size`; built once as bench.compare_image builds it, kept in
`--model-dir`), the GPU shared as `--sharing` says (`TEXEL_ADVANCED__GPU_SHARING`). Each
load `F+I` runs F closed-loop formula clients (real im2latex images, split over
`--client-processes` processes) and I image clients (`--image-client-processes`) at the
same time, for `--duration` s after `--warmup` s. Each load's record gives both sides'
throughput and latency, each model's device time and mean time in each stage from
Texel's /metrics (`texel_device_seconds_total`, `texel_stage_duration_seconds`), and
against the loads with one model alone (of this run, else the latest of the same commit
in the results file, of the same sharing where it has them) each side's share of its
alone throughput and their sum. Records are appended to `--out`
(`bench/results/<gpu>.jsonl` by default) as each load is measured; a table is printed
last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import append_records, commit, formula_images, settings_env
from bench.compare import gpu_name, gpu_results_file, json_workload
from bench.compare_image import PROMPTS, SHAPES, build_pipeline
from bench.load import LoadResult, Workload, closed_loop
from bench.server import ROOT, ServerProcess

SIDES = ("formula", "image")


def parse_loads(text: str) -> list[tuple[int, int]]:
    """`128+0,0+8` -> [(128, 0), (0, 8)]: formula clients + image clients."""
    loads = []
    for part in text.split(","):
        formulas, _, images = part.partition("+")
        loads.append((int(formulas), int(images or 0)))
    return loads


def shares(concurrency: int, processes: int) -> list[int]:
    """`concurrency` clients split over at most `processes` processes, none empty."""
    processes = max(1, min(processes, concurrency))
    return [concurrency // processes + (i < concurrency % processes) for i in range(processes)]


def mixed_closed_loop(
    url: str,
    workloads: dict[str, tuple[Workload, int, int]],
    duration_s: float,
    warmup_s: float,
) -> dict[str, LoadResult]:
    """Every side's closed loop at once: side -> (workload, clients, processes), each side
    split over its processes, all started together; each side's results pooled."""
    context = multiprocessing.get_context("fork")  # the workloads' closures do not pickle
    results = context.Queue()

    def client(side: str, workload: Workload, share: int) -> None:
        results.put((side, asyncio.run(closed_loop(url, workload, share, duration_s, warmup_s))))

    children = [
        context.Process(target=client, args=(side, workload, share))
        for side, (workload, clients, processes) in workloads.items()
        if clients
        for share in shares(clients, processes)
    ]
    for child in children:
        child.start()
    parts = [results.get(timeout=duration_s + warmup_s + 300) for _ in children]
    for child in children:
        child.join()
    pooled = {}
    for side, (_, clients, _) in workloads.items():
        mine = [part for name, part in parts if name == side]
        if not mine:
            continue
        result = LoadResult("closed", clients, max(part.duration_s for part in mine))
        for part in mine:
            result.latencies_s += part.latencies_s
            result.statuses.update(part.statuses)
            result.batch_sizes += part.batch_sizes
        pooled[side] = result
    return pooled


def scrape(url: str) -> dict:
    """What a load's record takes from Texel's /metrics: `texel_device_seconds_total` by
    model (summed over devices), and each (model, stage)'s total and count of
    `texel_stage_duration_seconds`."""
    device: dict[str, float] = {}
    stages: dict[str, list[float]] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("texel_device_seconds_total{"):
            model = label(line, "model")
            device[model] = device.get(model, 0.0) + float(line.rsplit(" ", 1)[1])
        for i, suffix in enumerate(("_sum{", "_count{")):
            if line.startswith("texel_stage_duration_seconds" + suffix):
                key = f"{label(line, 'model')} {label(line, 'stage')}"
                stages.setdefault(key, [0.0, 0.0])[i] += float(line.rsplit(" ", 1)[1])
    return {"device": device, "stages": stages}


def label(line: str, name: str) -> str:
    return line.split(f'{name}="', 1)[1].split('"', 1)[0]


def stage_means(before: dict, after: dict) -> dict[str, float]:
    """Mean ms of each "model stage" over a load (warm-up included, as the counters run)."""
    means = {}
    for key, (total, count) in after["stages"].items():
        total0, count0 = before["stages"].get(key, (0.0, 0.0))
        if count > count0:
            means[key] = round((total - total0) / (count - count0) * 1000, 2)
    return means


def side_summary(result: LoadResult | None) -> dict | None:
    if result is None:
        return None
    s = result.summary()
    kept = ("throughput_rps", "mean_ms", "p50_ms", "p95_ms", "p99_ms", "requests", "errors")
    return {k: s[k] for k in kept}


def alone_figures(records: list[dict], out: Path, sharing: str) -> tuple[dict[str, float], str]:
    """Each side's throughput alone, and the sharing it was measured with: from this
    run's records, else the latest records of the same commit and GPU in `out`, of the
    same sharing where there are any (one model alone does not share the GPU)."""
    earlier = []
    if out.exists():
        for line in out.read_text().splitlines():
            try:
                earlier.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    by_sharing: dict[str, dict[str, float]] = {}
    for r in [*earlier, *records]:  # later ones win
        if r.get("scenario") != "mixed" or r.get("commit") != commit():
            continue
        if r.get("gpu") != gpu_name():
            continue
        clients = {"formula": r["formula_clients"], "image": r["image_clients"]}
        for side, other in (("formula", "image"), ("image", "formula")):
            if clients[side] and not clients[other] and r.get(side):
                by_sharing.setdefault(r["sharing"], {})[side] = r[side]["throughput_rps"]
    if sharing in by_sharing and len(by_sharing[sharing]) == 2:
        return by_sharing[sharing], sharing
    complete = [name for name, found in by_sharing.items() if len(found) == 2]
    if complete:
        return by_sharing[complete[-1]], complete[-1]
    return by_sharing.get(sharing, {}), sharing


def with_shares(record: dict, alone: tuple[dict[str, float], str]) -> dict:
    """The record with each side's share of its alone throughput, their sum, and which
    sharing the alone figures were measured with."""
    alone, alone_sharing = alone
    share = {}
    for side in SIDES:
        if record.get(side) and alone.get(side):
            share[side] = round(record[side]["throughput_rps"] / alone[side], 3)
    if len(share) == 2:
        share["sum"] = round(share["formula"] + share["image"], 3)
    return {**record, "share_of_alone": share or None, "alone_sharing": alone_sharing}


def served_env(args, image_model: Path) -> dict[str, str]:
    return {
        "TEXEL_FORMULA__MODEL": args.model,
        "TEXEL_FORMULA__MAX_BATCH_SIZE": str(args.max_batch_size),
        "TEXEL_FORMULA__MAX_QUEUE": str(4 * max(f for f, _ in args.loads) + 64),
        "TEXEL_IMAGE__MODEL": str(image_model),
        "TEXEL_IMAGE__NAME": f"{args.size}-random",
        "TEXEL_IMAGE__MAX_BATCH_SIZE": str(args.image_batch_size),
        "TEXEL_IMAGE__MAX_QUEUE": str(4 * max(i for _, i in args.loads) + 16),
        "TEXEL_REQUEST_TIMEOUT_S": "300",
        "TEXEL_ADVANCED__GPU_SHARING": args.sharing,
    }


def run(args) -> list[dict]:
    images = formula_images(args.data, args.images)
    formulas = json_workload("/recognize", images)
    prompts = Workload(
        "POST", "/generate", lambda i: {"json": {"prompt": PROMPTS[i % len(PROMPTS)], "seed": i}}
    )
    base = {
        "scenario": "mixed",
        "sharing": args.sharing,
        "gpu": gpu_name(),
        "commit": commit(),
        "command": "python -m bench.mixed " + " ".join(sys.argv[1:]),
        "image_model": f"{args.size} (random weights), {args.steps} steps",
        "max_batch_size": {"formula": args.max_batch_size, "image": args.image_batch_size},
        "client_processes": {
            "formula": args.client_processes,
            "image": args.image_client_processes,
        },
    }
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="texel-sd-") as tmp:
        model = args.model_dir or Path(tmp)
        if not (model / "model_index.json").exists():
            build_pipeline(model, SHAPES[args.size], args.steps, 7.5)
        proc = ServerProcess({**served_env(args, model)}, ready_timeout=900)
        base["env"] = settings_env()
        try:
            for formula_clients, image_clients in args.loads:
                before = scrape(proc.url)
                started = time.perf_counter()
                results = mixed_closed_loop(
                    proc.url,
                    {
                        "formula": (formulas, formula_clients, args.client_processes),
                        "image": (prompts, image_clients, args.image_client_processes),
                    },
                    args.duration,
                    args.warmup,
                )
                wall_s = time.perf_counter() - started
                after = scrape(proc.url)
                record = {
                    **base,
                    "formula_clients": formula_clients,
                    "image_clients": image_clients,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "formula": side_summary(results.get("formula")),
                    "image": side_summary(results.get("image")),
                    # Over warm-up and measurement together, as the counter runs.
                    "device_s": {
                        m: round(s - before["device"].get(m, 0.0), 3)
                        for m, s in after["device"].items()
                    },
                    "stage_ms": stage_means(before, after),
                    "wall_s": round(wall_s, 2),
                }
                record = with_shares(record, alone_figures(records, args.out, args.sharing))
                records.append(record)
                append_records([record], args.out)
                print(json.dumps(record), flush=True)
        finally:
            proc.stop()
    return records


def table(records: list[dict]) -> str:
    def side(r: dict, name: str) -> str:
        s = r.get(name)
        if not s:
            return "- | - / -"
        return f"{s['throughput_rps']} | {s['p50_ms']} / {s['p99_ms']}"

    lines = [
        f"GPU: {records[0]['gpu']}; commit {records[0]['commit']}; sharing {records[0]['sharing']}",
        "",
        "| load (formula + image clients) | formulas/s | formula p50 / p99 ms | images/s "
        "| image p50 / p99 ms | share of alone (formula, image, sum) | device s by model |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in records:
        share = r.get("share_of_alone") or {}
        shares_text = ", ".join(str(share.get(k, "-")) for k in ("formula", "image", "sum"))
        device = ", ".join(f"{m} {s}" for m, s in sorted(r["device_s"].items()))
        lines.append(
            f"| {r['formula_clients']} + {r['image_clients']} | {side(r, 'formula')} "
            f"| {side(r, 'image')} | {shares_text} | {device} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--size", choices=sorted(SHAPES), default="sd15")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="build the image pipeline here, or reuse the one an earlier run built here "
        "(bench.compare_image builds the same)",
    )
    parser.add_argument(
        "--loads",
        type=parse_loads,
        default=parse_loads("128+0,0+8,128+8,16+8"),
        help="formula clients + image clients, comma-separated",
    )
    parser.add_argument("--sharing", choices=("priority", "off"), default="priority")
    parser.add_argument("--max-batch-size", type=int, default=128, help="of formulas")
    parser.add_argument("--image-batch-size", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--client-processes", type=int, default=4, help="for formula clients")
    parser.add_argument("--image-client-processes", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.out = args.out or gpu_results_file()
    records = run(args)
    print()
    print(table(records))


if __name__ == "__main__":
    main()
