"""What Texel's serving path itself costs in CPU per request, without the model's compute.

    python -m bench.serving_cost --concurrency 16 --duration 10

Texel is started as `texel serve` with the real formula model loaded, but its batch
computation replaced by a canned answer (`--instant`, see `serve_instant` below), so
what remains is everything a request costs besides the model: HTTP, JSON and base64,
image decoding, the batcher, tracing, metrics and logging. The figure that matters on
a GPU is CPU milliseconds per request in the HTTP process (bench/RESULTS.md). The
server runs as one process (the canned answer is patched into it, not into engine
processes it would spawn). Each configuration runs in a fresh server; the table lists
requests/s and CPU ms per request. Throughput on a 2-core
machine is bounded by the client sharing it; CPU per request is not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import psutil

from bench.common import commit, formula_images, machine
from bench.compare import json_workload
from bench.load import closed_loop_processes
from bench.server import ROOT, ServerProcess

CONFIGS = {
    "as shipped": {},
    "1% of traces sampled": {
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    },
    "tracing SDK off (OTEL_SDK_DISABLED=true)": {"OTEL_SDK_DISABLED": "true"},
}


def serve_instant(host: str, port: int) -> None:
    """`texel serve`, each formula batch answered at once with a fixed 48-token result:
    the recognizer's public `runner` (what the batcher calls per device) is replaced;
    warm-up still runs the model."""
    from app.cli import serve
    from models.base import DeviceRunner
    from models.formula import adapter

    def instant_runner(self, device):
        def run(batch, should_stop):
            return [adapter.FormulaTokens([10, 11, 12, 13] * 12, 1e-5) for _ in batch]

        return DeviceRunner(run)  # no stream: whole batches

    adapter.FormulaRecognizer.runner = instant_runner
    serve(host, port)


def cpu_seconds(process: psutil.Process) -> tuple[float, float]:
    """User + system CPU of the server's process, and of its children."""
    own = sum(process.cpu_times()[:2])
    children = 0.0
    for child in process.children(recursive=True):
        try:
            children += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
    return own, children


def measure(env: dict[str, str], args, images: list[bytes]) -> dict:
    # Whole batches: the canned answer replaces a batch's decode, not a stream's.
    env = {"TEXEL_FORMULA__ADVANCED__CONTINUOUS": "false", **env}
    env = {**env, "TEXEL_IMAGE__ENABLED": "false", "TEXEL_FORMULA__MAX_QUEUE": "4096"}
    server = ServerProcess(env, entry=("bench.serving_cost", "--instant"))
    try:
        # Ready: every HTTP process accepts connections, so the client's spread over all.
        workload = json_workload("/recognize", images)
        closed_loop_processes(server.url, workload, args.concurrency, args.warmup, 0.5, 1)
        process = psutil.Process(server.process.pid)
        own_before, children_before = cpu_seconds(process)
        result = closed_loop_processes(server.url, workload, args.concurrency, args.duration, 0, 1)
        own_after, children_after = cpu_seconds(process)
    finally:
        server.stop()
    summary = result.summary()
    per_request = 1000 / max(1, summary["requests"])
    return {
        "throughput_rps": summary["throughput_rps"],
        "requests": summary["requests"],
        "errors": summary["errors"],
        "server_cpu_ms_per_request": round((own_after - own_before) * per_request, 3),
        "worker_cpu_ms_per_request": round((children_after - children_before) * per_request, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
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
    print(f"{machine()}; commit {commit()}; concurrency {args.concurrency}, {args.duration:g} s\n")
    print("| configuration | requests/s | CPU ms per request: server process | children |")
    print("|---|---|---|---|")
    for name in args.only:
        env = CONFIGS[name]
        runs = [measure(env, args, images) for _ in range(args.repeats)]
        record = {"configuration": name, "env": env, "runs": runs, "commit": commit()}
        print(json.dumps(record), file=sys.stderr)
        rates = ", ".join(f"{r['throughput_rps']:.0f}" for r in runs)
        own = ", ".join(f"{r['server_cpu_ms_per_request']:.2f}" for r in runs)
        workers = ", ".join(f"{r['worker_cpu_ms_per_request']:.2f}" for r in runs)
        print(f"| {name} | {rates} | {own} | {workers} |", flush=True)


if __name__ == "__main__":
    main()
