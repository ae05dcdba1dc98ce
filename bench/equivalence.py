"""Does batching change answers? The same formulas decoded one at a time and in batches.

    python -m bench.equivalence --images 500 --batch-size 128

Batches are formed the way the server forms them under load (arrival order,
widths merged and padded to the widest), through the served adapter on the
default device. With continuous batching (the default with the static decoder)
the formulas also go through the adapter's stream, joining the running decode in
waves of random size at every check, as requests arrive at a busy server. Also
compares Texel's static decoder with transformers' `generate()` on the same
batches where both are available. Prints one JSON line per comparison, with each
answer that differs (its image, both answers, the token where they part), and
appends them to `--out`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from bench.common import append_records, commit, formula_images
from bench.compare import gpu_name
from bench.server import ROOT
from models.devices import resolve_devices
from models.formula.adapter import FormulaRecognizer


def decode_all(recognizer: FormulaRecognizer, device, items: list, batch_size: int) -> list[str]:
    run = recognizer.runner(device)
    texts: list[str] = []
    for start in range(0, len(items), batch_size):
        tokens = run(items[start : start + batch_size], lambda: False)
        texts += [recognizer.detokenize(t).latex for t in tokens]
    return texts


class _Arrivals:
    """A stream `Feed` without a server: items arrive in waves of 1..`wave` per check."""

    def __init__(self, items: list, wave: int, seed: int = 0) -> None:
        self.waiting = list(enumerate(items))
        self.wave = wave
        self.random = random.Random(seed)
        self.answers: dict[int, object] = {}

    def take(self, limit: int) -> list:
        count = min(limit, self.random.randint(1, self.wave))
        taken, self.waiting = self.waiting[:count], self.waiting[count:]
        return taken

    def shares_device(self) -> bool:
        return False

    def cancelled(self, keys: list[int]) -> list[int]:
        return []

    def done(self, results: list) -> None:
        self.answers.update(results)

    def finish(self) -> bool:
        return not self.waiting


def stream_all(recognizer: FormulaRecognizer, device, items: list, wave: int) -> list[str]:
    arrivals = _Arrivals(items, wave)
    recognizer.runner(device).stream(arrivals)
    return [recognizer.detokenize(arrivals.answers[i]).latex for i in range(len(items))]


def compare(name: str, left: list[str], right: list[str], **extra) -> dict:
    """How many answers agree, and for each that does not, its image and both answers
    with the token where they part (the first token that differs)."""
    differ = [i for i, (a, b) in enumerate(zip(left, right, strict=True)) if a != b]
    return {
        "comparison": name,
        "images": len(left),
        "identical": len(left) - len(differ),
        "identical_share": round(1 - len(differ) / len(left), 4),
        "differences": [_difference(i, left[i], right[i]) for i in differ],
        **extra,
    }


def _difference(index: int, left: str, right: str) -> dict:
    a, b = left.split(), right.split()
    pairs = enumerate(zip(a, b, strict=False))
    part = next((k for k, (x, y) in pairs if x != y), min(len(a), len(b)))
    return {"image": index, "left": left, "right": right, "parts_at_token": part}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--decoder", default="auto", help="the served decoder setting")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="the served batch_invariant setting"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    device = resolve_devices(args.device)[0]
    images = formula_images(args.data, args.images)
    recognizers = {}
    for label, decoder in (("served", args.decoder), ("generate", "generate")):
        recognizer = FormulaRecognizer(
            args.model, [device], decoder=decoder, batch_invariant=args.batch_invariant
        )
        recognizer.open()
        recognizer.load(device)
        recognizer.warmup(device, args.batch_size)
        recognizers[label] = recognizer
    served = recognizers["served"]
    items = [served.preprocess(image) for image in images]
    base = {
        "scenario": "formula-equivalence",
        "device": str(device),
        "gpu": gpu_name(),
        "batch_invariant": args.batch_invariant,
        "commit": commit(),
        "command": "python -m bench.equivalence " + " ".join(sys.argv[1:]),
    }
    results = {}
    for label, recognizer, size in (
        ("served, one at a time", served, 1),
        ("served, batched", served, args.batch_size),
        ("generate, batched", recognizers["generate"], args.batch_size),
    ):
        started = time.perf_counter()
        results[label] = decode_all(recognizer, device, items, size)
        print(f"{label}: {time.perf_counter() - started:.1f} s", flush=True)
    streams = served.runner(device).stream is not None
    if streams:
        started = time.perf_counter()
        results["served, streamed"] = stream_all(served, device, items, args.batch_size // 4)
        print(f"served, streamed: {time.perf_counter() - started:.1f} s", flush=True)
    static = served.uses_static_decoder(device)
    records = [
        compare(
            "batched vs one at a time",
            results["served, batched"],
            results["served, one at a time"],
            decoder="static" if static else "generate",
            batch_size=args.batch_size,
            **base,
        ),  # fmt: skip
        compare(
            "static decoder vs generate (batched)",
            results["served, batched"],
            results["generate, batched"],
            static_decoder_used=static,
            batch_size=args.batch_size,
            **base,
        ),  # fmt: skip
    ]
    if streams:
        records.append(
            compare(
                "streamed (continuous batching) vs one at a time",
                results["served, streamed"],
                results["served, one at a time"],
                batch_size=args.batch_size,
                **base,
            )
        )
        records.append(
            compare(
                "streamed vs batched",
                results["served, streamed"],
                results["served, batched"],
                batch_size=args.batch_size,
                **base,
            )
        )
    for record in records:
        print(json.dumps(record), flush=True)
    if args.out:
        append_records(records, args.out)


if __name__ == "__main__":
    main()
