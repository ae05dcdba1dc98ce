"""The formula model's CPU decoder with its math in PyTorch, in ONNX Runtime and in
ONNX Runtime with int8 step weights, one picture at a time.

    python -m bench.cpu_onnx --data ../shared/data --count 120

Loads the shipped model three times as the server does (`FormulaRecognizer` on the CPU):
its static decoder's math in PyTorch (`--dtype float32` without ONNX Runtime), in ONNX
Runtime (`--dtype float32`) and in ONNX Runtime with the steps' weights in int8 (`--dtype
auto` on a CPU without bf16 instructions, `models/formula/onnx_decode.py`). Each picture
(the benchmark's, preprocessed as the server does) is decoded by each in turn, so the
machine's drift falls on all alike. Prints each one's share of answers identical to
PyTorch's and its median and mean time a formula, and appends a record to `--out` if
given. Served figures (HTTP, one request at a time and concurrent) come from `bench.cpu`;
accuracy from `training.formula.evaluate`.
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

DECODERS = {"torch": "PyTorch", "onnx": "ONNX Runtime", "int8": "ONNX Runtime, int8 steps"}


def recognizer(model: str, decoder: str) -> FormulaRecognizer:
    cpu = torch.device("cpu")
    available = onnx_decode.available
    if decoder == "torch":
        onnx_decode.available = lambda: False
    try:
        loaded = FormulaRecognizer(model, [cpu], dtype="auto" if decoder == "int8" else "float32")
        loaded.open()
        loaded.load(cpu)
        loaded.warmup(cpu, max_batch_size=16)
    finally:
        onnx_decode.available = available
    made = loaded._decoders["cpu"]
    onnx = getattr(made, "onnx", False)
    got = "torch" if not onnx else ("int8" if made._stepper is made._int8_step else "onnx")
    if got != decoder:
        raise SystemExit(f"wanted the {decoder} decoder, got {got} on this machine")
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--count", type=int, default=120, help="benchmark images, by name")
    parser.add_argument("--out", type=Path, default=None, help="JSON-lines file to append to")
    args = parser.parse_args()

    cpu = torch.device("cpu")
    every = {name: recognizer(args.model, name) for name in DECODERS}
    items = [every["torch"].preprocess(image) for image in formula_images(args.data, args.count)]
    times: dict[str, list[float]] = {name: [] for name in every}
    same = dict.fromkeys(every, 0)
    for item in items:
        answers = {}
        for name, loaded in every.items():
            started = time.perf_counter()
            answers[name] = loaded.runner(cpu)([item], lambda: False)[0].token_ids
            times[name].append(time.perf_counter() - started)
        for name in every:
            same[name] += answers[name] == answers["torch"]

    def ms(name: str, how) -> float:
        return round(1000 * how(times[name]), 1)

    result = {
        "scenario": "formula-cpu-onnx",
        "machine": machine(),
        "commit": commit(),
        "command": "python -m bench.cpu_onnx " + " ".join(sys.argv[1:]),
        "threads": torch.get_num_threads(),
        "images": len(items),
        "same_answers": same["onnx"],
        "int8_same_answers": same["int8"],
        **{f"{name}_{stat}_ms": ms(name, how) for name in every for stat, how in
           [("median", statistics.median), ("mean", statistics.fmean)]},
    }  # fmt: skip
    print(f"{machine()}; commit {commit()}; {len(items)} pictures, one at a time\n")
    print("| decoder's math | answers as PyTorch's | median ms | mean ms |")
    print("|---|---:|---:|---:|")
    for name, label in DECODERS.items():
        shown = f"{same[name]} / {len(items)}" if name != "torch" else "-"
        print(
            f"| {label} | {shown} | {ms(name, statistics.median)} | {ms(name, statistics.fmean)} |"
        )
    if args.out:
        append_records([result], args.out)


if __name__ == "__main__":
    main()
