"""Image generation served by Texel against the raw pipeline, same GPU, same batch sizes.

    python -m bench.compare_image --size sd15 --batch-sizes 1,4,8 --steps 20

Speed does not need trained weights, so the pipeline is built from configs with
random weights: `sd15` has Stable Diffusion 1.5's UNet, VAE and text-encoder
shapes at 512x512 (860 M UNet parameters); `tiny` is a few-megabyte stand-in for
trying the harness on a CPU. It is saved once (fp16) and served by Texel through
the ordinary `TEXEL_IMAGE__MODEL` path. For each batch size B it records
`raw` (one pipeline call of B prompts, best of a few) and `texel` at concurrency
B with `MAX_BATCH_SIZE` = the largest B, plus `texel-nobatch` at the largest B,
into `bench/results/<gpu>.jsonl` (scenario "image"). With `--compile batch` or
`dynamic`, Texel serves with `TEXEL_IMAGE__COMPILE` set so, and `raw` is timed both
eager and with its UNet compiled the same way (`raw-compiled`); the served rate is
compared with the faster of the two. With `--full-load`, also `texel`
at twice the largest B: the clients of one batch then send their next requests while
the other half's batch runs, so every batch is full and the served rate is compared
with `raw` at that batch size, which is what serving costs on top of the pipeline.

Each record is appended as soon as it is measured, so a run cut off by a time limit
keeps what it measured. `--client-processes` splits the closed-loop clients over
processes (each answer is a megabyte of JSON, which one client process reads one at a
time); `--model-dir` keeps the built pipeline there for the next run to reuse.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.common import append_records, commit, settings_env
from bench.compare import gpu_name, gpu_results_file, py_spy, scrape, texel_extras
from bench.load import LoadResult, Workload, closed_loop_processes, open_loop
from bench.server import ServerProcess
from training.tiny import byte_level_vocab

PROMPTS = [
    "a red circle on a blue background",
    "two green squares on a white background",
    "a yellow triangle and a purple circle on a black background",
    "three orange circles on a gray background",
]

# Public Stable Diffusion 1.5 shapes (UNet, VAE, CLIP ViT-L/14 text encoder).
SD15 = {
    "unet": dict(
        sample_size=64,
        layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=768,
        attention_head_dim=8,
    ),
    "vae": dict(
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2,
        sample_size=512,
    ),
    "text": dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12
    ),  # fmt: skip
}
TINY = {
    "unet": dict(
        sample_size=8,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=8,
    ),
    "vae": dict(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=16,
    ),
    "text": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
}


SHAPES = {"sd15": SD15, "tiny": TINY}


def record_base(scenario: str, module: str, args) -> dict:
    """What every record of an image benchmark names: the machine, commit and command."""
    return {"scenario": scenario, "gpu": gpu_name(), "commit": commit(),
            "command": f"python -m {module} " + " ".join(sys.argv[1:]),
            "model": f"{args.size} (random weights)", "steps": args.steps,
            "env": settings_env()}  # fmt: skip


def build_pipeline(directory: Path, shapes: dict, steps: int, guidance: float) -> Path:
    """A StableDiffusionPipeline with random weights in the given shapes, saved in fp16."""
    from diffusers import (
        AutoencoderKL,
        DPMSolverMultistepScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    vocab = byte_level_vocab()
    start, end = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(vocab),
            max_position_embeddings=77,
            bos_token_id=start,
            eos_token_id=end,
            pad_token_id=end,
            **shapes["text"],
        )  # fmt: skip
    )
    (directory / "tokenizer").mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer" / "vocab.json").write_text(json.dumps(vocab))
    (directory / "tokenizer" / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(
        str(directory / "tokenizer" / "vocab.json"),
        str(directory / "tokenizer" / "merges.txt"),
        model_max_length=77,
    )
    pipe = StableDiffusionPipeline(
        vae=AutoencoderKL(latent_channels=4, **shapes["vae"]),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=UNet2DConditionModel(in_channels=4, out_channels=4, **shapes["unet"]),
        scheduler=DPMSolverMultistepScheduler(beta_schedule="scaled_linear", steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.to(torch.float16).save_pretrained(directory)
    defaults = {"num_inference_steps": steps, "guidance_scale": guidance}
    (directory / "texel.json").write_text(json.dumps(defaults))
    return directory


def raw_throughput(model: Path, batch_sizes: list[int], steps: int, guidance: float,
                   repeats: int, compile: str = "off") -> dict[int, float]:  # fmt: skip
    """Images/s of the pipeline itself: B prompts in one call, best of `repeats` calls;
    `compile`: its UNet compiled as Texel compiles it (`compile_unet`)."""
    from diffusers import DiffusionPipeline

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    pipe = DiffusionPipeline.from_pretrained(
        str(model), dtype=torch.float16 if cuda else torch.float32
    ).to(device)
    pipe.set_progress_bar_config(disable=True)
    if compile != "off":
        from models.image.adapter import compile_unet

        pipe.unet = compile_unet(pipe.unet, compile)
    out = {}
    for size in batch_sizes:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(size)]
        times = []
        for repeat in range(repeats + 1):  # the first call warms up (and compiles)
            generators = [torch.Generator(device).manual_seed(i) for i in range(size)]
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            pipe(prompts, num_inference_steps=steps, guidance_scale=guidance,
                 generator=generators)  # fmt: skip
            if cuda:
                torch.cuda.synchronize()
            if repeat:
                times.append(time.perf_counter() - started)
        out[size] = size / min(times)
        print(json.dumps({"raw": size, "compile": compile, "images_per_s": round(out[size], 3),
                          "median_s": round(statistics.median(times), 3)}), flush=True)  # fmt: skip
    del pipe
    if cuda:
        torch.cuda.empty_cache()
    return out


def served(
    model: Path, concurrency: list[int], max_batch: int, args, rates: list[float] = ()
) -> Iterator[tuple]:
    """Texel serving `model`, driven at each closed-loop level, then at each Poisson
    arrival rate, in turn: (level or "poisson@rate", LoadResult, what Texel's /metrics
    say of it) as each is measured."""
    workload = Workload(
        "POST", "/generate", lambda i: {"json": {"prompt": PROMPTS[i % len(PROMPTS)], "seed": i}}
    )
    env = {
        "TEXEL_FORMULA__ENABLED": "false",
        "TEXEL_IMAGE__MODEL": str(model),
        "TEXEL_IMAGE__MAX_BATCH_SIZE": str(max_batch),
        "TEXEL_IMAGE__MAX_QUEUE": str(max(concurrency) * 4),
        "TEXEL_REQUEST_TIMEOUT_S": "600",
    }
    if args.compile != "off":
        env["TEXEL_IMAGE__COMPILE"] = args.compile
    proc = ServerProcess(env, ready_timeout=900)  # compiling the UNet takes minutes

    def closed(level: int) -> LoadResult:
        return closed_loop_processes(
            proc.url, workload, level, args.duration, args.warmup, args.client_processes
        )

    def poisson(rate: float) -> LoadResult:
        return asyncio.run(open_loop(proc.url, workload, rate, args.duration))

    loads = [(level, functools.partial(closed, level)) for level in concurrency]
    loads += [(f"poisson@{rate:g}", functools.partial(poisson, rate)) for rate in rates]
    try:
        for label, drive in loads:
            before = scrape(proc.url)
            spies = []
            if label in args.py_spy_at:
                spies = py_spy(args, proc.process.pid, f"image-c{label}")
            result = drive()
            for spy in spies:
                spy.wait(60)
            yield label, result, texel_extras(before, scrape(proc.url))
    finally:
        proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("sd15", "tiny"), default="sd15")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4, 8])  # fmt: skip
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=7.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="split each closed-loop client over this many processes",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="build the pipeline here, or reuse the one an earlier run built here (same "
        "--size, --steps and --guidance)",
    )
    parser.add_argument(
        "--compile",
        choices=("off", "batch", "dynamic"),
        default="off",
        help="TEXEL_IMAGE__COMPILE for the served runs; raw is then timed compiled too",
    )
    parser.add_argument("--skip-nobatch", action="store_true", help="leave out texel-nobatch")
    parser.add_argument(
        "--py-spy-at",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[],
        help="sample Texel's processes with py-spy at these concurrencies, into "
        "py-spy-image-c*.txt beside the results",
    )
    parser.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[],
        help="then serve Poisson arrivals at these rates (images/s), open loop",
    )
    parser.add_argument(
        "--full-load",
        action="store_true",
        help="also serve at twice the largest batch size (every batch full)",
    )
    args = parser.parse_args()

    out = args.out = args.out or gpu_results_file()
    base = record_base("image", "bench.compare_image", args)
    records = []

    def keep(record: dict) -> None:
        records.append(record)
        append_records([record], out)
        print(json.dumps(record), flush=True)

    with tempfile.TemporaryDirectory(prefix="texel-sd-") as tmp:
        model = args.model_dir or Path(tmp)
        if not (model / "model_index.json").exists():
            build_pipeline(model, SHAPES[args.size], args.steps, args.guidance)
        rates = {"raw": raw_throughput(model, args.batch_sizes, args.steps, args.guidance,
                                       args.repeats)}  # fmt: skip
        if args.compile != "off":
            rates["raw-compiled"] = raw_throughput(
                model,
                args.batch_sizes,
                args.steps,
                args.guidance,
                args.repeats,
                compile=args.compile,
            )
        for server, by_size in rates.items():
            for size, rate in by_size.items():
                keep({**base, "server": server, "concurrency": size,
                      "throughput_rps": round(rate, 3)})  # fmt: skip
        raw = {size: max(r[size] for r in rates.values()) for size in args.batch_sizes}
        largest = max(args.batch_sizes)
        levels = args.batch_sizes + ([2 * largest] if args.full_load else [])
        servers = [("texel", levels, largest, args.rates)]
        if not args.skip_nobatch:
            servers.append(("texel-nobatch", [largest], 1, []))
        for server, server_levels, max_batch, rates in servers:
            for level, result, extras in served(model, server_levels, max_batch, args, rates):
                summary = result.summary()
                kept = (
                    "throughput_rps",
                    "mean_ms",
                    "p50_ms",
                    "p95_ms",
                    "p99_ms",
                    "errors",
                    "mean_batch_size",
                )
                record = {**base, "server": server, "concurrency": level,
                          "client_processes": args.client_processes,
                          **{k: summary[k] for k in kept}, **extras}  # fmt: skip
                # Batches hold at most `largest`: past it, compare with raw at that size
                # (the faster of eager and compiled).
                closed = server == "texel" and isinstance(level, int)
                batch = min(level, largest) if closed else None
                if batch in raw:
                    record["share_of_raw"] = round(summary["throughput_rps"] / raw[batch], 3)
                    record["max_batch_size"] = largest
                keep(record)
    print(f"\n{base['gpu']}; commit {base['commit']}; {args.size}, {args.steps} steps\n")
    print("| server | concurrency | images/s | mean ms | p50 ms | p99 ms | batch | share of raw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in records:
        print(f"| {r['server']} | {r['concurrency']} | {r['throughput_rps']} "
              f"| {r.get('mean_ms', '-')} | {r.get('p50_ms', '-')} | {r.get('p99_ms', '-')} "
              f"| {r.get('mean_batch_size') or '-'} | {r.get('share_of_raw', '-')} |")  # fmt: skip


if __name__ == "__main__":
    main()
