"""The image adapter on a tiny pipeline, without a server."""

from __future__ import annotations

import threading

import torch

from models.image.adapter import ImageGenerator, ImageRequest


def test_prompt_tokenizing_on_other_threads_never_disturbs_a_running_pipeline(tiny_models):
    """Fast tokenizers keep padding settings as shared state; the request path has its own."""
    generator = ImageGenerator(str(tiny_models["image"]), [torch.device("cpu")])
    generator.load()
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


def _images(generator: ImageGenerator, jobs) -> list[torch.Tensor]:
    out = generator.runner(torch.device("cpu"))(jobs, lambda: False)
    return [
        torch.tensor(list(image.getdata()), dtype=torch.float32) for g in out for image in g.images
    ]


def test_auto_compiles_the_unet_on_cuda_only(tiny_models):
    generator = ImageGenerator(str(tiny_models["image"]), [torch.device("cpu")])
    assert not generator.compiles(torch.device("cpu"))
    assert generator.compiles(torch.device("cuda:0"))
    assert not ImageGenerator("x", [], compile="false").compiles(torch.device("cuda:0"))
    assert ImageGenerator("x", [], compile="true").compiles(torch.device("cpu"))


def test_warm_up_compiles_every_graph_a_request_needs(tiny_models):
    """After warm-up, batches of other sizes and an unguided image compile nothing, and
    the compiled UNet paints what the eager one paints."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    cpu = torch.device("cpu")
    compiled = ImageGenerator(str(tiny_models["image"]), [cpu], compile="true")
    compiled.load()
    assert hasattr(compiled._pipes["cpu"].unet, "_orig_mod")
    compiled.warmup(cpu, max_batch_size=2)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    d = compiled.defaults
    guided = [compiled.preprocess(ImageRequest("a red circle", seed=s)) for s in range(3)]
    unguided = [compiled.preprocess(ImageRequest("a blue square", seed=7, guidance_scale=1.0))]
    got = _images(compiled, guided) + _images(compiled, unguided)
    assert counters["stats"]["unique_graphs"] == graphs, "a request compiled a graph"

    eager = ImageGenerator(str(tiny_models["image"]), [cpu], compile="false")
    eager.load()
    assert not hasattr(eager._pipes["cpu"].unet, "_orig_mod")
    want = _images(eager, guided) + _images(eager, unguided)
    assert (d.width, d.height) == (eager.defaults.width, eager.defaults.height)
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= 2, "compiled and eager images differ by more than rounding"


def test_a_failed_compilation_under_auto_falls_back_to_the_eager_unet(tiny_models, monkeypatch):
    def broken_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda model, **kw: real_compile(model, backend=broken_backend)
    )
    torch._dynamo.reset()
    cpu = torch.device("cpu")
    generator = ImageGenerator(str(tiny_models["image"]), [cpu])
    monkeypatch.setattr(generator, "compiles", lambda device: True)
    generator.load()
    generator.warmup(cpu, max_batch_size=1)
    assert not hasattr(generator._pipes["cpu"].unet, "_orig_mod")
    job = generator.preprocess(ImageRequest("a red circle", seed=1))
    assert len(_images(generator, [job])) == 1

    strict = ImageGenerator(str(tiny_models["image"]), [cpu], compile="true")
    strict.load()
    try:
        strict.warmup(cpu, max_batch_size=1)
    except Exception as exc:  # noqa: BLE001 - dynamo wraps the backend's error
        assert "no compiler here" in str(exc)
    else:
        raise AssertionError("compile=true must not hide a failed compilation")
