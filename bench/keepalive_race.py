"""Clients that reuse a kept-alive connection after idling about as long as the server's
keep-alive: the server may close it just as the next request is sent, which the client
sees as a `ReadError` or `RemoteProtocolError` (no answer). The bench clients idle so
between warm-up and measurement, while the slowest clients finish.

    python -m bench.keepalive_race --idle 5 --clients 32 --rounds 6
    TEXEL_ADVANCED__KEEP_ALIVE_S=5 python -m bench.keepalive_race --idle 5   # uvicorn's default
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random

import httpx

from bench.server import ServerProcess


async def run(url: str, idle_s: float, clients: int, rounds: int) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()

    async def client_loop(client: httpx.AsyncClient) -> None:
        await client.get("/livez")
        for _ in range(rounds):
            await asyncio.sleep(idle_s + random.uniform(-0.05, 0.05))
            try:
                outcomes[(await client.get("/livez")).status_code] += 1
            except httpx.HTTPError as exc:
                outcomes[type(exc).__name__] += 1

    pool = [
        httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=1))
        for _ in range(clients)
    ]
    try:
        await asyncio.gather(*(client_loop(c) for c in pool))
    finally:
        await asyncio.gather(*(c.aclose() for c in pool))
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=float, default=5.0, help="seconds idle between requests")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    env = {"TEXEL_IMAGE__ENABLED": "false"}  # only `/livez` is asked: the model may load
    server = ServerProcess(env, wait_ready=False)
    try:
        outcomes = asyncio.run(run(server.url, args.idle, args.clients, args.rounds))
    finally:
        server.stop()
    print(dict(outcomes))


if __name__ == "__main__":
    main()
