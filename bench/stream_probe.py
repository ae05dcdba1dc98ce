"""Continuous batching without a server: the stream's own ceiling, and where its host time goes.

    python -m bench.stream_probe --data ../shared/data --concurrency 128 --duration 10

Loads the formula model on the default device as the server does (`FormulaRecognizer`,
warmed up for `--max-batch-size` rows), preprocesses the benchmark images once, then keeps
`--concurrency` requests in the adapter's stream for `--duration` seconds: a closed loop
with no HTTP, where each answer lets the next image in. Prints formulas/s, the mean rows
decoding together, and the host time per check in each phase (join: upload and admit;
run; snapshot; harvest, which includes waiting for the device), the requests and width
groups per join, the encoder's rows (real and as padded up to a bucket) and, on CUDA, the
device time of the work each join and run queues and of the encodings on the lanes.

`--sync-check` then repeats a short run under `torch.cuda.set_sync_debug_mode("warn")`
and prints every source line that made the host wait for the device, with counts; only
the harvest's wait for its snapshot should appear.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch

from bench.common import append_records, commit, formula_images
from bench.compare import gpu_name
from bench.server import ROOT
from models.devices import resolve_devices
from models.formula.adapter import FormulaRecognizer


class ClosedLoop:
    """A stream `Feed` without a server: `concurrency` requests in flight until `deadline`."""

    def __init__(self, items: list, concurrency: int, deadline: float) -> None:
        self.items = items
        self.concurrency = concurrency
        self.deadline = deadline
        self.outstanding = 0
        self.sent = 0
        self.answered = 0

    def take(self, limit: int) -> list:
        if time.perf_counter() >= self.deadline:
            return []
        count = min(limit, self.concurrency - self.outstanding)
        keys = range(self.sent, self.sent + count)
        taken = [(key, self.items[key % len(self.items)]) for key in keys]
        self.sent += count
        self.outstanding += count
        return taken

    def shares_device(self) -> bool:
        return False

    def cancelled(self, keys: list[int]) -> list[int]:
        return []

    def done(self, results: list) -> None:
        self.outstanding -= len(results)
        self.answered += len(results)

    def finish(self) -> bool:
        return time.perf_counter() >= self.deadline


def timed(phases: defaultdict, name: str, function):
    """`function`, adding its wall time to `phases[name]`."""

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - started

    return wrapper


class DeviceTimes:
    """Device time of the work a function queues, from CUDA events around each call
    (read once the run is over, so timing adds no synchronization)."""

    def __init__(self) -> None:
        self.events: defaultdict[str, list] = defaultdict(list)

    def wrap(self, name: str, function):
        def wrapper(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return function(*args, **kwargs)
            finally:
                end.record()
                self.events[name].append((start, end))

        return wrapper

    def ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {
            name: sum(start.elapsed_time(end) for start, end in pairs)
            for name, pairs in sorted(self.events.items())
        }


def probe(recognizer: FormulaRecognizer, device, items: list, concurrency: int, duration: float):
    """One closed-loop run: formulas/s, mean rows, host seconds per check by phase, and on
    CUDA the device time of the work joins and runs queue."""
    decoder = recognizer.static_decoder(device)
    phases: defaultdict[str, float] = defaultdict(float)
    rows: list[int] = []
    joins: list[tuple[int, int]] = []  # (requests, width groups) per join
    device_times = DeviceTimes() if device.type == "cuda" else None
    run = decoder.run

    def counted_run(shared: bool = False):
        rows.append(decoder.running)
        run(shared=shared)

    join = recognizer.admit

    def counted_join(decoder, new, slot_rows, feed):
        joins.append((len(new), len({item.bucket for _, item in new})))
        join(decoder, new, slot_rows, feed)

    joined = timed(phases, "join", counted_join)
    ran = timed(phases, "run", counted_run)
    if device_times is not None:
        joined, ran = device_times.wrap("join", joined), device_times.wrap("run", ran)
    encoded = [0, 0]  # rows encoded, and as padded up to an encoder bucket
    load_source = decoder._load_source

    def counted_load_source(pixel_values, slots):
        count = pixel_values.shape[0]
        if count <= decoder.encoder_buckets[-1]:  # a larger group recurses in chunks
            encoded[0] += count
            encoded[1] += decoder.encoder_rows(count)
        return load_source(pixel_values, slots)

    encode = counted_load_source
    if device_times is not None:  # events on the lane each encoding runs on
        encode = device_times.wrap("encode (lanes)", encode)
    patched = {
        "_load_source": encode,
        "run": ran,
        "snapshot": timed(phases, "snapshot", decoder.snapshot),
        "harvest": timed(phases, "harvest", decoder.harvest),
    }
    for name, function in patched.items():
        setattr(decoder, name, function)
    recognizer.admit = joined  # an instance attribute over the public method
    try:
        feed = ClosedLoop(items, concurrency, time.perf_counter() + duration)
        started = time.perf_counter()
        recognizer.runner(device).stream(feed)
        elapsed = time.perf_counter() - started
    finally:
        for name in patched:
            delattr(decoder, name)
        del recognizer.admit
    checks = max(len(rows), 1)
    record = {
        "throughput_rps": round(feed.answered / elapsed, 2),
        "answered": feed.answered,
        "mean_rows": round(sum(rows) / checks, 1),
        "checks": len(rows),
        "check_ms": round(1000 * elapsed / checks, 3),
        "host_ms_per_check": {k: round(1000 * v / checks, 3) for k, v in sorted(phases.items())},
        "joins": len(joins),
        "requests_per_join": round(sum(n for n, _ in joins) / max(len(joins), 1), 2),
        "width_groups_per_join": round(sum(g for _, g in joins) / max(len(joins), 1), 2),
        "encoded_rows": encoded[0],
        "encoded_rows_padded": encoded[1],
    }
    if device_times is not None:
        record["device_ms_per_check"] = {
            k: round(v / checks, 3) for k, v in device_times.ms().items()
        }
    return record


def sync_sites(recognizer, device, items: list, concurrency: int, duration: float) -> dict:
    """Source lines that synchronized with the device during a short run, with counts."""
    sites: Counter[str] = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            probe(recognizer, device, items, concurrency, duration)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message):
            sites[f"{Path(warning.filename).name}:{warning.lineno}"] += 1
    return dict(sites.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--concurrency", default="128", help="comma-separated levels")
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--bucket-width",
        type=int,
        default=None,
        help="the server's TEXEL_FORMULA__ADVANCED__BUCKET_WIDTH (default: the server's)",
    )
    parser.add_argument(
        "--admission",
        default="concurrent",
        help="comma-separated: concurrent (width groups on lanes of their own, beside the "
        "steps; the default on CUDA), serial (one after another, behind the steps)",
    )
    parser.add_argument("--sync-check", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    admissions = args.admission.split(",")
    if not set(admissions) <= {"concurrent", "serial"}:
        parser.error("--admission takes concurrent and/or serial")
    device = resolve_devices(args.device)[0]
    recognizer = FormulaRecognizer(
        args.model, [device], continuous=True, bucket_step=args.bucket_width
    )
    recognizer.open()
    recognizer.load(device)
    recognizer.warmup(device, args.max_batch_size)
    if recognizer.runner(device).stream is None:
        sys.exit("this device and model do not stream (static decoder needed)")
    items = [recognizer.preprocess(image) for image in formula_images(args.data, args.images)]
    base = {
        "scenario": "formula",
        "server": "stream-only",
        "gpu": gpu_name(),
        "device": str(device),
        "commit": commit(),
        "command": "python -m bench.stream_probe " + " ".join(sys.argv[1:]),
        "bucket_width": recognizer.bucket_step,
    }
    probe(recognizer, device, items, args.max_batch_size, 2.0)  # warm-up
    records = []
    decoder = recognizer.static_decoder(device)
    for admission in admissions:
        decoder.concurrent_admission = admission == "concurrent"
        for level in (int(c) for c in args.concurrency.split(",")):
            record = {**base, "admission": admission, "concurrency": level}
            record.update(probe(recognizer, device, items, level, args.duration))
            print(json.dumps(record), flush=True)
            records.append(record)
    decoder.concurrent_admission = admissions[0] == "concurrent"  # for --sync-check
    if args.sync_check and device.type == "cuda":
        level = int(args.concurrency.split(",")[0])
        print(json.dumps({"sync_sites": sync_sites(recognizer, device, items, level, 3.0)}))
    if args.out:
        append_records(records, args.out)


if __name__ == "__main__":
    main()
