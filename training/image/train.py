"""Train Texel's demonstration text-to-image pipeline on the shapes world.

    python -m training.image.train --out models/image/default

Steps, each reproducible from `--seed`: render the training scenes (in worker
processes), build a tokenizer for the grammar's vocabulary, train the VAE,
encode every scene to latents, then train the UNet and the text encoder
together with v-prediction and prompt dropout for classifier-free guidance,
keeping an exponential moving average of both. The result is a stock
`StableDiffusionPipeline` saved with `save_pretrained`, plus `texel.json`
holding the default steps and guidance.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import random
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from tqdm import tqdm
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from models.image.adapter import DEFAULTS_FILE
from training.image import judge, shapes

log = logging.getLogger("training.image.train")

LATENT_CHANNELS = 4
TEXT_WIDTH = 128
MAX_TOKENS = 16
# Shared by training (DDPMScheduler) and sampling (DPM-Solver++). The cosine
# schedule reaches (almost) zero signal at the last step, so sampling from pure
# noise matches training, which matters for the background colour (the image mean)
# at this small latent size; v-prediction keeps x0 well-conditioned there.
NOISE_SCHEDULE = {
    "num_train_timesteps": 1000,
    "beta_schedule": "squaredcos_cap_v2",
    "prediction_type": "v_prediction",
}


# ---------------------------------------------------------------- data


def render_dataset(count: int, seed: int, workers: int) -> tuple[list[str], np.ndarray]:
    """`count` training scenes (no held-out combinations), rendered in parallel."""
    chunk = 2048
    jobs = [
        (min(chunk, count - start), seed * 1_000_003 + i)
        for i, start in enumerate(range(0, count, chunk))
    ]
    prompts: list[str] = []
    parts: list[np.ndarray] = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for chunk_prompts, pixels in tqdm(
            pool.map(shapes.render_batch, *zip(*jobs, strict=True)),
            total=len(jobs),
            desc="render",
            unit="chunk",
        ):
            prompts += chunk_prompts
            parts.append(pixels)
    return prompts, np.concatenate(parts)


# ---------------------------------------------------------------- components


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins for bytes that byte-level BPE (GPT-2, CLIP) uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _bpe_merges(words: list[str]) -> list[tuple[str, str]]:
    """Byte-pair merges, learned on the vocabulary, that make every word one token."""
    pieces = {word: [*word[:-1], word[-1] + "</w>"] for word in words if len(word) > 1}
    merges: list[tuple[str, str]] = []
    while True:
        pairs = Counter(pair for seq in pieces.values() for pair in zip(seq, seq[1:], strict=False))
        if not pairs:
            return merges
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        merges.append(best)
        for word, seq in pieces.items():
            merged, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    merged.append(seq[i] + seq[i + 1])
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            pieces[word] = merged


def build_tokenizer(directory: Path) -> CLIPTokenizer:
    """A CLIP tokenizer whose BPE covers all bytes and has one token per grammar word."""
    alphabet = _byte_alphabet()
    merges = _bpe_merges(shapes.vocabulary())
    tokens = (
        alphabet + [symbol + "</w>" for symbol in alphabet] + ["".join(pair) for pair in merges]
    )
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(dict.fromkeys(tokens))}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    tokenizer = CLIPTokenizer(
        vocab=str(directory / "vocab.json"),
        merges=str(directory / "merges.txt"),
        model_max_length=MAX_TOKENS,
    )
    for word in shapes.vocabulary():
        ids = tokenizer(word).input_ids
        if len(ids) != 3:
            raise RuntimeError(
                f"tokenizer splits {word!r} into {tokenizer.convert_ids_to_tokens(ids)}"
            )
    return tokenizer


def build_text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_WIDTH,
        intermediate_size=TEXT_WIDTH * 4,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=MAX_TOKENS,
        projection_dim=TEXT_WIDTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config)


def build_vae() -> AutoencoderKL:
    """Three resolution levels: 64x64x3 pixels <-> 16x16x4 latents."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 64, 64),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=32,
        sample_size=shapes.IMAGE_SIZE,
    )


def build_unet(latent_size: int) -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=latent_size,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        block_out_channels=(64, 128, 128),
        layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=TEXT_WIDTH,
        attention_head_dim=8,
        norm_num_groups=32,
    )


def build_scheduler() -> DPMSolverMultistepScheduler:
    return DPMSolverMultistepScheduler(
        **NOISE_SCHEDULE,
        algorithm_type="dpmsolver++",
        solver_order=2,
        timestep_spacing="trailing",
        steps_offset=1,
        lower_order_final=True,
    )


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------- training


class EMA:
    """Exponential moving average of a module's parameters, with the usual warm-up."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.shadow = copy.deepcopy(module).eval().requires_grad_(False)
        self.decay = decay
        self.updates = 0

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(list(self.shadow.parameters()), list(module.parameters()), 1.0 - decay)


def _autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _schedule(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up then cosine decay to a tenth, as a learning-rate factor."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _fit_to_budget(steps: int, step: int, started: float, budget_s: float | None) -> int:
    """Shrink the planned step count so training ends within the budget.

    Called once, after warm-up steps, so the learning-rate schedule still runs
    its full course; the steps actually done are logged, and passing them as the
    step count without a budget reproduces the run.
    """
    if budget_s is None:
        return steps
    per_step = (time.perf_counter() - started) / step
    return min(steps, step + int((budget_s - (time.perf_counter() - started)) / per_step))


def train_vae(
    pixels: torch.Tensor,
    *,
    steps: int,
    batch: int,
    lr: float,
    budget_s: float | None,
    seed: int,
    start: AutoencoderKL | None = None,
) -> tuple[AutoencoderKL, list[float]]:
    """Reconstruction (L1 + MSE) with a light KL term. `pixels` is uint8 NHWC on the device."""
    device = pixels.device
    torch.manual_seed(seed)
    vae = (start or build_vae()).to(device).train()
    optimiser = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator(device).manual_seed(seed)
    losses: list = []
    started, step = time.perf_counter(), 0
    bar = tqdm(total=steps, desc="vae", unit="step")
    while step < steps:
        if step == 100:
            steps = _fit_to_budget(steps, step, started, budget_s)
            bar.total = steps
        for group in optimiser.param_groups:
            group["lr"] = lr * _schedule(step, steps, warmup=100)
        index = torch.randint(0, len(pixels), (batch,), device=device, generator=generator)
        x = pixels[index].permute(0, 3, 1, 2).float() / 127.5 - 1.0
        with _autocast(device):
            posterior = vae.encode(x).latent_dist
            z = posterior.mean + posterior.std * torch.randn(
                posterior.mean.shape, device=device, generator=generator
            )
            out = vae.decode(z).sample.float()
        kl = posterior.kl().mean() / x[0].numel()
        loss = F.l1_loss(out, x) + F.mse_loss(out, x) + 1e-4 * kl
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimiser.step()
        losses.append(loss.detach())
        step += 1
        bar.update()
        if step % 100 == 0:
            bar.set_postfix(loss=f"{losses[-1].item():.4f}")
    bar.close()
    losses = torch.stack(losses).tolist() if losses else [float("nan")]
    log.info(
        "vae: %d steps in %.0f s, final loss %.4f", step, time.perf_counter() - started, losses[-1]
    )
    return vae.eval(), losses


@torch.no_grad()
def encode_latents(vae: AutoencoderKL, pixels: torch.Tensor, batch: int = 1024) -> torch.Tensor:
    """Posterior means of every scene, unscaled."""
    chunks = []
    for start in range(0, len(pixels), batch):
        x = pixels[start : start + batch].permute(0, 3, 1, 2).float() / 127.5 - 1.0
        with _autocast(pixels.device):
            chunks.append(vae.encode(x).latent_dist.mean.float())
    return torch.cat(chunks)


@torch.no_grad()
def reconstruction_adherence(
    vae: AutoencoderKL, device: torch.device, count: int = 256, seed: int = 99
) -> dict:
    """Judge scores of VAE round trips of fresh scenes, held-out ones included."""
    prompts, images = shapes.render_batch(count, seed, held_out=None)
    x = torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    with _autocast(device):
        out = vae.decode(vae.encode(x).latent_dist.mean).sample.float()
    pixels = ((out.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    scores = [judge.score(image, prompt) for image, prompt in zip(pixels, prompts, strict=True)]
    return {k: sum(s[k] for s in scores) / count for k in judge.CRITERIA}


def train_denoiser(
    latents: torch.Tensor,
    input_ids: torch.Tensor,
    empty_ids: torch.Tensor,
    text_encoder: CLIPTextModel,
    *,
    steps: int,
    batch: int,
    lr: float,
    budget_s: float | None,
    seed: int,
    prompt_dropout: float = 0.1,
    ema_decay: float = 0.999,
    unet: UNet2DConditionModel | None = None,
) -> tuple[UNet2DConditionModel, CLIPTextModel, list[float]]:
    """UNet and text encoder trained together (from `unet`, else from scratch);
    returns their moving averages."""
    device = latents.device
    torch.manual_seed(seed)
    unet = (unet or build_unet(latents.shape[-1])).to(device).train()
    text_encoder = text_encoder.to(device).train()
    noise_scheduler = DDPMScheduler(**NOISE_SCHEDULE)
    alphas = noise_scheduler.alphas_cumprod.to(device)
    parameters = [*unet.parameters(), *text_encoder.parameters()]
    optimiser = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.01)
    unet_ema, text_ema = EMA(unet, ema_decay), EMA(text_encoder, ema_decay)
    generator = torch.Generator(device).manual_seed(seed)
    losses: list = []
    started, step = time.perf_counter(), 0
    bar = tqdm(total=steps, desc="unet", unit="step")
    while step < steps:
        if step == 100:
            steps = _fit_to_budget(steps, step, started, budget_s)
            bar.total = steps
        for group in optimiser.param_groups:
            group["lr"] = lr * _schedule(step, steps, warmup=200)
        index = torch.randint(0, len(latents), (batch,), device=device, generator=generator)
        x0 = latents[index]
        ids = input_ids[index]
        dropped = torch.rand(batch, device=device, generator=generator) < prompt_dropout
        ids = torch.where(dropped[:, None], empty_ids[None, :], ids)
        noise = torch.randn(x0.shape, device=device, generator=generator)
        t = torch.randint(
            0,
            noise_scheduler.config.num_train_timesteps,
            (batch,),
            device=device,
            generator=generator,
        )
        a = alphas[t].view(-1, 1, 1, 1)
        noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
        target = a.sqrt() * noise - (1 - a).sqrt() * x0
        with _autocast(device):
            context = text_encoder(ids)[0]
            prediction = unet(noisy, t, context).sample.float()
        loss = F.mse_loss(prediction, target)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimiser.step()
        unet_ema.update(unet)
        text_ema.update(text_encoder)
        losses.append(loss.detach())
        step += 1
        bar.update()
        if step % 100 == 0:
            bar.set_postfix(loss=f"{losses[-1].item():.4f}")
    bar.close()
    losses = torch.stack(losses).tolist()
    log.info(
        "unet: %d steps in %.0f s, final loss %.4f", step, time.perf_counter() - started, losses[-1]
    )
    return unet_ema.shadow, text_ema.shadow, losses


def assemble(
    vae: AutoencoderKL,
    text_encoder: CLIPTextModel,
    tokenizer: CLIPTokenizer,
    unet: UNet2DConditionModel,
) -> StableDiffusionPipeline:
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=build_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def write_defaults(directory: Path, steps: int, guidance: float) -> None:
    (directory / DEFAULTS_FILE).write_text(
        json.dumps({"num_inference_steps": steps, "guidance_scale": guidance}, indent=2) + "\n"
    )


def _smoothed(losses: list[float], points: int = 10) -> list[float]:
    """Mean loss over `points` equal stretches of training, for the log."""
    stretch = max(1, len(losses) // points)
    return [
        round(float(np.mean(losses[i : i + stretch])), 4) for i in range(0, len(losses), stretch)
    ][:points]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("models/image/default"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-images", type=int, default=300_000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--vae-steps", type=int, default=3000)
    parser.add_argument("--vae-batch", type=int, default=256)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument(
        "--vae-budget-s", type=float, default=None, help="stop VAE training after this many seconds"
    )
    parser.add_argument(
        "--vae-from",
        type=Path,
        default=None,
        help="start from a trained VAE (a pipeline's vae/ folder)",
    )
    parser.add_argument(
        "--denoiser-from",
        type=Path,
        default=None,
        help="continue the UNet and text encoder of a saved pipeline (needs --vae-from "
        "its vae/ and --vae-steps 0, so the latent space stays the one they learnt)",
    )
    parser.add_argument("--unet-steps", type=int, default=6000)
    parser.add_argument("--unet-batch", type=int, default=1024)
    parser.add_argument("--unet-lr", type=float, default=1e-3)
    parser.add_argument(
        "--unet-budget-s",
        type=float,
        default=None,
        help="stop UNet training after this many seconds",
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="default num_inference_steps written to texel.json"
    )
    parser.add_argument(
        "--guidance", type=float, default=2.0, help="default guidance_scale written to texel.json"
    )
    parser.add_argument(
        "--metrics", type=Path, default=None, help="also write losses and timings as JSON here"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.denoiser_from and (args.vae_from is None or args.vae_steps != 0):
        parser.error("--denoiser-from needs --vae-from <its vae/> and --vae-steps 0")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = torch.device(args.device)
    timings: dict[str, float] = {}

    started = time.perf_counter()
    prompts, images = render_dataset(args.train_images, args.seed, args.workers)
    timings["render_s"] = time.perf_counter() - started
    log.info("rendered %d scenes in %.0f s", len(prompts), timings["render_s"])

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = build_tokenizer(Path(scratch) / "tokenizer")

    def token(texts: list[str]) -> torch.Tensor:
        # Exactly how StableDiffusionPipeline.encode_prompt tokenizes.
        return tokenizer(
            texts,
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids

    input_ids = token(prompts).to(device)
    empty_ids = token([""])[0].to(device)

    pixels = torch.from_numpy(images).to(device)
    started = time.perf_counter()
    vae, vae_losses = train_vae(
        pixels,
        steps=args.vae_steps,
        batch=args.vae_batch,
        lr=args.vae_lr,
        budget_s=args.vae_budget_s,
        seed=args.seed,
        start=AutoencoderKL.from_pretrained(args.vae_from) if args.vae_from else None,
    )
    timings["vae_s"] = time.perf_counter() - started

    reconstruction = reconstruction_adherence(vae, device)
    log.info("judge on VAE reconstructions: %s", reconstruction)
    raw = encode_latents(vae, pixels)
    if args.denoiser_from:  # the UNet learnt latents at the scale its VAE was saved with
        scaling = float(vae.config.scaling_factor)
    else:
        scaling = 1.0 / raw.std().item()
        vae.register_to_config(scaling_factor=scaling)
    latents = raw * scaling
    log.info(
        "latents %s, mean %.3f, scaling factor %.4f",
        tuple(latents.shape),
        latents.mean().item(),
        scaling,
    )
    del pixels

    unet, text_encoder = None, build_text_encoder(tokenizer)
    if args.denoiser_from:
        unet = UNet2DConditionModel.from_pretrained(
            args.denoiser_from / "unet", torch_dtype=torch.float32
        )
        text_encoder = CLIPTextModel.from_pretrained(
            args.denoiser_from / "text_encoder", dtype=torch.float32
        )
    started = time.perf_counter()
    unet, text_encoder, unet_losses = train_denoiser(
        latents,
        input_ids,
        empty_ids,
        text_encoder,
        unet=unet,
        steps=args.unet_steps,
        batch=args.unet_batch,
        lr=args.unet_lr,
        budget_s=args.unet_budget_s,
        seed=args.seed,
    )
    timings["unet_s"] = time.perf_counter() - started

    pipe = assemble(vae.float().cpu(), text_encoder.float().cpu(), tokenizer, unet.float().cpu())
    # fp16 on disk halves the download; loaders upcast to the serving dtype (fp32 on CPU).
    # The text encoder stays fp32: transformers loads a checkpoint in its saved dtype by
    # default, diffusers in fp32, and a plain from_pretrained() must not mix the two.
    pipe.to(torch.float16)
    pipe.text_encoder.to(torch.float32)
    pipe.save_pretrained(args.out, safe_serialization=True)
    # Keep the hand-built BPE files beside the tokenizer.json that save_pretrained writes.
    build_tokenizer(args.out / "tokenizer")
    write_defaults(args.out, args.steps, args.guidance)
    sizes = {name: parameter_count(getattr(pipe, name)) for name in ("unet", "vae", "text_encoder")}
    log.info("saved %s; parameters %s", args.out, sizes)
    log.info("vae loss by tenths %s", _smoothed(vae_losses))
    log.info("unet loss by tenths %s", _smoothed(unet_losses))
    if args.metrics:
        args.metrics.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "timings": timings,
                    "parameters": sizes,
                    "vae_steps_done": len(vae_losses),
                    "unet_steps_done": len(unet_losses),
                    "vae_loss_by_tenths": _smoothed(vae_losses),
                    "unet_loss_by_tenths": _smoothed(unet_losses),
                    "scaling_factor": scaling,
                    "vae_reconstruction_adherence": reconstruction,
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
