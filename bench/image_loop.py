"""Texel's denoising loop against the diffusers pipeline, in one process, no HTTP.

    python -m bench.image_loop --model-dir /tmp/sd15 --batch-sizes 1,8 --steps 20

For each batch size B: images/s of one pipeline call of B prompts and of Texel's loop
running the same B requests together (best of `--repeats`), then a staggered stream: 6B
requests through one loop of at most B rows, each joining as soon as a row is free, the
steady state of a loaded server. With `--profile`, the CPU and CUDA time of the top
operators over a few steps of a full loop. Prints a table and one JSON line per figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.common import append_records, commit
from bench.compare import gpu_name
from bench.compare_image import PROMPTS, SHAPES, build_pipeline
from models.image.adapter import ImageGenerator, ImageJob


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def staggered(loop, jobs: list[ImageJob], rows: int) -> None:
    """Every job through one loop, joining as soon as a row is free."""
    queue, running = list(jobs), []
    with torch.inference_mode():
        while queue or running:
            while queue and len(running) < rows:
                running.append(loop.join(queue.pop(0)))
            loop.step(running)
            finished = [r for r in running if r.done]
            if finished:
                loop.decode(finished)
                running = [r for r in running if not r.done]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("sd15", "tiny"), default="sd15")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8])  # fmt: skip
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not (args.model_dir / "model_index.json").exists():
        build_pipeline(args.model_dir, SHAPES[args.size], args.steps, 7.5)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = {"scenario": "image-loop", "gpu": gpu_name(), "commit": commit(),
            "command": "python -m bench.image_loop " + " ".join(sys.argv[1:]),
            "model": f"{args.size} (random weights)", "steps": args.steps}  # fmt: skip
    generator = ImageGenerator(str(args.model_dir), [device])
    generator.open()
    generator.load(device)
    generator.warmup(device, max_batch_size=max(args.batch_sizes))
    loop = generator.denoising_loop(device)
    pipe = loop.pipe
    d = generator.defaults
    records = []
    for size in args.batch_sizes:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(size)]
        jobs = [ImageJob(p, None, d.width, d.height, args.steps, d.guidance, (i,))
                for i, p in enumerate(prompts)]  # fmt: skip

        def pipeline_call(prompts=prompts, size=size):
            generators = [torch.Generator(device).manual_seed(i) for i in range(size)]
            with torch.inference_mode():
                pipe(prompts, num_inference_steps=args.steps, guidance_scale=d.guidance,
                     generator=generators, output_type="np")  # fmt: skip

        def loop_call(jobs=jobs):
            with torch.inference_mode():
                loop.run(jobs)

        figures = {}
        for name, fn in (("pipeline", pipeline_call), ("loop", loop_call)):
            fn()  # warm
            figures[name] = size / min(timed(fn) for _ in range(args.repeats))
        stream_jobs = [ImageJob(PROMPTS[i % 4], None, d.width, d.height, args.steps,
                                d.guidance, (i,)) for i in range(6 * size)]  # fmt: skip
        figures["staggered stream"] = len(stream_jobs) / timed(
            lambda jobs=stream_jobs, size=size: staggered(loop, jobs, size)
        )
        for name, rate in figures.items():
            records.append({**base, "run": name, "batch": size, "images_per_s": round(rate, 3)})
            print(json.dumps(records[-1]), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        size = max(args.batch_sizes)
        jobs = [ImageJob(PROMPTS[i % 4], None, d.width, d.height, 1000, d.guidance, (i,))
                for i in range(size)]  # fmt: skip
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if device.type == "cuda" else []
        )
        with torch.inference_mode():
            running = [loop.join(job) for job in jobs]
            for _ in range(3):
                loop.step(running)
            with profile(activities=activities) as prof:
                for _ in range(5):
                    loop.step(running)
                if device.type == "cuda":
                    torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        print(prof.key_averages().table(sort_by="cuda_time_total" if device.type == "cuda"
                                        else "cpu_time_total", row_limit=15))  # fmt: skip
    print(f"\n{base['gpu']}; commit {base['commit']}; {args.size}, {args.steps} steps\n")
    print("| run | batch | images/s |")
    print("|---|---:|---:|")
    for r in records:
        print(f"| {r['run']} | {r['batch']} | {r['images_per_s']} |")
    if args.out:
        append_records(records, args.out)


if __name__ == "__main__":
    main()
