"""Does `torch.compile` or channels_last pay for the diffusion UNet? The raw pipeline timed
each way, same GPU, same batch sizes.

    python -m bench.image_unet --size sd15 --batch-sizes 1,8 --steps 20

Builds the random-weight pipeline of `bench.compare_image` and, for each variant,
times whole pipeline calls (best of `--repeats` after the warm-up calls, which include
any compilation, reported as `first_call_s`). Variants: `eager`, `channels_last` (UNet
and VAE in channels_last), `compile` (`torch.compile` of the UNet, default mode) and
`compile+channels_last`. Records go to `bench/results/<gpu>.jsonl` (scenario
"image-unet").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.common import append_records
from bench.compare import gpu_results_file
from bench.compare_image import PROMPTS, SHAPES, build_pipeline, record_base

VARIANTS = ("eager", "channels_last", "compile", "compile+channels_last")


def time_variant(model: Path, variant: str, batch_sizes: list[int], args) -> list[dict]:
    from diffusers import DiffusionPipeline

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.float16 if cuda else torch.float32
    pipe = DiffusionPipeline.from_pretrained(str(model), dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    if "channels_last" in variant:
        pipe.unet.to(memory_format=torch.channels_last)
        pipe.vae.to(memory_format=torch.channels_last)
    if "compile" in variant:
        pipe.unet = torch.compile(pipe.unet)
    rows = []
    for size in batch_sizes:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(size)]
        times = []
        for _ in range(args.repeats + 2):  # two warm-up calls: compilation, then caches
            generators = [torch.Generator(device).manual_seed(i) for i in range(size)]
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.inference_mode():
                pipe(prompts, num_inference_steps=args.steps, guidance_scale=args.guidance,
                     generator=generators)  # fmt: skip
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        best = min(times[2:])
        row = {"variant": variant, "batch_size": size, "images_per_s": round(size / best, 3),
               "call_s": round(best, 3), "first_call_s": round(times[0], 1)}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    del pipe
    if cuda:
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("sd15", "tiny"), default="sd15")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8])  # fmt: skip
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=7.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")

    base = record_base("image-unet", "bench.image_unet", args)
    records = []
    with tempfile.TemporaryDirectory(prefix="texel-sd-") as tmp:
        model = build_pipeline(Path(tmp), SHAPES[args.size], args.steps, args.guidance)
        for variant in args.variants:
            rows = time_variant(model, variant, args.batch_sizes, args)
            records += [{**base, **row} for row in rows]
    append_records(records, args.out or gpu_results_file())
    print(f"\n{base['gpu']}; commit {base['commit']}; {args.size}, {args.steps} steps\n")
    print("| variant | batch | images/s | call s | first call s |")
    print("|---|---:|---:|---:|---:|")
    for r in records:
        print(f"| {r['variant']} | {r['batch_size']} | {r['images_per_s']} | {r['call_s']} "
              f"| {r['first_call_s']} |")  # fmt: skip


if __name__ == "__main__":
    main()
