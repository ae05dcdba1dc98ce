"""Prompt adherence of an image pipeline on the shapes world, judged from pixels.

    python -m training.image.evaluate --model models/image/default

Generates a fixed set of prompts with fixed seeds through the pipeline's
defaults (`texel.json`) and prints, for held-out and seen combinations, how
often background, colour, shape and count are right. `--grid` sweeps steps and
guidance instead; `--latency-runs` times one image at the defaults on two CPU
threads, as the service would. `--url` asks a running Texel for the same images
through `POST /generate` (the served model's defaults, the same seeds), so the
figures are those of the service itself:

    python -m training.image.evaluate --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import DiffusionPipeline

from models.image.adapter import DEFAULTS_FILE
from training.image import judge, shapes

SEEDS_PER_PROMPT = 2
SEEN_PROMPTS = 72
EVAL_SEED = 1234


@dataclass(frozen=True)
class Case:
    prompt: str
    seed: int
    held_out: bool


def cases() -> list[Case]:
    """Each held-out triple in every template, plus random seen prompts; two seeds each."""
    rng = random.Random(EVAL_SEED)
    held_out_specs = []
    for colour, shape, background in sorted(shapes.HELD_OUT):
        target = (colour, shape)
        while True:
            other_colour = rng.choice([c for c in shapes.COLOURS if c not in (colour, background)])
            partner = (other_colour, rng.choice(shapes.SHAPES))
            if (*partner, background) not in shapes.HELD_OUT:
                break
        pair = (target, partner) if rng.random() < 0.5 else (partner, target)
        held_out_specs += [
            shapes.SceneSpec(background, (target,)),
            shapes.SceneSpec(background, (target,) * 2),
            shapes.SceneSpec(background, (target,) * 3),
            shapes.SceneSpec(background, pair),
        ]
    seen_specs = [shapes.random_spec(rng, held_out=False) for _ in range(SEEN_PROMPTS)]
    found = []
    for specs, held_out in ((held_out_specs, True), (seen_specs, False)):
        for spec in specs:
            for _ in range(SEEDS_PER_PROMPT):
                found.append(Case(shapes.prompt_for(spec), len(found), held_out))
    return found


def load(model: str | Path, device: str = "cpu") -> tuple[DiffusionPipeline, dict]:
    pipe = DiffusionPipeline.from_pretrained(str(model), dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    defaults_path = Path(model) / DEFAULTS_FILE
    defaults = json.loads(defaults_path.read_text()) if defaults_path.exists() else {}
    return pipe, defaults


def generate(
    pipe: DiffusionPipeline, prompts: list[str], seeds: list[int], steps: int, guidance: float
) -> list:
    """Images through the same call the service makes, with a fresh scheduler."""
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    return pipe(
        prompt=prompts,
        negative_prompt=None,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=[torch.Generator().manual_seed(seed) for seed in seeds],
        output_type="pil",
    ).images


def _score(args: tuple[np.ndarray, str]) -> dict[str, bool]:
    return judge.score(*args)


def pipeline_images(
    pipe: DiffusionPipeline, steps: int, guidance: float, batch_size: int
) -> Callable[[list[Case]], list[np.ndarray]]:
    def images(all_cases: list[Case]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for start in range(0, len(all_cases), batch_size):
            batch = all_cases[start : start + batch_size]
            prompts, seeds = [c.prompt for c in batch], [c.seed for c in batch]
            pil = generate(pipe, prompts, seeds, steps, guidance)
            out += [np.asarray(image) for image in pil]
        return out

    return images


def served_images(url: str, concurrency: int = 8) -> Callable[[list[Case]], list[np.ndarray]]:
    """Images from a running Texel's `POST /generate`, at the served model's defaults."""
    import httpx
    from PIL import Image

    def one(client: httpx.Client, case: Case) -> np.ndarray:
        response = client.post(
            "/generate",
            json={"prompt": case.prompt, "seed": case.seed},
            headers={"Accept": "image/png"},
        )
        response.raise_for_status()
        return np.asarray(Image.open(io.BytesIO(response.content)).convert("RGB"))

    def images(all_cases: list[Case]) -> list[np.ndarray]:
        with (
            httpx.Client(base_url=url, timeout=300) as client,
            ThreadPoolExecutor(concurrency) as pool,
        ):
            return list(pool.map(lambda case: one(client, case), all_cases))

    return images


def adherence(
    images_for: Callable[[list[Case]], list[np.ndarray]], *, workers: int = 1
) -> dict[str, dict[str, float]]:
    """Share of images right on each criterion, split into held-out and seen prompts."""
    all_cases = cases()
    images = images_for(all_cases)
    jobs = [(image, case.prompt) for image, case in zip(images, all_cases, strict=True)]
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            scores = list(pool.map(_score, jobs, chunksize=8))
    else:
        scores = [_score(job) for job in jobs]
    table: dict[str, dict[str, float]] = {}
    for split, held_out in (("held-out", True), ("seen", False)):
        rows = [s for s, c in zip(scores, all_cases, strict=True) if c.held_out == held_out]
        table[split] = {k: sum(r[k] for r in rows) / len(rows) for k in judge.CRITERIA}
        table[split]["images"] = len(rows)
    return table


def markdown(table: dict[str, dict[str, float]]) -> str:
    lines = [
        "| prompts | images | " + " | ".join(judge.CRITERIA) + " |",
        "|---" * (len(judge.CRITERIA) + 2) + "|",
    ]
    for split, row in table.items():
        cells = " | ".join(f"{100 * row[k]:.1f}%" for k in judge.CRITERIA)
        lines.append(f"| {split} | {int(row['images'])} | {cells} |")
    return "\n".join(lines)


def latency(pipe: DiffusionPipeline, steps: int, guidance: float, runs: int) -> list[float]:
    """Seconds per single-image call at the default size, after one warm-up."""
    prompt = "a red circle and a blue square on a green background"
    timings = []
    for seed in range(runs + 1):
        started = time.perf_counter()
        generate(pipe, [prompt], [seed], steps, guidance)
        timings.append(time.perf_counter() - started)
    return timings[1:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/image/default")
    parser.add_argument(
        "--steps", type=int, default=None, help="override texel.json's num_inference_steps"
    )
    parser.add_argument(
        "--guidance", type=float, default=None, help="override texel.json's guidance_scale"
    )
    parser.add_argument(
        "--grid", default=None, help="sweep instead, e.g. '8,10,12:1,2,3' (steps:guidances)"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1, help="processes for judging")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--latency-runs", type=int, default=0, help="time this many single images instead"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--url", default=None, help="judge a running Texel's POST /generate instead"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.url:
        table = adherence(served_images(args.url), workers=args.workers)
        print(f"Prompt adherence through {args.url}/generate, the served model's defaults\n")
        print(markdown(table))
        if args.json:
            args.json.write_text(json.dumps({"url": args.url, "table": table}, indent=2))
        return
    pipe, defaults = load(args.model, args.device)
    steps = args.steps or defaults.get("num_inference_steps", 12)
    guidance = args.guidance if args.guidance is not None else defaults.get("guidance_scale", 3.0)

    if args.latency_runs:
        timings = latency(pipe, steps, guidance, args.latency_runs)
        result = {
            "steps": steps,
            "guidance": guidance,
            "threads": torch.get_num_threads(),
            "seconds": timings,
        }
        p50, worst = statistics.median(timings), max(timings)
        print("| steps | guidance | threads | p50 s | max s |\n|---|---|---|---|---|")
        print(f"| {steps} | {guidance} | {torch.get_num_threads()} | {p50:.3f} | {worst:.3f} |")
    elif args.grid:
        step_list, guidance_list = (
            [float(x) for x in part.split(",")] for part in args.grid.split(":")
        )
        result = []
        for s in step_list:
            for g in guidance_list:
                started = time.perf_counter()
                images = pipeline_images(pipe, int(s), g, args.batch_size)
                table = adherence(images, workers=args.workers)
                result.append({"steps": int(s), "guidance": g, "table": table})
                took = time.perf_counter() - started
                print(
                    f"\nsteps={int(s)} guidance={g} ({took:.0f} s)\n{markdown(table)}", flush=True
                )
    else:
        images = pipeline_images(pipe, steps, guidance, args.batch_size)
        table = adherence(images, workers=args.workers)
        result = {"steps": steps, "guidance": guidance, "table": table}
        print(f"Prompt adherence, {args.model}, steps={steps}, guidance={guidance}\n")
        print(markdown(table))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
