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
