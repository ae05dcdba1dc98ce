"""How often a decode looks for finished rows, on a CPU: after every step against every 8.

    python -m bench.check_interval --data ../shared/data --images 200

Loads the formula model in this process, as a CPU engine runs it, and decodes each real
formula image alone twice, once per interval, in alternating order so that a drifting
machine favours neither. Prints the steps run, the median decode time and whether the
tokens agree, and appends a record to `bench/results/cpu.jsonl`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import append_records, commit, formula_images, machine
from bench.server import ROOT
from models.formula.adapter import FormulaRecognizer
from models.formula.fast_decode import CHECK_EVERY

INTERVALS = (1, CHECK_EVERY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu.jsonl")
    args = parser.parse_args()

    device = torch.device("cpu")
    recognizer = FormulaRecognizer(args.model, [device])
    recognizer.open()
    recognizer.load(device)
    recognizer.warmup(device, 1)
    decoder = recognizer.static_decoder(device)
    run = recognizer.runner(device)
    items = [recognizer.preprocess(data) for data in formula_images(args.data, args.images)]

    seconds: dict[int, list[float]] = {every: [] for every in INTERVALS}
    steps = dict.fromkeys(INTERVALS, 0)
    identical = 0
    for i, item in enumerate(items):
        tokens = {}
        for every in INTERVALS if i % 2 else reversed(INTERVALS):
            decoder.steps_per_check = every
            started = time.perf_counter()
            tokens[every] = run([item], lambda: False)[0].token_ids
            seconds[every].append(time.perf_counter() - started)
        identical += len({tuple(t) for t in tokens.values()}) == 1
        needed = len(tokens[1]) + 1  # its tokens and the end token
        for every in INTERVALS:
            steps[every] += -(-needed // every) * every

    print(f"{len(items)} images, {identical} decoded to identical tokens\n")
    print("| look after | steps | median decode ms | total s |")
    print("|---|---:|---:|---:|")
    records = []
    for every in INTERVALS:
        median_ms = statistics.median(seconds[every]) * 1000
        print(f"| {every} step(s) | {steps[every]} | {median_ms:.1f} | {sum(seconds[every]):.2f} |")
        records.append(
            {
                "scenario": "formula-check-interval",
                "steps_per_check": every,
                "images": len(items),
                "identical": identical,
                "steps": steps[every],
                "median_decode_ms": round(median_ms, 1),
                "total_s": round(sum(seconds[every]), 2),
                "machine": machine(),
                "commit": commit(),
                "command": " ".join(["python -m bench.check_interval", *sys.argv[1:]]),
            }
        )
    append_records(records, args.out)


if __name__ == "__main__":
    main()
