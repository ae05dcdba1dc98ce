"""The image adapter on a tiny pipeline, without a server."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from batching import Batcher, BatchFailed, BatchPolicy, Cancelled, ComputeThread, Worker
from engine import protocol
from models.errors import InvalidParameter
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


def test_a_speed_measured_too_slow_at_warm_up_is_corrected_by_the_steps_served():
    """Warm-up on a busy machine once measured steps many times slower than they ran,
    and every request of the default 25 steps was then refused for good."""
    generator = ImageGenerator("x", [], deadline_s=60.0)
    generator.attach(
        {
            "defaults": {"width": 32, "height": 32, "steps": 20, "guidance": 7.5},
            "size_multiple": 8,
            "speed": {"step_s": 2.9, "fixed_s": 0.1, "exponent": 1.0},  # as warm-up said
        }
    )
    asked = ImageRequest("a red circle", num_inference_steps=25)
    with pytest.raises(InvalidParameter, match="would take about 73 s"):
        generator.preprocess(asked)
    # A request of 20 steps that ran: 0.044 s a step at twice the default pixels.
    pixels = np.zeros((32, 64, 3), dtype=np.uint8)
    generator.encode(GeneratedImages([pixels], (0,), [0.044] * 20))
    assert generator.speed.step_s == pytest.approx(0.022)
    assert generator.preprocess(asked).steps == 25
    generator.encode(GeneratedImages([pixels], (0,), [9.0] * 20))  # a slow batch: kept
    assert generator.speed.step_s == pytest.approx(0.022)


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
def test_warm_up_compiles_every_graph_a_request_needs(
    tiny_models, monkeypatch, mode, max_batch, batches
):
    """After warm-up, guided batches and an unguided image compile nothing more, and the
    compiled UNet paints what the eager one paints.

    The graphs are captured by TorchDynamo as in serving, with its guards and its dynamic
    shapes, but run by the `eager` backend instead of lowered by Inductor: which graphs a
    request needs does not depend on the backend, and Inductor's C++ code generation for
    these graphs takes minutes on a 2-core CI machine (Inductor itself is what the GPU
    benchmarks run)."""
    from functools import partial

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
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


# -- step-level batching -------------------------------------------------------


@pytest.fixture(scope="module")
def stepped(tiny_models) -> ImageGenerator:
    """The tiny Stable Diffusion pipeline, warmed up for streams of up to 4 images."""
    cpu = torch.device("cpu")
    generator = ImageGenerator(str(tiny_models["image"]), [cpu])
    generator.open()
    generator.load(cpu)
    generator.warmup(cpu, max_batch_size=4)
    return generator


def _jobs(generator: ImageGenerator, *requests: ImageRequest):
    return [generator.tokenize(generator.preprocess(r)) for r in requests]


def _pixels(results) -> list[np.ndarray]:
    return [image for result in results for image in result.images]


def _streaming(runner, max_wait_s: float) -> Batcher:
    """A batcher of up to 4 requests whose worker runs the model's stream."""
    policy = BatchPolicy(max_batch_size=4, max_wait_s=max_wait_s, max_queue=8)
    return Batcher("image", [Worker("cpu", runner.run, stream=runner.stream)], policy)


def test_texels_denoising_loop_paints_what_the_diffusers_pipeline_paints(stepped):
    jobs = _jobs(
        stepped,
        ImageRequest("a red circle", seed=1, num_images=2),
        ImageRequest("a blue square", seed=5, guidance_scale=1.0),
        ImageRequest("a green line", negative_prompt="blurry", seed=9, num_inference_steps=6),
    )
    ours = _pixels(stepped.runner(torch.device("cpu"))(jobs, lambda: False))
    pipeline_only = ImageGenerator(stepped.source, [torch.device("cpu")], continuous=False)
    pipeline_only.open()
    pipeline_only.load(torch.device("cpu"))
    pipeline_only._loops.clear()  # a pipeline Texel does not step itself runs whole
    theirs = _pixels(pipeline_only._generate("cpu", [j], lambda: False)[0] for j in jobs)
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs, strict=True):
        assert np.array_equal(a, b)


def test_an_image_is_the_same_alone_in_a_batch_or_joining_a_running_loop(stepped):
    first, second = _jobs(
        stepped,
        ImageRequest("a red circle", seed=11, num_inference_steps=8),
        ImageRequest("a yellow star", seed=12, num_inference_steps=5, guidance_scale=1.0),
    )
    run = stepped.runner(torch.device("cpu"))
    alone = [_pixels(run([job], lambda: False)) for job in (first, second)]
    together = _pixels(run([first, second], lambda: False))
    loop = stepped.denoising_loop(torch.device("cpu"))
    with torch.inference_mode():
        early = loop.join(first)
        for _ in range(3):
            loop.step([early])
        late = loop.join(second)  # joins at step 3 of 8, with other steps and no guidance
        while running := [r for r in (early, late) if not r.done]:
            loop.step(running)
        joined = [image for images in loop.decode([early, late]) for image in images]
    assert np.array_equal(together[0], alone[0][0]) and np.array_equal(together[1], alone[1][0])
    assert np.array_equal(joined[0], alone[0][0]) and np.array_equal(joined[1], alone[1][0])


def test_a_whole_batch_whose_clients_all_went_away_stops_before_decoding(stepped):
    jobs = _jobs(stepped, ImageRequest("a red circle", seed=1, num_inference_steps=20))
    steps = []

    def should_stop() -> bool:
        steps.append(1)
        return len(steps) > 2

    (outcome,) = stepped.runner(torch.device("cpu"))(jobs, should_stop)
    assert isinstance(outcome, Cancelled) and len(steps) == 3


async def test_requests_join_a_running_denoising_loop_and_leave_when_their_steps_end(stepped):
    """Through the real batcher: a request sent while another is denoising joins its loop
    (a batch of two) and, with fewer steps, answers first; both images are the ones each
    makes alone."""
    runner = stepped.runner(torch.device("cpu"))
    assert runner.stream is not None
    batcher = _streaming(runner, max_wait_s=0.5)
    batcher.start()
    try:
        long, short = _jobs(
            stepped,
            ImageRequest("a red circle", seed=3, num_inference_steps=60),
            ImageRequest("a blue square", seed=4, num_inference_steps=3, guidance_scale=1.0),
        )
        first = asyncio.ensure_future(batcher.submit(long, bucket=0, cost=1, timeout_s=60))
        await asyncio.sleep(0.3)  # the loop is running the long request's steps
        assert not first.done()
        second = await batcher.submit(short, bucket=1, cost=1, timeout_s=60)
        assert not first.done(), "the short request waited for the long one"
        long_result = await first
    finally:
        await batcher.close()
    assert second.batch_size == 2 and len(second.value.step_s) == 3
    alone = [_pixels(runner([job], lambda: False)) for job in (long, short)]
    assert np.array_equal(long_result.value.images[0], alone[0][0])
    assert np.array_equal(second.value.images[0], alone[1][0])


async def test_a_request_that_does_not_fit_the_loops_budget_waits_in_the_queue_not_the_loop(
    stepped,
):
    """The loop's budget is 4 images: a request of 4 sent while another of 4 denoises
    cannot join it, and waits until that one has left. That wait is its queue wait, and
    it runs in a batch of one, as it does: it was counted as joined at once (a batch of
    two, a queue wait of nothing, its wait counted as generating)."""
    runner = stepped.runner(torch.device("cpu"))
    batcher = _streaming(runner, max_wait_s=0.0)
    batcher.start()
    try:
        early, late = _jobs(
            stepped,
            ImageRequest("a red circle", seed=3, num_inference_steps=60, num_images=4),
            ImageRequest("a blue square", seed=4, num_inference_steps=3, num_images=4),
        )
        first = asyncio.ensure_future(batcher.submit(early, bucket=0, cost=4, timeout_s=60))
        await asyncio.sleep(0.2)  # the loop denoises the first request's 4 images
        assert not first.done()
        second = await batcher.submit(late, bucket=0, cost=4, timeout_s=60)
        first = await first
    finally:
        await batcher.close()
    assert first.batch_size == 1 and second.batch_size == 1
    assert second.queue_wait_s > 0.5 * first.run_s, (second.queue_wait_s, first.run_s)
    assert second.run_s < first.run_s  # 3 steps against 60, from when it joined


async def test_a_request_whose_client_went_away_leaves_the_loop_and_the_others_go_on(stepped):
    runner = stepped.runner(torch.device("cpu"))
    batcher = _streaming(runner, max_wait_s=0.5)
    batcher.start()
    try:
        kept, dropped = _jobs(
            stepped,
            ImageRequest("a red circle", seed=3, num_inference_steps=10),
            ImageRequest("a blue square", seed=4, num_inference_steps=100),
        )
        stays = asyncio.ensure_future(batcher.submit(kept, bucket=0, cost=1, timeout_s=60))
        goes = asyncio.ensure_future(batcher.submit(dropped, bucket=0, cost=1, timeout_s=60))
        await asyncio.sleep(0.3)
        goes.cancel()
        result = await asyncio.wait_for(stays, 30)
        # The dropped request's 100 steps no longer run: the loop has ended.
        assert await batcher.drain(timeout_s=1.0)
    finally:
        await batcher.close()
    assert len(result.value.step_s) == 10
    assert np.array_equal(result.value.images[0], _pixels(runner([kept], lambda: False))[0])


async def test_on_a_shared_thread_a_long_denoising_loop_gives_way_to_other_work(stepped):
    """One compute thread for two models (a CPU): another model's batch sent while a long
    image runs is answered before that image ends, and the image comes out as it would
    alone."""
    thread = ComputeThread(thread_name_prefix="texel-test-shared")
    runner = stepped.runner(torch.device("cpu"))
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0.0, max_queue=8)
    images = Batcher("image", [Worker("cpu", runner.run, thread, stream=runner.stream)], policy)
    doubled = Batcher("double", [Worker("cpu", lambda xs, stop: [2 * x for x in xs], thread)],
                      policy)  # fmt: skip
    images.start()
    doubled.start()
    try:
        (long,) = _jobs(stepped, ImageRequest("a red circle", seed=3, num_inference_steps=100))
        image = asyncio.ensure_future(images.submit(long, bucket=0, cost=1, timeout_s=120))
        await asyncio.sleep(0.5)
        other = await asyncio.wait_for(doubled.submit(21, bucket=0, cost=1, timeout_s=60), 20)
        assert other.value == 42
        assert not image.done(), "the other model's batch waited for the whole image"
        result = await asyncio.wait_for(image, 120)
    finally:
        await images.close()
        await doubled.close()
        thread.shutdown()
    assert len(result.value.step_s) == 100
    assert np.array_equal(result.value.images[0], _pixels(runner([long], lambda: False))[0])


async def test_the_loops_budget_and_what_it_holds_are_metrics(stepped):
    from telemetry import metrics

    labels = {"model": stepped.name, "device": "cpu"}

    def sample(name: str) -> float | None:
        return metrics.REGISTRY.get_sample_value(name, labels)

    runner = stepped.runner(torch.device("cpu"))
    seen: list[float] = []
    batcher = _streaming(runner, max_wait_s=0.0)
    batcher.start()
    try:
        jobs = _jobs(
            stepped,
            ImageRequest("a red circle", seed=3, num_inference_steps=30, num_images=2),
            ImageRequest("a blue square", seed=4, num_inference_steps=30),
        )
        submitted = [batcher.submit(job, bucket=0, cost=1, timeout_s=60) for job in jobs]
        task = asyncio.ensure_future(asyncio.gather(*submitted))
        while not task.done():
            seen.append(sample("texel_denoising_used_images") or 0.0)
            await asyncio.sleep(0.01)
        await task
    finally:
        await batcher.close()
    assert sample("texel_denoising_budget_images") == 4
    # The loop sets it to 0 on its thread as it goes round once more, after the answers.
    deadline = time.monotonic() + 2
    while sample("texel_denoising_used_images") != 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert max(seen) == 3 and sample("texel_denoising_used_images") == 0


async def test_a_failed_stream_answers_its_requests_and_holds_no_images(stepped, monkeypatch):
    """A step that raises (not out of memory) ends the stream: its requests get the
    failure, and the used-images gauge, which held the last step's images, reads 0."""
    from telemetry import metrics

    labels = {"model": stepped.name, "device": "cpu"}
    loop = stepped.denoising_loop(torch.device("cpu"))
    steps = [0]
    real_step = loop.step

    def failing_step(group):
        steps[0] += 1
        if steps[0] > 3:
            raise RuntimeError("a kernel failed")
        real_step(group)

    monkeypatch.setattr(loop, "step", failing_step)
    batcher = _streaming(stepped.runner(torch.device("cpu")), max_wait_s=0.0)
    batcher.start()
    try:
        (job,) = _jobs(stepped, ImageRequest("a red circle", seed=3, num_inference_steps=30))
        with pytest.raises(BatchFailed, match="a kernel failed"):
            await asyncio.wait_for(batcher.submit(job, bucket=0, cost=1, timeout_s=60), 60)
    finally:
        await batcher.close()
    assert steps[0] == 4
    assert metrics.REGISTRY.get_sample_value("texel_denoising_used_images", labels) == 0
