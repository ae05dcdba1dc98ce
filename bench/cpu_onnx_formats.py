"""What the formula model's ONNX Runtime graphs cost on this CPU, by weight format.

    python -m bench.cpu_onnx_formats --rounds 5

Builds the shipped model's step and encoder graphs as the CPU decoder does
(`models/formula/onnx_decode.py`, float32) and times one run of each, median of
`--rounds` rounds (each round 20 runs, formats alternated), with random inputs of a
median formula's shapes (40 cache positions, a strip 384 pixels wide):

- the step, for 1, 4, 8 and 16 rows: float32; int8 as served (`_quantized`: MatMulNBits,
  8-bit blocks of 32, int8 products), on one thread and on every thread; int8 by
  dynamic quantization (MatMulInteger, each product's activations quantized over all
  its rows); 8-bit MatMulNBits with float products (no `accuracy_level`); 4-bit blocks;
- the encoder, one strip: float32, 8-bit MatMulNBits, dynamic quantization.

Each format's largest difference from float32, relative to float32's largest value, is
printed beside its time. Appends a record per row to `--out` if given. Answers and
accuracy come from `bench.cpu_onnx` and `training.formula.evaluate`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import append_records, commit, machine
from bench.cpu_onnx import recognizer
from bench.server import ROOT
from models.formula import onnx_decode

CACHE = 40
WIDTH = 384
ROWS = (1, 4, 8, 16)


def nbits(graph: bytes, bits: int, accuracy_level: int | None) -> bytes:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    with onnx_decode._quiet():
        quantizer = MatMulNBitsQuantizer(
            onnx.load_from_string(graph), bits=bits, block_size=32, is_symmetric=True,
            accuracy_level=accuracy_level,
        )  # fmt: skip
        quantizer.process()
    return quantizer.model.model.SerializeToString()


def dynamic(graph: bytes) -> bytes:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as folder, onnx_decode._quiet():
        source, target = Path(folder, "float32.onnx"), Path(folder, "int8.onnx")
        source.write_bytes(graph)
        quantize_dynamic(
            source,
            target,
            op_types_to_quantize=["MatMul"],
            per_channel=True,
            reduce_range=True,
            weight_type=QuantType.QInt8,
        )
        return target.read_bytes()


def step_feeds(decoder, rows: int, source: int, rng) -> dict[str, np.ndarray]:
    layers, heads, dim = len(decoder.decoder.layers), decoder.num_heads, decoder.head_dim

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "tokens": np.full(rows, 5, dtype=np.int64),
        "positions": np.full(rows, CACHE - 1, dtype=np.int64),
        "self_mask": np.zeros((rows, 1, 1, CACHE), np.float32),
        "past_k": rand(layers, rows, heads, CACHE, dim),
        "past_v": rand(layers, rows, heads, CACHE, dim),
        "cross_k": rand(layers, rows, heads, source, dim),
        "cross_v": rand(layers, rows, heads, source, dim),
        "source_mask": np.zeros((rows, 1, 1, source), np.float32),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON-lines file to append to")
    args = parser.parse_args()

    threads = torch.get_num_threads()
    decoder = recognizer(args.model, "onnx")._decoders["cpu"]
    with torch.no_grad():
        encoder, step = onnx_decode._graphs(decoder, torch.rand(1, 1, 64, WIDTH))
    session = onnx_decode._session
    int8 = onnx_decode._quantized(step)
    steps = {
        "float32": session(step, threads),
        "int8, as served, one thread": session(int8, 1),
        "int8, as served": session(int8, threads),
        "int8, dynamic quantization": session(dynamic(step), threads),
        "8-bit weights, float products": session(nbits(step, 8, None), threads),
        "4-bit weights, int8 products": session(nbits(step, 4, 4), threads),
    }
    encoders = {
        "float32": session(encoder, threads),
        "8-bit weights, int8 products": session(nbits(encoder, 8, 4), threads),
        "int8, dynamic quantization": session(dynamic(encoder), threads),
    }
    rng = np.random.default_rng(0)
    pixels = {"pixels": rng.random((1, 1, 64, WIDTH), dtype=np.float32)}
    source = encoders["float32"].run(None, pixels)[0].shape[-2]
    loads = [("encoder", 1, encoders, pixels)]
    loads += [("step", rows, steps, step_feeds(decoder, rows, source, rng)) for rows in ROWS]

    records = []
    print(f"{machine()}; commit {commit()}; {threads} threads; median of {args.rounds} rounds\n")
    print("| graph | rows | format | ms | largest difference |")
    print("|---|---:|---|---:|---:|")
    for graph, rows, sessions, feeds in loads:
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(args.rounds):
            for name, run in sessions.items():
                run.run(None, feeds)
                started = time.perf_counter()
                for _ in range(20):
                    run.run(None, feeds)
                times[name].append((time.perf_counter() - started) / 20)
        reference = sessions["float32"].run(None, feeds)[0]
        for name, run in sessions.items():
            ms = round(1000 * statistics.median(times[name]), 2)
            out = run.run(None, feeds)[0]
            difference = round(float(np.abs(out - reference).max() / np.abs(reference).max()), 4)
            print(f"| {graph} | {rows} | {name} | {ms} | {difference} |")
            records.append({
                "scenario": "formula-cpu-onnx-format", "graph": graph, "rows": rows,
                "format": name, "ms": ms, "largest_relative_difference": difference,
                "threads": threads, "machine": machine(), "commit": commit(),
                "command": "python -m bench.cpu_onnx_formats " + " ".join(sys.argv[1:]),
            })  # fmt: skip
    if args.out:
        append_records(records, args.out)


if __name__ == "__main__":
    main()
