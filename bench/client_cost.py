"""What the load generator itself costs: client CPU per request against a server that
answers at once.

    python -m bench.client_cost --concurrency 8,32,64 --duration 6

Starts a bare ASGI server (no Texel) on a free port in a child process, runs
`bench.load.closed_loop` from this process at each concurrency and prints this
process's CPU time per answered request, so a benchmark's client processes can be
sized (or a client that costs more per request the more connections it holds found).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import multiprocessing
import os
import resource
import socket
import time

from bench.load import Workload, closed_loop


async def _instant(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def _serve(port: int) -> None:
    import uvicorn

    uvicorn.run(_instant, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="8,32,64")
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--body-bytes", type=int, default=20000, help="random bytes, base64 JSON")
    args = parser.parse_args()

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    server.start()
    time.sleep(2)
    body = {"image_base64": base64.b64encode(os.urandom(args.body_bytes)).decode()}
    workload = Workload("POST", "/", lambda i: {"json": body})
    print("| clients | requests/s | client CPU ms per request |\n|---:|---:|---:|")
    try:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            before = _cpu_s()
            result = asyncio.run(
                closed_loop(f"http://127.0.0.1:{port}", workload, concurrency, args.duration, 1.0)
            )
            per_request = 1000 * (_cpu_s() - before) / max(result.ok, 1)
            print(
                f"| {concurrency} | {result.throughput_rps:.0f} | {per_request:.2f} |", flush=True
            )
    finally:
        server.kill()


if __name__ == "__main__":
    main()
