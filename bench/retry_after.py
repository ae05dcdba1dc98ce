"""What `Retry-After` promises against when a full formula queue has drained.

    python -m bench.retry_after [--quiet-s 20] [--silent-s 0] [--burst 800]

Serves the formula model alone on the CPU, sends it one request a second for
`--quiet-s` (a quiet spell), none at all for `--silent-s`, then `--burst` requests at
once, more than its queue holds. Prints how many were answered 200 and 429, when the
last 200 came (the queue drained), and the `Retry-After` the 429s carried. A client
that waits as told should find the queue drained, not wait minutes after it did.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx

from bench.common import commit, machine
from bench.server import ServerProcess
from tests.conftest import formula_png


async def burst(
    url: str, quiet_s: float, silent_s: float, count: int
) -> tuple[list[float], list[int], int]:
    rng = random.Random(0)
    pictures = [
        formula_png(text=f"x^{k} + {rng.randrange(1000)}", size=(rng.randrange(150, 400), 48))
        for k in range(count + int(quiet_s) + 1)
    ]  # each different, so that none is answered from the cache

    async def recognize(client: httpx.AsyncClient, png: bytes):
        files = {"image": ("f.png", png, "image/png")}
        response = await client.post(url + "/recognize", files=files)
        return response.status_code, response.headers.get("retry-after"), time.monotonic()

    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        started = time.monotonic()
        sent = 0
        while time.monotonic() - started < quiet_s:
            await recognize(client, pictures[sent])
            sent += 1
            await asyncio.sleep(1.0)
        await asyncio.sleep(silent_s)
        started = time.monotonic()
        answers = await asyncio.gather(
            *(recognize(client, png) for png in pictures[sent : sent + count])
        )
    served = [at - started for status, _, at in answers if status == 200]
    retry = [int(after) for status, after, _ in answers if status == 429]
    return served, retry, len(answers) - len(served) - len(retry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quiet-s", type=float, default=20.0)
    parser.add_argument("--silent-s", type=float, default=0.0)
    parser.add_argument("--burst", type=int, default=800)
    args = parser.parse_args()
    server = ServerProcess({"TEXEL_DEVICE": "cpu", "TEXEL_IMAGE__ENABLED": "false"})
    try:
        served, retry, other = asyncio.run(
            burst(server.url, args.quiet_s, args.silent_s, args.burst)
        )
    finally:
        server.stop()
    print(
        f"{machine()}, commit {commit()}; {args.quiet_s:g} s quiet, {args.silent_s:g} s silent, "
        f"then {args.burst} at once"
    )
    print("| answered 200 | 429 | other | last 200 after | Retry-After min / median / max | 1 s |")
    print("|---:|---:|---:|---:|---|---:|")
    spread = f"{min(retry)} / {statistics.median(retry):g} / {max(retry)} s" if retry else "no 429"
    drained = f"{max(served):.1f} s" if served else "-"
    ones = sum(after <= 1 for after in retry)
    print(f"| {len(served)} | {len(retry)} | {other} | {drained} | {spread} | {ones} |")


if __name__ == "__main__":
    main()
