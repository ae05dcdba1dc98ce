"""What a formula picture costs before the model sees it: the preprocessor an HTTP process
runs (decode, ink on paper, frame, margins, tilt, scale, fit), timed on real images.

    python -m bench.preprocess --data ../shared/data --count 500 --rounds 3

One thread, as each request's preprocessing runs. Prints a table (the best round's mean,
and the median and p99 of one picture's time over every round) and appends a record to
`--out` if given. On a GPU this work is the host's share of every request.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.common import append_records, commit, formula_images, machine
from bench.server import ROOT
from models.formula.adapter import FormulaRecognizer
from models.formula.preprocess import FormulaPreprocessor


def measure(images: list[bytes], preprocessor: FormulaPreprocessor, rounds: int) -> dict:
    """Per-picture times over `rounds` passes through `images`, after one pass to warm up."""
    for image in images:
        preprocessor(image)
    means, each = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        for image in images:
            begun = time.perf_counter()
            preprocessor(image)
            each.append(time.perf_counter() - begun)
        means.append((time.perf_counter() - started) / len(images))
    each.sort()
    return {
        "mean_ms": round(min(means) * 1e3, 3),
        "p50_ms": round(statistics.median(each) * 1e3, 3),
        "p99_ms": round(each[int(0.99 * (len(each) - 1))] * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "formula" / "default")
    parser.add_argument("--count", type=int, default=500, help="images (the first, by name)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="JSON-lines file to append to")
    args = parser.parse_args()

    recognizer = FormulaRecognizer(str(args.model), [torch.device("cpu")])
    recognizer.open()  # the model's configuration, not its weights
    preprocessor = recognizer.preprocessor
    images = formula_images(args.data, args.count)
    result = measure(images, preprocessor, args.rounds)
    record = {
        "scenario": "formula-preprocess",
        "machine": machine(),
        "commit": commit(),
        "command": f"python -m bench.preprocess --count {args.count} --rounds {args.rounds}",
        "pictures": len(images),
        **result,
    }
    print(f"machine: {record['machine']}; commit {record['commit']}\n")
    print("| pictures | mean ms | p50 ms | p99 ms |\n|---:|---:|---:|---:|")
    print(f"| {len(images)} | {result['mean_ms']} | {result['p50_ms']} | {result['p99_ms']} |")
    if args.out:
        append_records([record], args.out)


if __name__ == "__main__":
    main()
