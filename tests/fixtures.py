"""Shared fixtures: tiny models built from configs, and real Texel servers on free ports.

A plugin that the conftest.py at the repository root loads, so that the tests and the
benchmarks' tests (bench/tests) share one of each session fixture: the tiny models are
built once and the shared server starts once per run."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import ServerProcess


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from training.tiny import build_tiny_formula_model, build_tiny_image_pipeline

    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "formula": build_tiny_formula_model(root / "formula"),
        "image": build_tiny_image_pipeline(root / "image"),
    }


def weightless_copy(model: Path, to: Path) -> Path:
    """`model`'s folder without its weights: it passes the start-up check of a model
    folder, then fails to load (an OSError from `from_pretrained`, as a user's
    half-copied folder would)."""
    shutil.copytree(model, to, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return to


@pytest.fixture(scope="session")
def tiny_env(tiny_models) -> dict[str, str]:
    return {
        "TEXEL_FORMULA__MODEL": str(tiny_models["formula"]),
        "TEXEL_IMAGE__MODEL": str(tiny_models["image"]),
        "TEXEL_DEVICE": "cpu",
    }


@pytest.fixture(scope="session")
def server(tiny_env) -> Iterator[ServerProcess]:
    """One shared server with tiny models and a generous batching window."""
    proc = ServerProcess(
        {
            **tiny_env,
            "TEXEL_FORMULA__MAX_WAIT_MS": "150",
            "TEXEL_FORMULA__MAX_BATCH_SIZE": "8",
            "TEXEL_IMAGE__MAX_WAIT_MS": "150",
            "TEXEL_MAX_UPLOAD_BYTES": str(256 * 1024),
            "TEXEL_MAX_IMAGE_PIXELS": str(4_000_000),
        }
    )
    yield proc
    proc.stop()


@pytest.fixture
def start_server(tiny_env):
    """Start extra servers with their own settings; all are stopped after the test."""
    started: list[ServerProcess] = []

    def start(wait_ready: bool = True, **env: str) -> ServerProcess:
        proc = ServerProcess({**tiny_env, **env}, wait_ready=wait_ready)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop(signal.SIGKILL)


@pytest.fixture
def tiny_recognizer(tiny_models):
    """A warmed-up CPU `FormulaRecognizer` on the tiny model, with its static decoder,
    and random formula strips of the given widths: `(recognizer, inputs)`."""
    import numpy as np
    import torch

    from models.formula.adapter import FormulaInput, FormulaRecognizer

    def build(max_batch_size: int, widths: tuple[int, ...], seed: int = 0):
        cpu = torch.device("cpu")
        recognizer = FormulaRecognizer(str(tiny_models["formula"]), [cpu], decoder="static")
        recognizer.open()
        recognizer.load(cpu)
        recognizer.warmup(cpu, max_batch_size=max_batch_size)
        rng = np.random.default_rng(seed)
        height = recognizer.spec.height
        inputs = [
            FormulaInput(rng.integers(0, 256, (height, width), dtype=np.uint8), width)
            for width in widths
        ]
        return recognizer, inputs

    return build
