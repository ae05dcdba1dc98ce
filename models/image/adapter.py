"""`ImageGenerator`: a text prompt in, images out, through any diffusers pipeline.

Loaded with `DiffusionPipeline.from_pretrained` from a directory or hub id. Every
image gets its own seeded generator, so an image depends only on its prompt,
seed and settings, never on the batch it ran in.

Stable Diffusion pipelines run in Texel's own denoising loop (`models.image.denoise`):
with `continuous` (the default) requests join a running loop at a step boundary,
whatever their step count or guidance, and leave when their own schedule ends. Other
pipelines run whole: requests with equal size, steps and guidance share one call. On a
GPU that loop replays its UNet from CUDA graphs captured at warm-up (`models.image.graphs`).

The UNet can be compiled instead (`compile="batch"` or `"dynamic"`, off by default): warm-up
then compiles a graph for every batch size up to the largest, so no request of one image
pays for compilation. bench/RESULTS.md gives what each costs and gains.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import logging
import math
import secrets
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.fx.experimental._config as fx_config
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging
from PIL import Image
from transformers import AutoTokenizer
from transformers.utils import cached_file
from transformers.utils import logging as transformers_logging

from batching.errors import Cancelled, OutOfMemory
from models.base import DeviceRunner, Model, Stage
from models.devices import model_name, out_of_memory_as_batching_error, resolve_dtype
from models.errors import InvalidParameter
from models.image.denoise import Denoising, DenoisingLoop, by_size
from models.image.graphs import graphed_unet
from telemetry import metrics

log = logging.getLogger(__name__)

DEFAULTS_FILE = "texel.json"  # optional {"num_inference_steps", "guidance_scale"}
# On a compute thread shared with other models (a CPU), a denoising loop runs at least
# this long before it gives the thread up at a step boundary to work that waits for it.
GIVE_WAY_AFTER_S = 0.2
# The largest seed a request may send (app/schemas.py). Image i of a request uses seed + i,
# and each image's seed is answered so that it can be sent again: none may pass this.
MAX_SEED = 2**32 - 1


def compile_unet(unet, mode: str):
    """`torch.compile` of a UNet as `TEXEL_IMAGE__COMPILE` asks. `batch`: torch's own
    dynamic-shape policy, where the first batch size gets a graph of its own and the next
    one a graph with a symbolic batch size that serves every size after it; image sizes
    stay specialized. `dynamic`: every size symbolic (one compilation, whose kernels
    were slower at batch 8 than eager ones; bench/RESULTS.md)."""
    # Without duck shaping a batch dimension that happens to equal another size (4
    # latent channels, 4 rows) stays symbolic instead of being fixed to it.
    fx_config.use_duck_shape = False
    return torch.compile(unet, dynamic=True if mode == "dynamic" else None)


@dataclass(frozen=True)
class ImageRequest:
    """A validated /generate request; None means "the model's default"."""

    prompt: str
    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    num_images: int = 1


@dataclass(frozen=True)
class ImageJob:
    """A request with every default filled in: what a batch runs."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    steps: int
    guidance: float
    seeds: tuple[int, ...]
    prompt_tokens: int = 0


@dataclass
class GeneratedImages:
    """A request's images as uint8 arrays [height, width, 3], in the order of its seeds."""

    images: list[np.ndarray]
    seeds: tuple[int, ...]
    step_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class EncodedImages:
    """A request's images as PNG files, and their seeds."""

    pngs: list[bytes]
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class ImageDefaults:
    width: int
    height: int
    steps: int
    guidance: float


@dataclass(frozen=True)
class ImageSpeed:
    """What one image costs alone on the engine's device, measured during warm-up: at
    the default size, seconds per denoising step and once (text encoding, VAE decode);
    other sizes scale with their pixels to the power `exponent` (from a run at twice
    the side; at least 1, linear, and at most 2, attention's quadratic cost)."""

    step_s: float
    fixed_s: float
    exponent: float = 1.0

    def estimate_s(self, images: int, pixels_ratio: float, steps: int) -> float:
        """Seconds for `images` of `pixels_ratio` times the default pixels, alone."""
        scale = pixels_ratio**self.exponent
        return images * scale * (self.fixed_s + steps * self.step_s)


class ImageGenerator(Model):
    """Adapter for text-to-image generation with a diffusers pipeline."""

    key = "image"
    payload_type = ImageJob
    output_type = GeneratedImages

    def __init__(
        self,
        source: str,
        devices: list[torch.device],
        *,
        name: str | None = None,
        dtype: str = "auto",
        max_steps: int = 100,
        max_side: int = 1024,
        compile: str = "off",
        continuous: bool = True,
        png_compress_level: int = 1,
        deadline_s: float | None = None,
    ) -> None:
        super().__init__(source, model_name(source, name))
        self.devices = devices
        self.png_compress_level = png_compress_level
        self.dtype_setting = dtype
        self.max_steps = max_steps
        self.max_side = max_side
        if compile not in ("off", "batch", "dynamic"):
            raise ValueError(f"compile must be off, batch or dynamic; got {compile!r}")
        self.compile_setting = compile
        self.continuous = continuous
        self.deadline_s = deadline_s  # requests that cannot finish within it are refused
        self.speed: ImageSpeed | None = None
        self.defaults: ImageDefaults | None = None
        self.size_multiple = 8
        self._pipes: dict[str, DiffusionPipeline] = {}
        self._loops: dict[str, DenoisingLoop] = {}  # pipelines Texel steps itself
        self._capacity: dict[str, int] = {}  # a stream's budget, in default-size images
        self._tokenizer_lock = threading.Lock()
        self._prompt_tokenizer = None

    # -- lifecycle -----------------------------------------------------------

    def open(self) -> None:
        """The prompt tokenizer (a copy of the pipeline's own, never shared with it: a fast
        tokenizer's padding settings are mutable state)."""
        diffusers_logging.disable_progress_bar()  # a server's log is not a terminal
        transformers_logging.disable_progress_bar()
        try:
            self._prompt_tokenizer = AutoTokenizer.from_pretrained(
                self.source, subfolder="tokenizer"
            )
        except (OSError, ValueError):  # a pipeline without a tokenizer of its own
            self._prompt_tokenizer = None

    def load(self, device: torch.device) -> None:
        """The pipeline on `device`."""
        dtype = resolve_dtype(self.dtype_setting, device, torch.float16)
        pipe = DiffusionPipeline.from_pretrained(self.source, dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        pipe.to(device)
        if self.compile_setting != "off":
            pipe.unet = compile_unet(pipe.unet, self.compile_setting)
        self._pipes[str(device)] = pipe
        if DenoisingLoop.supports(pipe):
            self._loops[str(device)] = DenoisingLoop(pipe)
        self.defaults = self._read_defaults(pipe)

    def describe(self) -> dict:
        limit = getattr(self._prompt_tokenizer, "model_max_length", None)
        return {
            "defaults": dataclasses.asdict(self._defaults),
            "size_multiple": self.size_multiple,
            "speed": None if self.speed is None else dataclasses.asdict(self.speed),
            # What the text encoder reads; longer prompts are refused (`tokenize`).
            "max_prompt_tokens": limit if limit and limit < 1_000_000 else None,
        }

    def attach(self, description: dict) -> None:
        """Take the defaults and speed the engine read from the loaded pipeline."""
        self.defaults = ImageDefaults(**description["defaults"])
        self.size_multiple = description["size_multiple"]
        speed = description.get("speed")
        self.speed = None if speed is None else ImageSpeed(**speed)

    def warmup(self, device: torch.device, max_batch_size: int) -> None:
        """A full batch at the default settings on `device`, on its worker thread. On a
        GPU an uncompiled UNet is then captured as CUDA graphs at the default size, one
        per row count the loop can run (`models.image.graphs`). A compiled UNet runs
        every batch size from the largest down and one image without guidance (a graph
        of its own), so that each graph a request of one image can need is compiled
        here, before readiness. (Requests of several images make larger batches, which
        the symbolic graph serves as well.)"""
        d = self._defaults
        self._capacity[str(device)] = max_batch_size
        metrics.LOOP_BUDGET.labels(self.name, str(device)).set(max_batch_size)
        job = ImageJob("warm-up", None, d.width, d.height, min(d.steps, 2), d.guidance, (0,))
        if self.compile_setting == "off":
            self._generate(str(device), [job] * max_batch_size, lambda: False)
            loop = self._loops.get(str(device))
            if loop is not None and device.type == "cuda":
                # Two rows an image under guidance, one without.
                started = time.perf_counter()
                loop.graphs = graphed_unet(loop.pipe, d.height, d.width, 2 * max_batch_size)
                if loop.graphs is not None:
                    log.info("UNet on %s captured as CUDA graphs for 1 to %d rows in %.1f s",
                             device, 2 * max_batch_size, time.perf_counter() - started)  # fmt: skip
            self.speed = self._measure_speed(device)
            return
        started = time.perf_counter()
        for size in range(max_batch_size, 0, -1):
            self._generate(str(device), [job] * size, lambda: False)
        unguided = ImageJob("warm-up", None, d.width, d.height, 2, 1.0, (0,))
        self._generate(str(device), [unguided], lambda: False)
        self.speed = self._measure_speed(device)
        log.info(
            "UNet on %s compiled (%s) in %.1f s",
            device,
            self.compile_setting,
            time.perf_counter() - started,
        )

    def _measure_speed(self, device: torch.device) -> ImageSpeed:
        """Time one default image alone at 1 and 5 steps (the slope is a step's cost, the
        rest what an image costs once), and one step at twice the side."""
        d = self._defaults

        def timed(steps: int, scale: int = 1) -> float:
            width, height = self._within_max_side(d.width * scale, d.height * scale)
            job = ImageJob("speed", None, width, height, steps, d.guidance, (0,))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            self._generate(str(device), [job], lambda: False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - started

        one, five = min(timed(1) for _ in range(2)), min(timed(5) for _ in range(2))
        step_s = max((five - one) / 4, 0.0)
        exponent = 1.0
        width, height = self._within_max_side(2 * d.width, 2 * d.height)
        ratio = self._pixels_ratio(width, height)
        if ratio > 1 and one > 0:
            exponent = math.log(max(timed(1, 2), one) / one) / math.log(ratio)
        return ImageSpeed(step_s, max(one - step_s, 0.0), min(max(exponent, 1.0), 2.0))

    def _within_max_side(self, width: int, height: int) -> tuple[int, int]:
        m = self.size_multiple
        return (min(width, self.max_side) // m * m, min(height, self.max_side) // m * m)

    # -- per request ---------------------------------------------------------

    def request_stages(self) -> list[Stage]:
        return [("preprocess", self.preprocess), ("tokenize", self.tokenize)]

    def response_stages(self) -> list[Stage]:
        return [("postprocess", self.encode)]

    def span_attributes(self, stage: str, value) -> dict:
        if stage == "preprocess":
            return {"texel.image.width": value.width, "texel.image.height": value.height,
                    "texel.steps": value.steps}  # fmt: skip
        if stage == "tokenize":
            return {"gen_ai.usage.input_tokens": value.prompt_tokens}
        if stage == "postprocess":
            return {"texel.images": len(value.pngs)}
        return {}

    def encode(self, output: GeneratedImages) -> EncodedImages:
        """Each image as a PNG (zlib level `png_compress_level`)."""
        pngs = []
        for pixels in output.images:
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(
                buffer, format="PNG", compress_level=self.png_compress_level
            )
            pngs.append(buffer.getvalue())
        for step_s in output.step_s:
            metrics.DENOISING_STEP.labels(self.name).observe(step_s)
        metrics.IMAGES_GENERATED.labels(self.name).inc(len(pngs))
        self._learn_speed(output)
        return EncodedImages(pngs, output.seeds)

    def _learn_speed(self, output: GeneratedImages) -> None:
        """Lower the speed estimate to what a served request's steps took, where they
        were faster: warm-up measured it once, and on a machine busy at that moment it
        can be many times too slow, which would refuse every request it says cannot
        finish in time, for as long as the server runs. A step of a batch costs at least
        one alone, so an observation never raises the estimate."""
        if self.speed is None or not output.step_s or not output.images:
            return
        height, width = output.images[0].shape[:2]
        scale = self._pixels_ratio(width, height) ** self.speed.exponent
        step_s = statistics.median(output.step_s) / scale
        if step_s < self.speed.step_s:
            self.speed = dataclasses.replace(self.speed, step_s=step_s)

    def preprocess(self, request: ImageRequest) -> ImageJob:
        """Fill defaults, validate against this model, count prompt tokens."""
        d = self._defaults
        width = request.width or d.width
        height = request.height or d.height
        for side, value in (("width", width), ("height", height)):
            if value % self.size_multiple or not self.size_multiple <= value <= self.max_side:
                raise InvalidParameter(
                    f"{side} must be a multiple of {self.size_multiple} between "
                    f"{self.size_multiple} and {self.max_side}; got {value}",
                    param=side,
                )
        steps = request.num_inference_steps or d.steps
        if steps > self.max_steps:
            raise InvalidParameter(
                f"num_inference_steps must be at most {self.max_steps}",
                param="num_inference_steps",
            )
        guidance = d.guidance if request.guidance_scale is None else request.guidance_scale
        seed = secrets.randbelow(2**31) if request.seed is None else request.seed
        last = MAX_SEED - request.num_images + 1
        if seed > last:
            raise InvalidParameter(
                f"seed must be at most {last} for {request.num_images} images: image i uses "
                f"seed + i, and seeds go up to {MAX_SEED}; got {seed}",
                param="seed",
            )
        seeds = tuple(seed + i for i in range(request.num_images))
        if self.speed is not None and self.deadline_s is not None:
            pixels_ratio = self._pixels_ratio(width, height)
            estimate_s = self.speed.estimate_s(request.num_images, pixels_ratio, steps)
            if estimate_s > self.deadline_s:
                raise InvalidParameter(
                    f"{request.num_images} image(s) of {width}x{height} in {steps} steps "
                    f"would take about {estimate_s:.0f} s on this server, longer than the "
                    f"{self.deadline_s:g} s a request may take; ask for fewer images, steps "
                    f"or pixels"
                )
        return ImageJob(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            width=width,
            height=height,
            steps=steps,
            guidance=guidance,
            seeds=seeds,
        )

    def tokenize(self, job: ImageJob) -> ImageJob:
        """Encode the prompts with the pipeline's tokenizer: refuse one it would truncate,
        the negative prompt as the prompt."""
        tokenizer = self._prompt_tokenizer
        if tokenizer is None:
            return job
        limit = getattr(tokenizer, "model_max_length", None)
        counts = {}
        for name, text in (("prompt", job.prompt), ("negative_prompt", job.negative_prompt)):
            if text is None:
                continue
            with self._tokenizer_lock:
                # verbose=False: counted, not run, so the library's warning that a
                # sequence this long would break the model does not apply.
                counts[name] = len(tokenizer(text, truncation=False, verbose=False)["input_ids"])
            if limit and limit < 1_000_000 and counts[name] > limit:
                raise InvalidParameter(
                    f"the {name} is {counts[name]} tokens long; this model reads at most {limit}",
                    param=name,
                )
        return dataclasses.replace(job, prompt_tokens=counts["prompt"])

    def bucket(self, job: ImageJob) -> tuple[int, int, int, float]:
        """A pipeline call takes one size, step count and guidance scale."""
        return (job.height, job.width, job.steps, job.guidance)

    def cost(self, job: ImageJob) -> float:
        return self.units(job) * job.steps

    def padding_efficiency(self, batch: list[ImageJob]) -> float | None:
        return 1.0  # one bucket means one shape: nothing is padded

    def runner(self, device: torch.device) -> DeviceRunner:
        """Whole batches; with `continuous` and a pipeline Texel steps itself, a stream
        (`batching.stream`) whose requests join and leave a running denoising loop."""
        key = str(device)

        def run(batch: list[ImageJob], should_stop) -> list[GeneratedImages]:
            return self._generate(key, batch, should_stop)

        stream = None
        if self.continuous and key in self._loops:

            def stream(feed) -> None:
                self._stream(key, feed)

        return DeviceRunner(run, stream)

    def denoising_loop(self, device: torch.device) -> DenoisingLoop | None:
        """Texel's own denoising loop on `device`, for pipelines it steps itself."""
        return self._loops.get(str(device))

    def units(self, job: ImageJob) -> float:
        """What a request takes of a stream's budget: its images, in default-size ones."""
        return len(job.seeds) * self._pixels_ratio(job.width, job.height)

    def _pixels_ratio(self, width: int, height: int) -> float:
        """An image's pixels over the default size's."""
        d = self._defaults
        return (width * height) / (d.width * d.height)

    # -- internals -----------------------------------------------------------

    @property
    def _defaults(self) -> ImageDefaults:
        if self.defaults is None:
            raise RuntimeError("ImageGenerator.load() has not run")
        return self.defaults

    def _read_defaults(self, pipe: DiffusionPipeline) -> ImageDefaults:
        params = inspect.signature(pipe.__call__).parameters
        steps = params["num_inference_steps"].default if "num_inference_steps" in params else 25
        guidance = params["guidance_scale"].default if "guidance_scale" in params else 7.5
        try:
            path = cached_file(
                self.source, DEFAULTS_FILE, _raise_exceptions_for_missing_entries=False
            )
        except OSError:
            path = None
        if path:
            saved = json.loads(Path(path).read_text())
            steps = int(saved.get("num_inference_steps", steps))
            guidance = float(saved.get("guidance_scale", guidance))
        scale = getattr(pipe, "vae_scale_factor", 8)
        self.size_multiple = max(8, scale)
        size = getattr(pipe, "default_sample_size", None) or pipe.unet.config.sample_size
        if isinstance(size, list | tuple):
            height, width = size[0] * scale, size[1] * scale
        else:
            height = width = size * scale
        return ImageDefaults(width=int(width), height=int(height), steps=steps, guidance=guidance)

    def _stream(self, device: str, feed) -> None:
        """Continuous batching on `device`: at every step boundary requests join while
        the budget allows (always one, into an empty loop), finished requests are decoded
        and answered, and requests whose clients went away are dropped. On a thread that
        other models share, it parks its requests and gives the thread up to their work
        every `GIVE_WAY_AFTER_S`, and goes on after it (`batching.stream`)."""
        used_gauge = metrics.LOOP_USED.labels(self.name, device)
        try:
            self._steps(device, feed, used_gauge)
        except BaseException:
            used_gauge.set(0)  # the batcher answers its requests with the failure
            raise

    def _steps(self, device: str, feed, used_gauge) -> None:
        """`_stream`'s loop; `used_gauge` follows the images it holds."""
        loop = self._loops[device]
        budget = self._capacity.get(device, 1)
        # Its requests, if it gave the thread up to other work and goes on.
        running: dict[int, Denoising] = feed.resumed if feed.resumed is not None else {}
        slice_started = time.perf_counter()
        with torch.inference_mode():
            while True:
                held_s = time.perf_counter() - slice_started
                # Another model's work waits for this thread: it runs next, then this.
                if running and held_s > GIVE_WAY_AFTER_S and feed.should_give_way():
                    feed.park(running)
                    return
                taken = feed.take(budget, self._fitting(budget, running))
                gone = set(feed.cancelled([*running, *(key for key, _ in taken)]))
                if gone:
                    for key in gone:
                        running.pop(key, None)
                    taken = [item for item in taken if item[0] not in gone]
                    feed.done([(key, Cancelled("the client went away")) for key in gone])
                for key, job in taken:  # each fits the budget: `_fitting` let in no more
                    try:
                        with out_of_memory_as_batching_error():
                            running[key] = loop.join(job)
                    except Exception as exc:  # this request cannot start; the rest go on
                        feed.done([(key, exc)])
                used_gauge.set(sum(self.units(r.job) for r in running.values()))
                if not running:
                    if feed.finish():
                        return
                    continue
                answers = []
                keys = {id(r): key for key, r in running.items()}
                for group in by_size(list(running.values())).values():
                    try:
                        with out_of_memory_as_batching_error():
                            if stepping := [r for r in group if not r.done]:
                                loop.step(stepping)
                                for request in stepping:
                                    feed.progress(keys[id(request)], request.index)
                            finished = [r for r in group if r.done]
                            images = loop.decode(finished) if finished else []
                    except OutOfMemory as exc:
                        # The newest request of the group gives way; the others step again.
                        key = keys[id(group[-1])]
                        del running[key]
                        answers.append((key, exc))
                        continue
                    for request, pixels in zip(finished, images, strict=True):
                        key = keys[id(request)]
                        del running[key]
                        answers.append(
                            (key, GeneratedImages(pixels, request.job.seeds, request.step_s))
                        )
                if answers:
                    feed.done(answers)

    def _fitting(self, budget: float, running: dict) -> Callable[[ImageJob], bool]:
        """Whether each next request fits what is left of the stream's budget after those
        running, counting those it let in before (into an empty loop, the first always
        fits): a request is taken only as it can join, so that its wait before is counted
        as its queue wait and it joins no batch it does not run in."""
        left = budget - sum(self.units(r.job) for r in running.values())
        empty = not running

        def fits(job: ImageJob) -> bool:
            nonlocal left, empty
            units = self.units(job)
            if not empty and units > left:
                return False
            left -= units
            empty = False
            return True

        return fits

    def _generate(self, device: str, batch: list[ImageJob], should_stop) -> list[GeneratedImages]:
        loop = self._loops.get(device)
        if loop is not None:
            with out_of_memory_as_batching_error(), torch.inference_mode():
                results = loop.run(batch, should_stop)
            if results is None:  # every client went away: no VAE decode for nobody
                return [Cancelled("the client went away") for _ in batch]
            return [
                GeneratedImages(images, job.seeds, step_s)
                for job, (images, step_s) in zip(batch, results, strict=True)
            ]
        pipe = self._pipes[device]
        first = batch[0]
        prompts, negatives, generators = [], [], []
        for job in batch:
            for seed in job.seeds:
                prompts.append(job.prompt)
                negatives.append(job.negative_prompt or "")
                generators.append(torch.Generator(device=pipe.device).manual_seed(seed))
        # Schedulers keep per-call state; this worker thread is the only user of
        # `pipe`, and a fresh scheduler per batch leaves nothing behind.
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        step_times: list[float] = []
        last = [time.perf_counter()]

        def on_step_end(pipeline, step, timestep, kwargs):
            now = time.perf_counter()
            step_times.append(now - last[0])
            last[0] = now
            if should_stop():
                pipeline._interrupt = True
            return kwargs

        with out_of_memory_as_batching_error(), torch.inference_mode():
            result = pipe(
                prompt=prompts,
                negative_prompt=negatives if any(negatives) else None,
                height=first.height,
                width=first.width,
                num_inference_steps=first.steps,
                guidance_scale=first.guidance,
                generator=generators,
                output_type="pil",
                callback_on_step_end=on_step_end,
            )
        images = [np.asarray(image) for image in result.images]
        out, start = [], 0
        for job in batch:
            count = len(job.seeds)
            out.append(GeneratedImages(images[start : start + count], job.seeds, step_times))
            start += count
        return out
