"""What one decoding step's matrix products cost on this CPU, by weight format.

    python -m bench.cpu_linear --threads 2 --rounds 5

A CPU decoding step of the formula model multiplies a few rows by every linear layer of
the decoder (self-attention Q, K and V fused, its output, cross-attention query and
output, the two feed-forward layers; each layer in turn) and the output projection. On
a CPU without bf16 matrix instructions the served model runs in float32; this measures
the same products, with the shipped model's weights, as float32, as bfloat16 and as int8
(torch's dynamic quantization, weights int8 per tensor, rows quantized per call), for
one row (a lone request) and for 16 (a full CPU batch), and a product of the encoder's
feed-forward shape (256 to 1,024, the first decoder layer's fc1 weights) for the patches
of a median formula. Rounds alternate the formats; the table has
each one's median, and its largest difference from float32 relative to the output's
largest value. Appends a record per row of the table to `--out` if given.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import append_records, commit, machine
from bench.server import ROOT

MEDIAN_PATCHES = 336  # a median dev formula: 8 rows of 42 patches


def step_weights(model) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of every product one decoding step runs, in order."""
    weights = []
    for layer in model.decoder.model.decoder.layers:
        attn = layer.self_attn
        fused = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        bias = None if biases[0] is None else torch.cat(biases)
        weights.append((fused, bias))
        for linear in (
            attn.out_proj,
            layer.encoder_attn.q_proj,
            layer.encoder_attn.out_proj,
            layer.fc1,
            layer.fc2,
        ):
            weights.append((linear.weight, linear.bias))
    head = model.decoder.output_projection
    weights.append((head.weight, head.bias))
    return [(w.detach().float(), None if b is None else b.detach().float()) for w, b in weights]


def formats(weights) -> dict[str, Callable[[torch.Tensor], list[torch.Tensor]]]:
    """Per format, a function running every product on its rows (`x` maps an input
    width to float32 rows of it; float32 out)."""
    bf16 = [(w.bfloat16(), None if b is None else b.bfloat16()) for w, b in weights]
    int8 = []
    for w, b in weights:
        linear = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        linear.weight.data.copy_(w)
        if b is not None:
            linear.bias.data.copy_(b)
        quantized = torch.ao.quantization.quantize_dynamic(
            nn.Sequential(linear), {nn.Linear}, dtype=torch.qint8
        )
        int8.append(quantized)
    return {
        "float32": lambda x: [F.linear(x[w.shape[1]], w, b) for w, b in weights],
        "bfloat16": lambda x: [F.linear(x[w.shape[1]].bfloat16(), w, b).float() for w, b in bf16],
        "int8 dynamic": lambda x: [
            q(x[w.shape[1]]) for q, (w, _) in zip(int8, weights, strict=True)
        ],
    }


def time_us(run: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import VisionEncoderDecoderModel

    model = VisionEncoderDecoderModel.from_pretrained(args.model, dtype=torch.float32).eval()
    step = step_weights(model)
    fc = [step[4]]  # the first layer's fc1 (256 -> 1024): the encoder's feed-forward shape
    cases = [
        ("decoding step, 1 row", step, 1, 200),
        ("decoding step, 16 rows", step, 16, 100),
        (f"encoder feed-forward, {MEDIAN_PATCHES} rows", fc, MEDIAN_PATCHES, 50),
    ]
    records = []
    print(
        "| products | format | us (median of rounds) | vs float32 | largest relative difference |"
    )
    print("|---|---|---:|---:|---:|")
    with torch.inference_mode():
        for label, weights, rows, repeats in cases:
            generator = torch.Generator().manual_seed(0)
            x = {
                width: torch.randn(rows, width, generator=generator)
                for width in sorted({w.shape[1] for w, _ in weights})
            }
            runs = formats(weights)
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    times[name].append(time_us(lambda run=run, x=x: run(x), repeats))
            exact = runs["float32"](x)
            base = statistics.median(times["float32"])
            for name, run in runs.items():
                got = run(x)
                error = max(
                    float((g - e).abs().max() / e.abs().max())
                    for g, e in zip(got, exact, strict=True)
                )
                us = statistics.median(times[name])
                print(f"| {label} | {name} | {us:,.0f} | {us / base:.2f}x | {error:.4f} |")
                records.append(
                    {
                        "scenario": "cpu-linear",
                        "products": label,
                        "format": name,
                        "us": round(us, 1),
                        "relative_to_float32": round(us / base, 3),
                        "largest_relative_difference": round(error, 5),
                        "threads": args.threads,
                        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                        "machine": machine(),
                        "commit": commit(),
                        "command": "python -m bench.cpu_linear " + " ".join(sys.argv[1:]),
                    }
                )
    if args.out:
        append_records(records, args.out)


if __name__ == "__main__":
    main()
