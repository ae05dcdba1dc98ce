"""Step-level batching for diffusion: requests join a running denoising loop at a step
boundary and leave when their own schedule ends.

A `Denoising` is one request inside the loop: its own scheduler (timestep index and
solver history), its latents drawn from its own seeded generators, and its text
embeddings, all prepared when it joins (`DenoisingLoop.join`). `DenoisingLoop.step`
runs one UNet call over the rows of every request of one image size, with a timestep
per row, applies classifier-free guidance with each request's own scale, and lets each
request's scheduler step its own rows. A request whose schedule has ended is decoded
by the VAE (`decode`) and leaves.

The arithmetic per row is that of diffusers' `StableDiffusionPipeline.__call__`, so an
image depends on its prompt, seed and parameters only, never on the requests that
shared its steps (up to the float rounding of a larger batch on a GPU).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from diffusers import StableDiffusionPipeline
from diffusers.utils.torch_utils import randn_tensor

from models.image.graphs import UNetGraphs, unet_forward


@dataclass(eq=False)
class Denoising:
    """One request's images on their way through the loop."""

    job: Any  # the ImageJob
    scheduler: Any
    timesteps: torch.Tensor
    latents: torch.Tensor
    embeddings: torch.Tensor  # [negative; positive] rows when guided, else positive rows
    guided: bool
    generators: list[torch.Generator]
    step_kwargs: dict[str, Any]
    index: int = 0
    step_s: list[float] = field(default_factory=list)

    @property
    def size(self) -> tuple[int, int]:
        return (self.job.height, self.job.width)

    @property
    def done(self) -> bool:
        return self.index >= len(self.timesteps)

    @property
    def rows(self) -> int:
        """Rows of the UNet's batch this request takes at each step."""
        return self.latents.shape[0] * (2 if self.guided else 1)


class DenoisingLoop:
    """Joins, steps and decodes `Denoising` requests on one pipeline's device."""

    def __init__(self, pipe: StableDiffusionPipeline) -> None:
        self.pipe = pipe
        # The UNet's steps replayed from CUDA graphs (`models.image.graphs`), once captured.
        self.graphs: UNetGraphs | None = None

    @staticmethod
    def supports(pipe: Any) -> bool:
        """Pipelines whose denoising loop this reproduces row for row: Stable Diffusion
        text-to-image itself, not a subclass that may change the loop, and a UNet without
        a guidance embedding (LCM) or extra conditioning (SDXL)."""
        config = pipe.unet.config
        return (
            type(pipe) is StableDiffusionPipeline
            and config.get("time_cond_proj_dim") is None
            and config.get("addition_embed_type") is None
        )

    def join(self, job) -> Denoising:
        """Prepare a request: its scheduler, text embeddings and initial latents."""
        pipe = self.pipe
        device = pipe.device
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        scheduler.set_timesteps(job.steps, device=device)
        guided = job.guidance > 1.0
        count = len(job.seeds)
        positive, negative = pipe.encode_prompt(
            job.prompt, device, count, guided, job.negative_prompt or None
        )
        embeddings = torch.cat([negative, positive]) if guided else positive
        generators = [torch.Generator(device=device).manual_seed(seed) for seed in job.seeds]
        scale = pipe.vae_scale_factor
        shape = (count, pipe.unet.config.in_channels, job.height // scale, job.width // scale)
        latents = (
            randn_tensor(shape, generator=generators, device=device, dtype=positive.dtype)
            * scheduler.init_noise_sigma
        )
        # Stochastic schedulers draw from the request's own generators too.
        step_kwargs = {}
        params = inspect.signature(scheduler.step).parameters
        if "generator" in params:
            step_kwargs["generator"] = generators
        if "eta" in params:
            step_kwargs["eta"] = 0.0
        return Denoising(
            job,
            scheduler,
            scheduler.timesteps,
            latents,
            embeddings,
            guided,
            generators,
            step_kwargs,
        )

    def step(self, group: list[Denoising]) -> None:
        """One denoising step of every request in `group` (all of one image size)."""
        started = time.perf_counter()
        inputs, timesteps = [], []
        for request in group:
            t = request.timesteps[request.index]
            x = torch.cat([request.latents] * 2) if request.guided else request.latents
            x = request.scheduler.scale_model_input(x, t)
            inputs.append(x)
            timesteps.append(t.reshape(1).expand(x.shape[0]))
        sample, timestep = torch.cat(inputs), torch.cat(timesteps)
        context = torch.cat([r.embeddings for r in group])
        if self.graphs is not None:  # falls back to an eager call for other shapes
            noise = self.graphs(sample, timestep, context)
        else:
            noise = unet_forward(self.pipe.unet, sample, timestep, context)
        for request, predicted in zip(group, noise.split([r.rows for r in group]), strict=True):
            if request.guided:
                unconditional, conditional = predicted.chunk(2)
                predicted = unconditional + request.job.guidance * (conditional - unconditional)
            t = request.timesteps[request.index]
            request.latents = request.scheduler.step(
                predicted, t, request.latents, **request.step_kwargs, return_dict=False
            )[0]
            request.index += 1
        elapsed = time.perf_counter() - started
        for request in group:
            request.step_s.append(elapsed)

    def decode(self, group: list[Denoising]) -> list[list[np.ndarray]]:
        """The images of finished requests of one size, as uint8 arrays [h, w, 3]."""
        pipe = self.pipe
        latents = torch.cat([r.latents for r in group])
        generators = [g for r in group for g in r.generators]
        image = pipe.vae.decode(
            latents / pipe.vae.config.scaling_factor, return_dict=False, generator=generators
        )[0]
        denormalize = [True] * image.shape[0]
        if pipe.safety_checker is not None:
            image, flagged = pipe.run_safety_checker(image, pipe.device, latents.dtype)
            denormalize = [not f for f in flagged]
        pixels = pipe.image_processor.postprocess(
            image, output_type="np", do_denormalize=denormalize
        )
        # As diffusers' numpy_to_pil rounds, so the pixels equal the pipeline's PIL images.
        pixels = (pixels * 255).round().astype(np.uint8)
        out, start = [], 0
        for request in group:
            count = len(request.job.seeds)
            out.append(list(pixels[start : start + count]))
            start += count
        return out

    def run(
        self, jobs: list, should_stop: Callable[[], bool] = lambda: False
    ) -> list[tuple[list[np.ndarray], list[float]]] | None:
        """Every job from its first step to its images, together (a whole batch); None
        once `should_stop()` says so between two steps."""
        requests = [self.join(job) for job in jobs]
        for group in by_size(requests).values():
            while running := [r for r in group if not r.done]:
                if should_stop():
                    return None
                self.step(running)
        decoded = {}
        for group in by_size(requests).values():
            for request, images in zip(group, self.decode(group), strict=True):
                decoded[id(request)] = images
        return [(decoded[id(r)], r.step_s) for r in requests]


def by_size(requests: list[Denoising]) -> dict[tuple[int, int], list[Denoising]]:
    """Requests grouped by image size (one UNet call each), in their order."""
    groups: dict[tuple[int, int], list[Denoising]] = {}
    for request in requests:
        groups.setdefault(request.size, []).append(request)
    return groups
