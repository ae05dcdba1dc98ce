"""Does step-level batching change images? And what does an image cost in device memory?

    python -m bench.image_equivalence --model-dir /tmp/sd15 --prompts 100 --steps 20

Every prompt is generated alone through the served adapter (Texel's denoising loop),
then all of them again in one running loop that they join at step boundaries, a few
steps apart, up to `--rows` at once, as requests arrive at a busy server. Each joined
image is compared with the same request made alone (PSNR; identical pixels count as
infinite), and the first few alone images with the diffusers pipeline's own call.

Then the peak device memory of a loop of 1 and of `--rows` images at each side in
`--sides`, from which one image's share and the fixed part follow. Prints one JSON line
per measurement and appends them to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from bench.common import append_records, commit
from bench.compare import gpu_name
from bench.compare_image import SHAPES, build_pipeline
from models.image.adapter import ImageGenerator, ImageJob


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def joined_run(loop, jobs: list[ImageJob], rows: int, seed: int) -> list[np.ndarray]:
    """All jobs through one running loop: a new one joins every 1-5 steps while there is
    room, each leaves when its steps end."""
    rng = random.Random(seed)
    queue = list(enumerate(jobs))
    running, images = [], {}
    until_next = 0
    with torch.inference_mode():
        while queue or running:
            if queue and len(running) < rows and (until_next <= 0 or not running):
                index, job = queue.pop(0)
                running.append((index, loop.join(job)))
                until_next = rng.randint(1, 5)
            loop.step([r for _, r in running])
            until_next -= 1
            finished = [(i, r) for i, r in running if r.done]
            if finished:
                decoded = loop.decode([r for _, r in finished])
                for (i, _), pixels in zip(finished, decoded, strict=True):
                    images[i] = pixels[0]
                running = [(i, r) for i, r in running if not r.done]
    return [images[i] for i in range(len(jobs))]


def peak_memory(generator: ImageGenerator, device, side: int, count: int) -> int:
    """Peak bytes allocated above the loaded model by a loop of `count` images."""
    loop = generator.denoising_loop(device)
    job = ImageJob("memory", None, side, side, 2, 7.5, tuple(range(count)))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        request = loop.join(job)
        while not request.done:
            loop.step([request])
        loop.decode([request])
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("sd15", "tiny"), default="sd15")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--pipeline-checks", type=int, default=10)
    parser.add_argument("--sides", type=lambda s: [int(x) for x in s.split(",")],
                        default=[512, 768, 1024])  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not (args.model_dir / "model_index.json").exists():
        build_pipeline(args.model_dir, SHAPES[args.size], args.steps, 7.5)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = {"scenario": "image-equivalence", "gpu": gpu_name(), "commit": commit(),
            "command": "python -m bench.image_equivalence " + " ".join(sys.argv[1:]),
            "model": f"{args.size} (random weights)", "steps": args.steps}  # fmt: skip
    records = []

    def keep(record: dict) -> None:
        records.append({**base, **record})
        print(json.dumps(records[-1]), flush=True)

    generator = ImageGenerator(str(args.model_dir), [device])
    generator.open()
    generator.load(device)
    generator.warmup(device, max_batch_size=args.rows)
    d = generator.defaults
    jobs = [
        ImageJob(
            f"prompt {i}: shapes of colour {i % 7}",
            None,
            d.width,
            d.height,
            args.steps,
            d.guidance,
            (i,),
        )  # fmt: skip
        for i in range(args.prompts)
    ]
    run = generator.runner(device)
    alone = [run([job], lambda: False)[0].images[0] for job in jobs]
    loop = generator.denoising_loop(device)
    joined = joined_run(loop, jobs, args.rows, seed=0)
    values = [psnr(a, b) for a, b in zip(alone, joined, strict=True)]
    finite = [v for v in values if math.isfinite(v)]
    keep({"comparison": "joined a running loop vs alone", "images": len(values),
          "identical": len(values) - len(finite),
          "min_psnr_db": round(min(finite), 2) if finite else "inf",
          "median_psnr_db": round(statistics.median(values), 2) if finite else "inf"})  # fmt: skip

    pipe = loop.pipe
    checks = []
    for job in jobs[: args.pipeline_checks]:
        with torch.inference_mode():
            image = pipe(job.prompt, height=job.height, width=job.width,
                         num_inference_steps=job.steps, guidance_scale=job.guidance,
                         generator=torch.Generator(device).manual_seed(job.seeds[0]),
                         output_type="np").images[0]  # fmt: skip
        checks.append(psnr((image * 255).round().astype(np.uint8), alone[len(checks)]))
    finite = [v for v in checks if math.isfinite(v)]
    keep({"comparison": "Texel's loop vs the diffusers pipeline, alone", "images": len(checks),
          "identical": len(checks) - len(finite),
          "min_psnr_db": round(min(finite), 2) if finite else "inf"})  # fmt: skip

    if device.type == "cuda":
        for side in args.sides:
            one = peak_memory(generator, device, side, 1)
            many = peak_memory(generator, device, side, args.rows)
            per_image = (many - one) / (args.rows - 1)
            keep({"memory_side": side, "peak_mib_1": round(one / 2**20),
                  f"peak_mib_{args.rows}": round(many / 2**20),
                  "per_image_mib": round(per_image / 2**20),
                  "fixed_mib": round((one - per_image) / 2**20)})  # fmt: skip
    if args.out:
        append_records(records, args.out)


if __name__ == "__main__":
    main()
