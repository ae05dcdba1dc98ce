"""Shared fixtures: tiny models built from configs, and real Texel servers on free ports."""

from __future__ import annotations

import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageDraw

from tests.server import ROOT, ServerProcess, free_port

__all__ = ["ROOT", "ServerProcess", "free_port", "formula_png", "wait_for"]
SHARED_DATA = Path(os.environ.get("TEXEL_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from training.tiny import build_tiny_formula_model, build_tiny_image_pipeline

    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "formula": build_tiny_formula_model(root / "formula"),
        "image": build_tiny_image_pipeline(root / "image"),
    }


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


def formula_png(text: str = "x^2 + 1", size=(220, 48), fmt: str = "PNG") -> bytes:
    """A small picture with dark text on white, in the given format."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((12, 16), text, fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def wait_for(condition, timeout: float = 30.0) -> None:
    """Poll `condition` until true; a server that refuses or resets a connection meanwhile
    (starting, or a process of it dying) counts as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (httpx.HTTPError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


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
