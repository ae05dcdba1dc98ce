"""How the kernel spreads kept-alive connections over Texel's HTTP processes.

    python -m bench.connection_spread --processes 8 --connections 128

Each HTTP process listens on a socket of its own bound to the port with SO_REUSEPORT,
and the kernel picks one for every new connection by a hash of its addresses. A
connection then stays with its process, so with few long-lived connections (a closed-loop
benchmark's clients, a proxy's pool) the processes carry unequal shares of the requests.
A process holding more than its share closes one of them after its next answer
(`app.server.ConnectionShare`), and the client's new connection is placed again.

This starts `texel serve` with `--processes` HTTP processes (the formula model only),
opens `--connections` kept-alive HTTP connections to it at once and prints how many each
process holds, largest first: as opened, then after `--rounds` rounds of one request on
each (a client whose connection was closed opens another, as HTTP clients do), `--repeats`
times; a record goes to `bench/results/cpu.jsonl`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from http.client import HTTPConnection
from pathlib import Path

import psutil

from bench.common import append_records, commit, machine
from bench.server import ROOT, ServerProcess


def _tree(server_pid: int) -> list[psutil.Process]:
    """The server's process and all its descendants."""
    root = psutil.Process(server_pid)
    return [root, *root.children(recursive=True)]


def by_role(server_pid: int, port: int) -> dict[str, list[psutil.Process]]:
    """The server's processes by role: `http` (listening on `port`), `engine` (any other
    child but multiprocessing's resource tracker) and `launcher` (the server's own process
    where it does not listen itself)."""
    roles: dict[str, list[psutil.Process]] = {"http": [], "engine": [], "launcher": []}
    for process in _tree(server_pid):
        try:
            listening = any(
                c.status == psutil.CONN_LISTEN and c.laddr.port == port
                for c in process.net_connections(kind="tcp")
            )
            tracker = "resource_tracker" in " ".join(process.cmdline())
        except psutil.Error:
            continue
        if listening:
            roles["http"].append(process)
        elif process.pid == server_pid:
            roles["launcher"].append(process)
        elif not tracker:
            roles["engine"].append(process)
    return roles


def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU seconds `process` has used; 0 once it is gone."""
    try:
        return sum(process.cpu_times()[:2])
    except psutil.Error:
        return 0.0


def held(server_pid: int, port: int) -> list[int]:
    """Established connections to `port`, per process of the server, largest first."""
    counts: Counter[int] = Counter()
    for process in _tree(server_pid):
        try:
            connections = process.net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in connections:
            if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port:
                counts[process.pid] += 1
    return sorted(counts.values(), reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--connections", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4, help="requests on each connection")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu.jsonl")
    args = parser.parse_args()
    env = {"TEXEL_HTTP_PROCESSES": str(args.processes), "TEXEL_IMAGE__ENABLED": "false"}
    server = ServerProcess(env)
    spreads, balanced, closed = [], [], []
    try:
        pid, port = server.process.pid, server.port
        for _ in range(args.repeats):
            clients = [HTTPConnection("127.0.0.1", port) for _ in range(args.connections)]
            for client in clients:
                client.connect()
            time.sleep(1.0)  # every process accepts what the kernel queued for it
            spreads.append(held(pid, port))
            closed.append(0)
            for _ in range(args.rounds):
                for client in clients:
                    client.request("GET", "/livez")
                    response = client.getresponse()
                    response.read()
                    closed[-1] += response.will_close  # http.client reconnects next time
            for client in clients:
                if client.sock is None:
                    client.connect()
            time.sleep(1.0)
            balanced.append(held(pid, port))
            for client in clients:
                client.close()
            time.sleep(0.5)
    finally:
        server.stop()
    mean = args.connections / args.processes
    print(f"{machine()}; commit {commit()}; {args.connections} connections, mean {mean:g}\n")
    print(
        f"| run | as opened, largest first | largest / mean | after {args.rounds} rounds "
        "of requests | largest / mean | closed by the server |"
    )
    print("|---:|---|---:|---|---:|---:|")
    for i, (spread, after, count) in enumerate(zip(spreads, balanced, closed, strict=True), 1):
        print(
            f"| {i} | {', '.join(map(str, spread))} | {spread[0] / mean:.2f} "
            f"| {', '.join(map(str, after))} | {after[0] / mean:.2f} | {count} |"
        )
    append_records(
        [
            {
                "scenario": "connection-spread",
                "machine": machine(),
                "commit": commit(),
                "command": "python -m bench.connection_spread --processes "
                f"{args.processes} --connections {args.connections} --rounds {args.rounds}",
                "processes": args.processes,
                "connections": args.connections,
                "rounds": args.rounds,
                "spreads": spreads,
                "largest_over_mean": round(statistics.fmean(s[0] for s in spreads) / mean, 3),
                "spreads_after_requests": balanced,
                "largest_over_mean_after_requests": round(
                    statistics.fmean(s[0] for s in balanced) / mean, 3
                ),
                "closed_by_server": closed,
            }
        ],
        args.out,
    )


if __name__ == "__main__":
    main()
