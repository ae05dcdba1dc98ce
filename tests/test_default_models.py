"""The shipped default models, served through the real server path."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import SHARED_DATA
from tests.server import ROOT, ServerProcess

FORMULAS = SHARED_DATA / "im2latex-val"
DEFAULT_FORMULA = ROOT / "models" / "formula" / "default"
DEFAULT_IMAGE = ROOT / "models" / "image" / "default"


def dev_samples(count: int) -> list[tuple[str, str]]:
    """The first `count` images of the dev split (never trained on), in file order."""
    from training.formula.data import is_dev

    rows = [line.rstrip("\n").split("\t", 1) for line in (FORMULAS / "formulas.tsv").open()]
    return [(name, latex) for name, latex in rows if is_dev(name)][:count]


@pytest.fixture(scope="module")
def default_server():
    proc = ServerProcess({"TEXEL_DEVICE": "cpu", "TEXEL_FORMULA__MAX_BATCH_SIZE": "4"})
    yield proc
    proc.stop()


def test_the_default_models_load_and_report_their_names(default_server):
    ready = default_server.client().get("/readyz").json()
    assert ready["models"] == {"formula": "ready", "image": "ready"}


@pytest.mark.skipif(
    not FORMULAS.exists(), reason=f"shared data not found at {FORMULAS}: set TEXEL_DATA"
)
def test_the_default_formula_model_reads_real_dev_images(default_server):
    from training.formula.evaluate import normalized_edit_distance
    from training.formula.tokenizer import latex_tokens

    distances, exact = [], 0
    with default_server.client() as client:
        for name, reference in dev_samples(12):
            data = (FORMULAS / "images" / name).read_bytes()
            response = client.post("/recognize", files={"image": (name, data, "image/png")})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["model"] == "texel-formula"
            hypothesis = latex_tokens(body["latex"])
            wanted = latex_tokens(reference)
            exact += hypothesis == wanted
            distances.append(normalized_edit_distance(wanted, hypothesis))
    # Measured through the server with the shipped model (run 9, an ad-hoc run of this
    # test's loop): 4 of 12 exact, mean distance 0.078, max 0.23 (run 8: 4 of 12, 0.089,
    # 0.28; run 7: 3 of 12, 0.115, 0.34).
    assert exact >= 2, distances
    assert sum(distances) / len(distances) <= 0.15, distances
    assert max(distances) < 0.4, distances


@pytest.mark.skipif(
    not FORMULAS.exists(), reason=f"shared data not found at {FORMULAS}: set TEXEL_DATA"
)
def test_the_served_evaluation_transcribes_as_the_server_does(default_server):
    """`evaluate --served` decodes through the server's own adapter and decoder: one image
    at a time (the same shapes as the server's lone requests), the same LaTeX."""
    from training.formula.evaluate import recognize_served

    images = [(FORMULAS / "images" / name).read_bytes() for name, _ in dev_samples(4)]
    texts = recognize_served(DEFAULT_FORMULA, "cpu", "auto", images, batch_size=1)
    with default_server.client() as client:
        for data, text in zip(images, texts, strict=True):
            response = client.post("/recognize", files={"image": ("f.png", data, "image/png")})
            assert response.status_code == 200, response.text
            assert response.json()["latex"] == text


def test_the_default_image_model_paints_the_prompted_background(default_server):
    import random

    from training.image.judge import score
    from training.image.shapes import prompt_for, random_spec

    rng = random.Random(7)
    prompts = [prompt_for(random_spec(rng, held_out=None)) for _ in range(12)]
    results = []
    with default_server.client() as client:
        for i, prompt in enumerate(prompts):
            response = client.post("/generate", json={"prompt": prompt, "seed": i})
            assert response.status_code == 200, response.text
            png = base64.b64decode(response.json()["images"][0]["png_base64"])
            image = Image.open(io.BytesIO(png)).convert("RGB")
            assert image.size == (64, 64)
            results.append(score(image, prompt))
    # The shipped demonstration model gets backgrounds right (98% of held-out prompts in
    # training/image/NOTES.md) but not yet colours, shapes or counts.
    right = sum(r["background"] for r in results)
    assert right >= 10, list(zip(prompts, results, strict=True))


def test_default_models_are_small_enough_to_ship():
    for directory in (DEFAULT_FORMULA, DEFAULT_IMAGE):
        size = sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())
        assert size <= 50 * 1024 * 1024, (directory, size)
