"""The UNet's steps replayed from CUDA graphs paint what eager steps paint (a GPU only:
CUDA graphs do not exist on a CPU, where the loop always steps eagerly)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.image.adapter import ImageGenerator, ImageRequest

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _pixels(generator: ImageGenerator, device: torch.device, *requests: ImageRequest):
    jobs = [generator.tokenize(generator.preprocess(r)) for r in requests]
    results = generator.runner(device)(jobs, lambda: False)
    return [image for result in results for image in result.images]


def _warmed_up(path, device: torch.device, max_batch_size: int) -> ImageGenerator:
    generator = ImageGenerator(str(path), [device])
    generator.open()
    generator.load(device)
    generator.warmup(device, max_batch_size=max_batch_size)
    return generator


def test_on_a_cpu_the_loop_steps_eagerly(tiny_models):
    cpu = torch.device("cpu")
    assert _warmed_up(tiny_models["image"], cpu, 2).denoising_loop(cpu).graphs is None


@needs_cuda
def test_graphed_steps_paint_what_eager_steps_paint(tiny_models):
    cuda = torch.device("cuda")
    generator = _warmed_up(tiny_models["image"], cuda, 4)
    loop = generator.denoising_loop(cuda)
    assert loop.graphs is not None
    requests = (
        ImageRequest("a red circle", seed=1, num_images=2),  # 4 rows under guidance
        ImageRequest("a blue square", seed=5, guidance_scale=1.0),  # 1 row, unguided
        ImageRequest("a green line", seed=9, num_inference_steps=6),
    )
    defaults = generator.defaults
    other_size = ImageRequest("a small one", seed=3, width=defaults.width // 2,
                              height=defaults.height // 2)  # fmt: skip
    graphed = _pixels(generator, cuda, *requests) + _pixels(generator, cuda, other_size)
    loop.graphs = None
    eager = _pixels(generator, cuda, *requests) + _pixels(generator, cuda, other_size)
    assert len(graphed) == len(eager) == 5
    for a, b in zip(graphed, eager, strict=True):
        assert np.array_equal(a, b)
