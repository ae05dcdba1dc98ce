"""Batch formation under closed-loop or Poisson load, with a simulated GPU.

    python -m bench.simulate --concurrency 128 --batch-s 0.25 --return-ms 5,40
    python -m bench.simulate --rates 2,4,6 --max-batch 8 --batch-s 0.65 --item-ms 64

Texel's real `Batcher` and `BucketQueue`, driven by `concurrency` asyncio clients;
the "GPU" is a worker whose batch takes `batch-s` seconds whatever its size (a
decoder bound by kernel launches), and each client spends a random 'return' time
between getting an answer and queueing its next request (HTTP, decoding,
preprocessing). No model, no HTTP: it isolates how the batching policy forms batches
when answers come back together, which a 2-core machine cannot show with real
servers at GPU rates. Prints throughput, the mean batch size and the latency per policy.

With `--rates`, requests arrive open-loop instead, as a Poisson process of each rate
(many independent users). `--item-ms` adds a cost per request to each batch (an image
pipeline's batch of 8 costs more than one of 1).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time

from batching import Batcher, BatchPolicy, Worker


class SimulatedDevice:
    """A batch of n costs `batch_s + n * item_s`: with `item_s` 0, the same at any size,
    like a GPU decoder bound by launches."""

    def __init__(self, batch_s: float, item_s: float = 0.0) -> None:
        self.batch_s = batch_s
        self.item_s = item_s
        self.sizes: list[int] = []

    def __call__(self, payloads, should_stop):
        self.sizes.append(len(payloads))
        time.sleep(self.batch_s + len(payloads) * self.item_s)
        return list(payloads)


async def run(policy: BatchPolicy, args, rate: float | None = None) -> dict:
    """Closed-loop clients, or with `rate` Poisson arrivals of that many requests/s."""
    device = SimulatedDevice(args.batch_s, args.item_ms / 1000)
    batcher = Batcher("sim", [Worker("gpu", device)], policy)
    batcher.start()
    rng = random.Random(0)
    low, high = (x / 1000 for x in args.return_ms)
    requests: list[tuple[float, float]] = []  # (sent, answered)
    stop_at = time.monotonic() + args.warmup + args.duration
    measure_from = time.monotonic() + args.warmup

    async def request(i: int) -> None:
        sent = time.monotonic()
        await batcher.submit(i, bucket=rng.choice(args.buckets), timeout_s=60)
        requests.append((sent, time.monotonic()))

    async def client(i: int) -> None:
        await asyncio.sleep(rng.uniform(0, args.ramp_ms / 1000 if args.ramp_ms else high))
        while time.monotonic() < stop_at:
            await request(i)
            await asyncio.sleep(rng.uniform(low, high))

    async def arrivals() -> None:
        pending = []
        for i in itertools.count():
            await asyncio.sleep(rng.expovariate(rate))
            if time.monotonic() >= stop_at:
                break
            pending.append(asyncio.ensure_future(request(i)))
        await asyncio.gather(*pending)

    if rate is None:
        await asyncio.gather(*(client(i) for i in range(args.concurrency)))
        level = min(args.concurrency, args.max_batch)
        ideal = level / (args.batch_s + level * args.item_ms / 1000)
    else:
        await arrivals()
        ideal = rate
    await batcher.close()
    # Closed loop: the answers within the measured span. Open loop: the requests sent in
    # it (all of them are answered: the arrivals stop and wait for their answers).
    measured = [
        (sent, answered)
        for sent, answered in requests
        if measure_from <= (sent if rate else answered) < stop_at
    ]
    ordered = sorted(answered - sent for sent, answered in measured if sent >= measure_from)
    return {
        "throughput_rps": round(len(measured) / args.duration, 1),
        "mean_batch": round(statistics.fmean(device.sizes), 1) if device.sizes else None,
        "ideal_rps": round(ideal, 1),
        "p50_ms": round(1000 * ordered[len(ordered) // 2]) if ordered else None,
        "p99_ms": round(1000 * ordered[int(len(ordered) * 0.99)]) if ordered else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--batch-s", type=float, default=0.25)
    parser.add_argument("--return-ms", type=lambda s: [float(x) for x in s.split(",")],
                        default=[5.0, 40.0])  # fmt: skip
    parser.add_argument("--wait-ms", type=lambda s: [float(x) for x in s.split(",")],
                        default=[10.0])  # fmt: skip
    parser.add_argument("--buckets", type=lambda s: [int(x) for x in s.split(",")],
                        default=[256, 320, 384, 448])  # fmt: skip
    parser.add_argument(
        "--ramp-ms",
        type=float,
        default=0.0,
        help="clients start spread over this long (0: over one return time); a load "
        "generator's processes starting apart split the clients from the first batch",
    )
    parser.add_argument("--item-ms", type=float, default=0.0, help="batch cost per request")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                        default=None, help="Poisson arrival rates (requests/s) instead of "
                        "closed-loop clients")  # fmt: skip
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    args = parser.parse_args()
    print("| load | max wait ms | requests/s | mean batch | ideal requests/s | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    loads = args.rates or [None]
    for rate, wait_ms in itertools.product(loads, args.wait_ms):
        policy = BatchPolicy(
            max_batch_size=args.max_batch,
            max_wait_s=wait_ms / 1000,
            max_queue=max(args.concurrency * 2, 1024),
            merge_buckets=True,
        )
        result = asyncio.run(run(policy, args, rate))
        load = f"{args.concurrency} clients" if rate is None else f"poisson {rate:g}/s"
        print(
            f"| {load} | {wait_ms:g} "
            f"| {result['throughput_rps']} | {result['mean_batch']} | {result['ideal_rps']} "
            f"| {result['p50_ms']} | {result['p99_ms']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
