"""Batch formation under closed-loop load, with a simulated launch-bound GPU.

    python -m bench.simulate --concurrency 128 --batch-s 0.25 --return-ms 5,40

Texel's real `Batcher` and `BucketQueue`, driven by `concurrency` asyncio clients;
the "GPU" is a worker whose batch takes `batch-s` seconds whatever its size (a
decoder bound by kernel launches), and each client spends a random 'return' time
between getting an answer and queueing its next request (HTTP, decoding,
preprocessing). No model, no HTTP: it isolates how the batching policy forms batches
when answers come back together, which a 2-core machine cannot show with real
servers at GPU rates. Prints throughput and the mean batch size per policy.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time

from batching import Batcher, BatchPolicy, Worker


class LaunchBoundDevice:
    """A batch costs the same time at any size, like a GPU decoder bound by launches."""

    def __init__(self, batch_s: float) -> None:
        self.batch_s = batch_s
        self.sizes: list[int] = []

    def __call__(self, payloads, should_stop):
        self.sizes.append(len(payloads))
        time.sleep(self.batch_s)
        return list(payloads)


async def run(policy: BatchPolicy, args) -> dict:
    device = LaunchBoundDevice(args.batch_s)
    batcher = Batcher("sim", [Worker("gpu", device)], policy)
    batcher.start()
    rng = random.Random(0)
    low, high = (x / 1000 for x in args.return_ms)
    done = 0
    stop_at = time.monotonic() + args.warmup + args.duration
    measure_from = time.monotonic() + args.warmup

    async def client(i: int) -> None:
        nonlocal done
        await asyncio.sleep(rng.uniform(0, args.ramp_ms / 1000 if args.ramp_ms else high))
        while time.monotonic() < stop_at:
            await batcher.submit(i, bucket=rng.choice(args.buckets), timeout_s=60)
            if time.monotonic() >= measure_from:
                done += 1
            await asyncio.sleep(rng.uniform(low, high))

    await asyncio.gather(*(client(i) for i in range(args.concurrency)))
    await batcher.close()
    return {
        "throughput_rps": round(done / args.duration, 1),
        "mean_batch": round(statistics.fmean(device.sizes), 1) if device.sizes else None,
        "ideal_rps": round(min(args.concurrency, args.max_batch) / args.batch_s, 1),
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
    parser.add_argument("--linger-ms", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.0])  # fmt: skip
    parser.add_argument("--rejoin-ms", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.0])  # fmt: skip
    parser.add_argument("--buckets", type=lambda s: [int(x) for x in s.split(",")],
                        default=[256, 320, 384, 448])  # fmt: skip
    parser.add_argument(
        "--ramp-ms",
        type=float,
        default=0.0,
        help="clients start spread over this long (0: over one return time); a load "
        "generator's processes starting apart split the clients from the first batch",
    )
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    args = parser.parse_args()
    print("| max wait ms | max linger ms | max rejoin ms | formulas/s | mean batch "
          "| ideal formulas/s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for wait_ms, linger_ms, rejoin_ms in itertools.product(
        args.wait_ms, args.linger_ms, args.rejoin_ms
    ):
        policy = BatchPolicy(max_batch_size=args.max_batch, max_wait_s=wait_ms / 1000,
                             max_queue=args.concurrency * 2, merge_buckets=True,
                             max_linger_s=linger_ms / 1000,
                             max_rejoin_s=rejoin_ms / 1000)  # fmt: skip
        result = asyncio.run(run(policy, args))
        print(
            f"| {wait_ms:g} | {linger_ms:g} | {rejoin_ms:g} | {result['throughput_rps']} "
            f"| {result['mean_batch']} | {result['ideal_rps']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
