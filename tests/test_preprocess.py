"""Formula image preprocessing: what the model sees of an upload."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from models.errors import CorruptImage, ImageTooLarge, UnsupportedImage
from models.formula.preprocess import (
    FormulaImageSpec,
    bucket_width,
    decode_image,
    pad_and_normalize,
    prepare_strip,
)

SPEC = FormulaImageSpec(height=32, max_width=256, width_multiple=32)


def ink_box(size=(200, 60), box=(50, 20, 110, 35), mode="RGB", ink=0, paper=255) -> Image.Image:
    image = Image.new("L", size, paper)
    image.paste(ink, box)
    return image.convert(mode)


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def test_a_strip_is_trimmed_to_its_ink_and_scaled_to_the_model_height():
    strip = prepare_strip(ink_box(), SPEC)
    assert strip.shape[0] == 32
    # 60x15 ink + 2 px margins -> 64x19, scaled by 32/19.
    assert strip.shape[1] == round(64 * 32 / 19)
    assert strip[:, :3].min() > 200 and strip[10:20, 10:-10].max() < 100


def test_transparent_and_inverted_images_become_dark_ink_on_white():
    rgba = Image.new("RGBA", (100, 40), (0, 0, 0, 0))
    rgba.paste((0, 0, 0, 255), (20, 10, 60, 30))
    inverted = ink_box(ink=255, paper=0)
    for image in (rgba, inverted):
        strip = prepare_strip(image, SPEC)
        assert strip[0, 0] == 255 and strip.min() < 50


def test_a_very_wide_formula_is_fitted_to_max_width_and_padded_vertically():
    strip = prepare_strip(ink_box(size=(3000, 40), box=(10, 10, 2990, 30)), SPEC)
    assert strip.shape == (32, 256)


def test_bucket_widths_are_multiples_of_the_step_within_limits():
    assert bucket_width(1, SPEC, 64) == 64
    assert bucket_width(64, SPEC, 64) == 64
    assert bucket_width(65, SPEC, 64) == 128
    assert bucket_width(250, SPEC, 64) == 256
    assert bucket_width(70, SPEC, 40) == 96  # steps round down to the model's multiple


def test_a_batch_is_padded_with_white_and_normalized():
    strips = [np.zeros((32, 40), np.uint8), np.zeros((32, 64), np.uint8)]
    batch = pad_and_normalize(strips, 64, SPEC)
    assert batch.shape == (2, 1, 32, 64)
    assert batch[0, 0, :, 40:].min() == pytest.approx(1.0)  # white after normalization
    assert batch[0, 0, :, :40].max() == pytest.approx(-1.0)


def test_evaluation_pads_batches_to_the_server_buckets():
    from training.formula.data import server_batch

    strips = [np.zeros((32, 40), np.uint8), np.zeros((32, 70), np.uint8)]
    assert server_batch(strips, SPEC).shape == (2, 1, 32, 128), "the 64 px default"
    assert server_batch(strips, SPEC, step=96).shape == (2, 1, 32, 96)
    assert server_batch(strips[:1], SPEC, step=128).shape == (1, 1, 32, 128)


def test_every_supported_format_decodes():
    for fmt in ("PNG", "JPEG", "WEBP", "BMP", "GIF"):
        assert decode_image(encode(ink_box(), fmt), max_pixels=10**6).size == (200, 60)


def test_decode_refuses_bad_input_with_specific_errors():
    with pytest.raises(UnsupportedImage):
        decode_image(b"definitely not an image", max_pixels=10**6)
    with pytest.raises(UnsupportedImage):
        decode_image(encode(ink_box(), "TIFF"), max_pixels=10**6)
    with pytest.raises(CorruptImage):
        decode_image(encode(ink_box())[:100], max_pixels=10**6)
    with pytest.raises(ImageTooLarge):
        decode_image(encode(ink_box()), max_pixels=100)


def test_a_spec_round_trips_through_its_preprocessor_config(tmp_path):
    import json

    spec = FormulaImageSpec(height=48, max_width=768, width_multiple=16, max_upscale=2.0)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(spec.to_preprocessor_config()))
    assert FormulaImageSpec.from_pretrained(tmp_path) == spec


def test_device_normalization_matches_pad_and_normalize() -> None:
    """The server normalizes uint8 strips with torch on the model's device; training and
    evaluation use numpy. Both must give the model the same float32 values."""
    import torch

    from models.formula.preprocess import normalize_pixels, pad_strips

    rng = np.random.default_rng(3)
    strips = [rng.integers(0, 256, (SPEC.height, w), dtype=np.uint8) for w in (10, 64, 37)]
    expected = pad_and_normalize(strips, 64, SPEC)
    got = normalize_pixels(torch.from_numpy(pad_strips(strips, 64)), SPEC)
    assert got.dtype == torch.float32 and tuple(got.shape) == expected.shape
    assert np.array_equal(got.numpy(), expected)


def test_an_http_process_preprocesses_without_weights_and_the_engine_gets_that_payload(
    tiny_models,
) -> None:
    """HTTP processes open the recognizer (tokenizer, image spec) and load no weights;
    the payload they make crosses the engine protocol to what an in-process engine gets."""
    import torch

    from engine import protocol
    from models.formula.adapter import FormulaRecognizer

    recognizer = FormulaRecognizer(str(tiny_models["formula"]), [torch.device("cpu")])
    recognizer.open()
    payload = recognizer.preprocess(encode(ink_box()))
    received = protocol.decoder(FormulaRecognizer.payload_type).decode(protocol.encode(payload))
    assert (received.width, received.bucket) == (payload.width, payload.bucket)
    assert np.array_equal(received.strip, payload.strip)
    assert not recognizer._models, "no weights on the request side"
