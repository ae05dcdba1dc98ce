"""The image adapter on a tiny pipeline, without a server."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from engine import protocol
from models.image.adapter import GeneratedImages, ImageGenerator, ImageRequest


def test_prompt_tokenizing_on_other_threads_never_disturbs_a_running_pipeline(tiny_models):
    """Fast tokenizers keep padding settings as shared state; the request path has its own."""
    cpu = torch.device("cpu")
    generator = ImageGenerator(str(tiny_models["image"]), [cpu])
    generator.open()
    generator.load(cpu)
    pipeline_tokenizer = generator._pipes["cpu"].tokenizer
    job = generator.tokenize(generator.preprocess(ImageRequest("a red circle", seed=1)))
    stop = threading.Event()
    errors: list[BaseException] = []

    def tokenize_forever() -> None:
        while not stop.is_set():
            try:
                generator.tokenize(job)
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

    threads = [threading.Thread(target=tokenize_forever) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        # What StableDiffusionPipeline.encode_prompt does for the unconditional prompt.
        for _ in range(3000):
            ids = pipeline_tokenizer(
                [""],
                padding="max_length",
                max_length=pipeline_tokenizer.model_max_length,
                truncation=True,
                return_tensors="pt",
            ).input_ids
            assert ids.shape[1] == pipeline_tokenizer.model_max_length
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors


def test_a_request_side_without_weights_makes_the_jobs_the_loaded_model_would(tiny_models):
    """An HTTP process opens the model, loads no pipeline and takes its defaults from
    what the engine's loaded model describes (across the engine protocol)."""
    cpu = torch.device("cpu")
    loaded = ImageGenerator(str(tiny_models["image"]), [cpu])
    loaded.open()
    loaded.load(cpu)
    request_side = ImageGenerator(str(tiny_models["image"]), [cpu])
    request_side.open()
    request = ImageRequest("a red circle", width=32, seed=3)
    with pytest.raises(RuntimeError, match="has not run"):  # no defaults yet
        request_side.preprocess(request)
    status = protocol.ModelStatus("ready", description=loaded.describe())
    request_side.attach(
        protocol.decoder(protocol.ModelStatus).decode(protocol.encode(status)).description
    )
    job = request_side.tokenize(request_side.preprocess(request))
    assert job == loaded.tokenize(loaded.preprocess(request))
    assert job.prompt_tokens > 0 and not request_side._pipes


def test_generated_images_are_encoded_as_pngs_of_their_pixels():
    pixels = np.random.default_rng(0).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    encoded = ImageGenerator("x", []).encode(GeneratedImages([pixels, pixels // 2], (7, 8)))
    assert encoded.seeds == (7, 8)
    decoded = [np.asarray(Image.open(io.BytesIO(png))) for png in encoded.pngs]
    assert np.array_equal(decoded[0], pixels) and np.array_equal(decoded[1], pixels // 2)


def test_a_higher_png_compress_level_makes_smaller_files():
    flat = np.zeros((64, 64, 3), dtype=np.uint8)
    flat[::2] = 200
    images = GeneratedImages([flat], (0,))
    fast = ImageGenerator("x", [], png_compress_level=0).encode(images).pngs[0]
    small = ImageGenerator("x", [], png_compress_level=9).encode(images).pngs[0]
    assert len(small) < len(fast)


def _images(generator: ImageGenerator, jobs) -> list[torch.Tensor]:
    out = generator.runner(torch.device("cpu"))(jobs, lambda: False)
    return [torch.tensor(image, dtype=torch.float32) for g in out for image in g.images]


def test_compile_setting_is_checked():
    for setting in ("off", "batch", "dynamic"):
        assert ImageGenerator("x", [], compile=setting).compile_setting == setting
    with pytest.raises(ValueError, match="off, batch or dynamic"):
        ImageGenerator("x", [], compile="true")


@pytest.mark.parametrize(
    ("mode", "max_batch", "batches"),
    [
        # dynamic: one graph covers batches beyond the warm-up's (3 rows of 2 sizes).
        ("dynamic", 2, [3, 1]),
        # batch: the full batch's graph, then one with a symbolic batch size for the rest.
        ("batch", 3, [3, 2, 1]),
    ],
)
def test_warm_up_compiles_every_graph_a_request_needs(tiny_models, mode, max_batch, batches):
    """After warm-up, guided batches and an unguided image compile nothing more, and the
    compiled UNet paints what the eager one paints."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cpu = torch.device("cpu")
    compiled = ImageGenerator(str(tiny_models["image"]), [cpu], compile=mode)
    compiled.open()
    compiled.load(cpu)
    assert hasattr(compiled._pipes["cpu"].unet, "_orig_mod")
    compiled.warmup(cpu, max_batch_size=max_batch)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    requests = [
        [compiled.preprocess(ImageRequest("a red circle", seed=s)) for s in range(size)]
        for size in batches
    ]
    requests.append([compiled.preprocess(ImageRequest("a blue square", seed=7, guidance_scale=1))])
    got = [image for jobs in requests for image in _images(compiled, jobs)]
    assert counters["stats"]["unique_graphs"] == graphs, "a request compiled a graph"

    eager = ImageGenerator(str(tiny_models["image"]), [cpu])
    eager.open()
    eager.load(cpu)
    assert not hasattr(eager._pipes["cpu"].unet, "_orig_mod")
    want = [image for jobs in requests for image in _images(eager, jobs)]
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= 2, "compiled and eager images differ by more than rounding"


def test_a_failed_compilation_fails_the_warm_up(tiny_models, monkeypatch):
    """Asked for, compilation is not silently skipped: the server does not become ready."""

    def broken_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda model, **kw: real_compile(model, backend=broken_backend)
    )
    torch._dynamo.reset()
    cpu = torch.device("cpu")
    generator = ImageGenerator(str(tiny_models["image"]), [cpu], compile="batch")
    generator.open()
    generator.load(cpu)
    with pytest.raises(Exception, match="no compiler here"):
        generator.warmup(cpu, max_batch_size=1)
