"""CPU benchmark: closed-loop load against a running Texel, batching on vs `MAX_BATCH_SIZE=1`.

    python -m bench.cpu --data ../shared/data --concurrency 1,8,32 --duration 20

Starts one server per configuration, drives `/recognize` with real formula
images (or `/generate` with fixed prompts), prints a markdown table and appends
JSON lines to `bench/results/cpu.jsonl`. Every record names the machine and commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from bench.common import append_records, commit, formula_images, machine, settings_env
from bench.load import LoadResult, Workload, closed_loop
from bench.server import ROOT, ServerProcess, otlp_sink

PROMPTS = [
    "a red circle on a blue background",
    "two yellow squares on a black background",
    "a green triangle and a white circle on a gray background",
    "three purple circles on a white background",
]


def formula_workload(images: list[bytes]) -> Workload:
    return Workload(
        "POST",
        "/recognize",
        lambda i: {"files": {"image": ("f.png", images[i % len(images)], "image/png")}},
    )


def image_workload() -> Workload:
    return Workload(
        "POST", "/generate", lambda i: {"json": {"prompt": PROMPTS[i % len(PROMPTS)], "seed": i}}
    )


def run(args: argparse.Namespace) -> list[dict]:
    scenario = args.scenario
    workload = (
        formula_workload(formula_images(args.data, args.images))
        if scenario == "formula"
        else image_workload()
    )
    prefix = "TEXEL_FORMULA__" if scenario == "formula" else "TEXEL_IMAGE__"
    other = "TEXEL_IMAGE__ENABLED" if scenario == "formula" else "TEXEL_FORMULA__ENABLED"
    configs = {
        "texel": {f"{prefix}MAX_BATCH_SIZE": str(args.max_batch_size)},
        "texel-nobatch": {f"{prefix}MAX_BATCH_SIZE": "1"},
    }
    if args.tracing_overhead:
        sink = otlp_sink()
        configs = {
            "texel-trace-off": {"OTEL_SDK_DISABLED": "true"},
            "texel-trace-on": {
                "OTEL_TRACES_SAMPLER": "always_on",
                "OTEL_EXPORTER_OTLP_ENDPOINT": sink,
            },
        }
    if args.only:
        configs = {args.only: configs[args.only]}
    records = []
    for server_name, extra in configs.items():
        env = {
            other: "false",
            f"{prefix}MAX_WAIT_MS": str(args.max_wait_ms),
            f"{prefix}MAX_QUEUE": "1024",
            "TEXEL_DEVICE": "cpu",
            **({f"{prefix}MODEL": args.model} if args.model else {}),
            **dict(kv.split("=", 1) for kv in args.env),
            **extra,
        }
        server = ServerProcess(env)
        try:
            for concurrency in args.concurrency:
                result: LoadResult = asyncio.run(
                    closed_loop(server.url, workload, concurrency, args.duration, args.warmup)
                )
                record = {
                    "scenario": scenario,
                    "server": server_name,
                    **result.summary(),
                    "machine": machine(),
                    "commit": commit(),
                    "command": "python -m bench.cpu " + " ".join(args.argv),
                    # What the server ran with: this environment's settings and the run's.
                    "env": {
                        **settings_env(),
                        **{k: v for k, v in env.items() if k.startswith(("TEXEL_", "OTEL_"))},
                    },
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
                records.append(record)
                print(json.dumps(record), flush=True)
        finally:
            server.stop()
    return records


def table(records: list[dict]) -> str:
    lines = [
        "| server | concurrency | req/s | p50 ms | p95 ms | p99 ms | mean batch | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['throughput_rps']:.2f} | {r['p50_ms']:.0f} "
            f"| {r['p95_ms']:.0f} | {r['p99_ms']:.0f} | {r['mean_batch_size'] or '-'} "
            f"| {r['errors'] or '-'} |"
        )
    by_level: dict[int, dict[str, float]] = {}
    for r in records:
        by_level.setdefault(r["concurrency"], {})[r["server"]] = r["throughput_rps"]
    names = list(dict.fromkeys(r["server"] for r in records))
    if len(names) == 2:
        lines.append("")
        for level, values in sorted(by_level.items()):
            if values.get(names[1]):
                lines.append(
                    f"concurrency {level}: {names[0]} / {names[1]} = "
                    f"{values.get(names[0], 0) / values[names[1]]:.2f}x"
                )
    return "\n".join(lines)


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=["formula", "image"], default="formula")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", help="model directory (default: the shipped one)")
    parser.add_argument("--images", type=int, default=200, help="distinct formula images")
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32]
    )
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-wait-ms", type=float, default=10.0)
    parser.add_argument(
        "--tracing-overhead",
        action="store_true",
        help="compare tracing off vs on (100%% sampling) instead of batching on vs off",
    )
    parser.add_argument(
        "--env", action="append", default=[], help="extra KEY=VALUE for the servers (repeatable)"
    )
    parser.add_argument("--only", help="run only this server configuration")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu.jsonl")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    records = run(args)
    append_records(records, args.out)
    print()
    print(table(records))


if __name__ == "__main__":
    main()
