"""Where a formula decoding step's time goes, with a full stream of real formulas.

    python -m bench.step_profile --data ../shared/data --rows 128

Loads the formula model on the default device as the server does (`FormulaRecognizer`,
warmed up for `--rows` rows), admits `--rows` real formula images into its static decoder
and then:

- times `run()` (CHECK_EVERY steps: one CUDA graph replay on a GPU), per step;
- times the same with a decoder whose buffers end at the admitted rows' longest source
  instead of the widest bucket's (cross-attention reads every row's whole source buffer
  each step), to size source-length buckets before building them;
- profiles steps run eagerly with `torch.profiler` and prints the operators that take
  the most device time (CPU time on a CPU).

Prints one JSON line with the timings and the profile table. With `--sweep 64,96,128`
it instead times a step at each of those row counts, each in a decoder of exactly that
many slots (so its own graph, no padding rows), one JSON line each: how a step's cost
grows with its rows, which says whether batch buckets between the powers of two pay.
With `--encoder-sweep 1,2,4,8` it times the encoder instead: one encoding (a graph
replay on a GPU) of each row count at each width bucket, one JSON line per width: what
a join's width group costs, and what padding its rows up to a bucket costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import append_records, commit, formula_images
from bench.compare import gpu_name
from bench.server import ROOT
from models.devices import resolve_devices
from models.formula.adapter import FormulaRecognizer
from models.formula.fast_decode import CHECK_EVERY, StaticGreedyDecoder


@torch.inference_mode()  # as the stream runs it: outside, every eager step is far slower
def step_ms(decoder: StaticGreedyDecoder, repeats: int) -> float:
    """Mean time of one step over `repeats` runs (`steps_per_check` steps each: 8 on a
    GPU, one on a CPU)."""
    decoder.run()  # warm: the bucket's graph exists, caches are filled
    cuda = decoder.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(decoder.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    started = time.perf_counter()
    for _ in range(repeats):
        decoder.run()
    if cuda:
        end.record()
        end.synchronize()
        total = start.elapsed_time(end)
    else:
        total = 1000 * (time.perf_counter() - started)
    return total / (repeats * decoder.steps_per_check)


def admit(recognizer: FormulaRecognizer, decoder: StaticGreedyDecoder, items: list) -> int:
    """Admit `items` as the stream would; the longest source among them."""
    pixels, _, _ = recognizer.upload(decoder, items)
    slots = decoder.admit(pixels)
    return max(decoder._slot_source[slot] for slot in slots)


def record(scenario: str, device: torch.device, **fields) -> dict:
    """A JSON record of this run: what it measured, where, at which commit, how."""
    return {
        "scenario": scenario,
        "device": str(device),
        "gpu": gpu_name(),
        "commit": commit(),
        "command": "python -m bench.step_profile " + " ".join(sys.argv[1:]),
        **fields,
    }


def sweep(args, recognizer: FormulaRecognizer, device, sizes: list[int]) -> None:
    """One JSON line per size: a step of that many rows, in a decoder of that many slots."""
    recognizer.warmup(device, 1)
    base = recognizer.static_decoder(device)
    images = formula_images(args.data, max(sizes))
    items = [recognizer.preprocess(image) for image in images]
    for rows in sizes:
        started = time.perf_counter()
        decoder = StaticGreedyDecoder(
            recognizer.replica(device),
            max_batch_size=rows,
            max_new_tokens=base.max_new_tokens,
            max_source_len=base.max_source_len,
        )
        decoder.warmup()
        fields = {"rows": rows, "warmup_s": round(time.perf_counter() - started, 1)}
        admit(recognizer, decoder, items[:rows])
        fields["step_ms"] = round(step_ms(decoder, args.repeats), 4)
        emit(args, record("formula-step-sweep", device, **fields))
        del decoder


def encoder_sweep(args, recognizer: FormulaRecognizer, device, sizes: list[int]) -> None:
    """One JSON line per width bucket among the benchmark's images: ms per encoding of
    each row count."""
    recognizer.warmup(device, max(sizes))
    images = formula_images(args.data, 64)
    items = [recognizer.preprocess(image) for image in images]
    for width, ms in encoding_ms(recognizer, device, items, sizes, args.repeats):
        emit(args, record("formula-encoder-sweep", device, width=width, ms_by_rows=ms))


@torch.inference_mode()
def encoding_ms(
    recognizer: FormulaRecognizer, device, items: list, sizes: list[int], repeats: int
) -> list[tuple[int, dict[int, float]]]:
    """For each width bucket of `items`, the mean ms of one encoding of each row count
    (copies of one of its images) as a join's width group runs it (`_load_source`: a
    graph replay on a GPU, eager on a CPU), into the decoder's first slots."""
    decoder = recognizer.static_decoder(device)
    slots = list(range(max(sizes)))
    cuda = device.type == "cuda"
    results = []
    for width in sorted({item.bucket for item in items}):
        item = next(item for item in items if item.bucket == width)
        group = recognizer.upload(decoder, [item])[0][0]
        ms = {}
        for rows in sizes:
            batch = group[:1].expand(rows, *group.shape[1:]).contiguous()
            decoder._load_source(batch, slots[:rows])  # warm
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            for _ in range(repeats):
                decoder._load_source(batch, slots[:rows])
            if cuda:
                torch.cuda.synchronize(device)
            ms[rows] = round(1000 * (time.perf_counter() - started) / repeats, 4)
        results.append((width, ms))
    return results


def emit(args, result: dict) -> None:
    """Print a record as one JSON line, and append it to `--out` if given."""
    print(json.dumps(result), flush=True)
    if args.out:
        append_records([result], args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument(
        "--repeats",
        type=int,
        default=20,
        help="runs timed (CHECK_EVERY steps each on a GPU, one on a CPU)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--sweep", default=None, help="row counts, comma-separated")
    parser.add_argument(
        "--encoder-sweep", default=None, help="row counts of one encoding, comma-separated"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON-lines file to append to")
    args = parser.parse_args()

    device = resolve_devices(args.device)[0]
    recognizer = FormulaRecognizer(args.model, [device], decoder="static")
    recognizer.open()
    recognizer.load(device)
    if args.encoder_sweep:
        sizes = [int(rows) for rows in args.encoder_sweep.split(",")]
        encoder_sweep(args, recognizer, device, sizes)
        return
    if args.sweep:
        sweep(args, recognizer, device, [int(rows) for rows in args.sweep.split(",")])
        return
    recognizer.warmup(device, args.rows)
    decoder = recognizer.static_decoder(device)
    images = formula_images(args.data, args.rows)
    items = [recognizer.preprocess(image) for image in images]
    longest = admit(recognizer, decoder, items)
    result = record(
        "formula-step",
        device,
        rows=args.rows,
        max_source_len=decoder.max_source_len,
        longest_admitted_source=longest,
        step_ms=round(step_ms(decoder, args.repeats), 4),
    )
    decoder.release(list(range(args.rows)))

    trimmed = StaticGreedyDecoder(
        recognizer.replica(device),
        max_batch_size=args.rows,
        max_new_tokens=decoder.max_new_tokens,
        max_source_len=longest,
    )
    trimmed.warmup()
    admit(recognizer, trimmed, items)
    result["step_ms_source_trimmed"] = round(step_ms(trimmed, args.repeats), 4)

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    bucket = decoder._bucket_of(args.rows) if decoder.use_cuda_graphs else args.rows
    admit(recognizer, decoder, items)
    with torch.inference_mode(), profile(activities=activities) as prof:
        for _ in range(CHECK_EVERY):
            decoder._step(bucket)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    emit(args, result)
    print(prof.key_averages().table(sort_by=sort, row_limit=25))


if __name__ == "__main__":
    main()
