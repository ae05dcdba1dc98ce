"""What Texel's serving path itself costs in CPU per request, without the model's compute.

    python -m bench.serving_cost --concurrency 16 --duration 10
    python -m bench.serving_cost --rate 350 --duration 10     # Poisson arrivals instead

Texel is started as `texel serve` with the real formula model loaded, but its batch
computation replaced by a canned answer (`serve_instant` below), so what remains is
everything a request costs besides the model: HTTP, JSON and base64, image decoding and
preprocessing, the batcher, the engine protocol, tracing, metrics and logging. The
replacement is made when this module is imported with `TEXEL_BENCH_INSTANT` set, so an
engine process spawned by the launcher (which imports it again as its main module) gets
it too. Each configuration runs in a fresh server; the table lists requests/s and CPU
milliseconds per request of each kind of process: HTTP processes (those listening on
the port), the engine process where it is one of its own, and the launcher where it is
not also the HTTP process, with the load's p50 and p99 latency. The figure that
matters on a GPU is the HTTP processes' CPU per request (bench/RESULTS.md): with
`TEXEL_HTTP_PROCESSES=2` the CPU runs the GPU's plan, an engine process apart.
Throughput on a 2-core machine is bounded by the client sharing it; CPU per request is
not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.common import commit, formula_images, machine
from bench.compare import json_workload
from bench.connection_spread import by_role, cpu_seconds
from bench.load import closed_loop_processes, open_loop_processes
from bench.server import ROOT, ServerProcess

CONFIGS = {
    "as shipped": {},
    "1% of traces sampled": {
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    },
    "tracing SDK off (OTEL_SDK_DISABLED=true)": {"OTEL_SDK_DISABLED": "true"},
    "the GPU plan: 2 HTTP processes and an engine process": {"TEXEL_HTTP_PROCESSES": "2"},
}
INSTANT = "TEXEL_BENCH_INSTANT"
ROLES = ("http", "engine", "launcher")


def answer_instantly() -> None:
    """Each formula batch answered at once with a fixed 48-token result: the recognizer's
    public `runner` (what the batcher calls per device) is replaced; warm-up still runs
    the model."""
    from models.base import DeviceRunner
    from models.formula import adapter

    def instant_runner(self, device):
        def run(batch, should_stop):
            return [adapter.FormulaTokens([10, 11, 12, 13] * 12, 1e-5) for _ in batch]

        return DeviceRunner(run)  # no stream: whole batches

    adapter.FormulaRecognizer.runner = instant_runner


if os.environ.get(INSTANT):  # here and in every process spawned from `serve_instant`
    answer_instantly()


def serve_instant(host: str, port: int) -> None:
    """`texel serve` with every formula batch answered at once (`answer_instantly`)."""
    from app.launcher import serve

    serve(host, port)


def cpu_by_role(server_pid: int, port: int) -> dict[str, float]:
    """User + system CPU seconds of the server's processes, summed by role
    (`bench.connection_spread.by_role`)."""
    roles = by_role(server_pid, port)
    return {role: sum(cpu_seconds(p) for p in processes) for role, processes in roles.items()}


def measure(env: dict[str, str], args, images: list[bytes]) -> dict:
    # Whole batches: the canned answer replaces a batch's decode, not a stream's.
    env = {"TEXEL_FORMULA__ADVANCED__CONTINUOUS": "false", **env}
    env = {**env, "TEXEL_IMAGE__ENABLED": "false", "TEXEL_FORMULA__MAX_QUEUE": "4096"}
    server = ServerProcess({**env, INSTANT: "1"}, entry=("bench.serving_cost", "--instant"))
    try:
        # Ready: every HTTP process accepts connections, so the client's spread over all.
        workload = json_workload("/recognize", images)
        closed_loop_processes(server.url, workload, args.concurrency, args.warmup, 0.5, 1)
        before = cpu_by_role(server.process.pid, server.port)
        if args.rate:
            result = open_loop_processes(server.url, workload, args.rate, args.duration, 0, 1)
        else:
            result = closed_loop_processes(
                server.url, workload, args.concurrency, args.duration, 0, 1
            )
        after = cpu_by_role(server.process.pid, server.port)
    finally:
        server.stop()
    summary = result.summary()
    per_request = 1000 / max(1, summary["requests"])
    return {
        "throughput_rps": summary["throughput_rps"],
        "p50_ms": summary["p50_ms"],
        "p99_ms": summary["p99_ms"],
        "requests": summary["requests"],
        "errors": summary["errors"],
        **{
            f"{role}_cpu_ms_per_request": round((after[role] - before[role]) * per_request, 3)
            for role in after
        },
    }


def _column(runs: list[dict], key: str) -> str:
    return ", ".join(f"{run[key]:.2f}" for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--rate", type=float, default=0.0, help="Poisson arrivals a second instead of a closed loop"
    )
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration")
    parser.add_argument(
        "--only", type=lambda s: s.split(","), default=list(CONFIGS), help="configurations"
    )
    # How ServerProcess starts the instant stand-in: --instant --host H --port P.
    parser.add_argument("--instant", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instant:
        serve_instant(args.host, args.port)
        return
    images = formula_images(args.data, args.images)
    load = f"Poisson {args.rate:g}/s" if args.rate else f"concurrency {args.concurrency}"
    print(f"{machine()}; commit {commit()}; {load}, {args.duration:g} s\n")
    print(
        "| configuration | requests/s | p50 / p99 ms "
        "| CPU ms per request: HTTP processes | engine | launcher |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.only:
        env = CONFIGS[name]
        runs = [measure(env, args, images) for _ in range(args.repeats)]
        record = {"configuration": name, "env": env, "load": load, "runs": runs, "commit": commit()}
        print(json.dumps(record), file=sys.stderr)
        rates = ", ".join(f"{r['throughput_rps']:.0f}" for r in runs)
        latency = ", ".join(f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}" for r in runs)
        cpu = " | ".join(_column(runs, f"{role}_cpu_ms_per_request") for role in ROLES)
        print(f"| {name} | {rates} | {latency} | {cpu} |", flush=True)


if __name__ == "__main__":
    main()
