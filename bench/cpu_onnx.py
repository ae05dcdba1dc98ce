"""The formula model's CPU decoder with its math in ONNX Runtime against PyTorch, one
picture at a time.

    python -m bench.cpu_onnx --data ../shared/data --count 120

Loads the shipped model twice as the server does (`FormulaRecognizer` on the CPU): once
with its static decoder's math in ONNX Runtime (`models/formula/onnx_decode.py`, the
default where it is installed) and once in PyTorch. Each picture (the benchmark's,
preprocessed as the server does) is decoded by both in turn, so the machine's drift falls
on both alike. Prints the share of identical answers and each side's median and mean time
a formula, and appends a record to `--out` if given. Served figures (HTTP, one request
at a time and concurrent) come from `bench.cpu`.
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
from models.formula import onnx_decode
from models.formula.adapter import FormulaRecognizer


def recognizer(model: str, onnx: bool) -> FormulaRecognizer:
    cpu = torch.device("cpu")
    available = onnx_decode.available
    if not onnx:
        onnx_decode.available = lambda: False
    try:
        loaded = FormulaRecognizer(model, [cpu], dtype="float32")
        loaded.open()
        loaded.load(cpu)
        loaded.warmup(cpu, max_batch_size=16)
    finally:
        onnx_decode.available = available
    decoder = loaded._decoders["cpu"]
    if getattr(decoder, "onnx", False) != onnx:
        raise SystemExit(f"wanted onnx={onnx}, got {type(decoder).__name__}")
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--count", type=int, default=120, help="benchmark images, by name")
    parser.add_argument("--out", type=Path, default=None, help="JSON-lines file to append to")
    args = parser.parse_args()

    cpu = torch.device("cpu")
    both = {"onnx": recognizer(args.model, True), "torch": recognizer(args.model, False)}
    items = [both["onnx"].preprocess(image) for image in formula_images(args.data, args.count)]
    times: dict[str, list[float]] = {name: [] for name in both}
    same = 0
    for item in items:
        answers = []
        for name, loaded in both.items():
            started = time.perf_counter()
            answers.append(loaded.runner(cpu)([item], lambda: False)[0].token_ids)
            times[name].append(time.perf_counter() - started)
        same += answers[0] == answers[1]

    def ms(name: str, how) -> float:
        return round(1000 * how(times[name]), 1)

    result = {
        "scenario": "formula-cpu-onnx",
        "machine": machine(),
        "commit": commit(),
        "command": "python -m bench.cpu_onnx " + " ".join(sys.argv[1:]),
        "threads": torch.get_num_threads(),
        "images": len(items),
        "same_answers": same,
        **{f"{name}_{stat}_ms": ms(name, how) for name in both for stat, how in
           [("median", statistics.median), ("mean", statistics.fmean)]},
    }  # fmt: skip
    print(f"{machine()}; commit {commit()}; {len(items)} pictures, one at a time\n")
    print("| decoder's math | same answers | median ms | mean ms |")
    print("|---|---:|---:|---:|")
    for name, label in [("torch", "PyTorch"), ("onnx", "ONNX Runtime")]:
        shown = f"{same} / {len(items)}" if name == "onnx" else "-"
        print(
            f"| {label} | {shown} | {ms(name, statistics.median)} | {ms(name, statistics.fmean)} |"
        )
    if args.out:
        append_records([result], args.out)


if __name__ == "__main__":
    main()
