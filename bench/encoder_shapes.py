"""What one encoder call costs the worker thread, by how its input shape was seen before.

A served formula batch mixes width buckets and encodes each bucket's rows alone, so
eager encoding meets a (rows, width) shape it has not run before on most batches.
This prints, for the shipped formula model on one device, the host time of an eager
encoder call at a shape never run before, of the same call repeated, and of the
CUDA-graph replay the server uses instead (rows padded to a batch bucket).

    python -m bench.encoder_shapes [--model models/formula/default] [--shapes 40]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from models.devices import resolve_devices
from models.formula.adapter import FormulaRecognizer
from models.formula.preprocess import bucket_width


def timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/formula/default")
    parser.add_argument("--shapes", type=int, default=40, help="new (rows, width) shapes to try")
    parser.add_argument("--max-batch-size", type=int, default=128)
    args = parser.parse_args()

    device = resolve_devices("auto")[0]
    recognizer = FormulaRecognizer(args.model, [device])
    recognizer.open()
    recognizer.load(device)
    started = time.perf_counter()
    recognizer.warmup(device, args.max_batch_size)
    warmup_s = time.perf_counter() - started
    spec = recognizer.spec
    decoder = recognizer.static_decoder(device)
    model = recognizer.replica(device)
    step = recognizer.bucket_step
    widths = sorted({bucket_width(w, spec, step) for w in range(1, spec.max_width + 1)})
    rng = random.Random(0)
    shapes = [
        (rng.randint(3, args.max_batch_size - 1), rng.choice(widths)) for _ in range(args.shapes)
    ]
    first, repeat, replay = [], [], []
    with torch.inference_mode():
        for rows, width in shapes:
            pixels = torch.zeros(rows, 1, spec.height, width, device=device, dtype=model.dtype)
            first.append(timed(device, lambda p=pixels: model.encoder(pixel_values=p)))
            repeat.append(timed(device, lambda p=pixels: model.encoder(pixel_values=p)))
            if decoder is not None:
                replay.append(
                    timed(device, lambda p=pixels: decoder._load_source(p, list(range(p.shape[0]))))
                )
    table = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shapes": len(first),
        "warmup_s": round(warmup_s, 1),
        "encoder_graphs": sum(
            g is not None for g in getattr(decoder, "_encoder_graphs", {}).values()
        ),
        "new_shape_ms": round(statistics.median(first), 2),
        "repeat_ms": round(statistics.median(repeat), 2),
        "served_load_source_ms": round(statistics.median(replay), 2) if replay else None,
    }
    print("| device | shapes | eager, new shape (ms) | eager, repeated (ms) | served path (ms) |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| {table['device']} | {table['shapes']} | {table['new_shape_ms']} | "
        f"{table['repeat_ms']} | {table['served_load_source_ms']} |"
    )
    print(json.dumps(table))


if __name__ == "__main__":
    main()
