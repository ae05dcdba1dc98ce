"""Formula image preprocessing: what the model sees of an upload."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from models.errors import CorruptImage, ImageTooLarge, UnsupportedImage
from models.formula.preprocess import (
    FormulaImageSpec,
    FormulaPreprocessor,
    _median_u8,
    _pieces,
    _quantile_u8,
    bucket_width,
    decode_image,
    inside_frame,
    local_paper,
    on_its_card,
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


@pytest.mark.parametrize("colour", [(255, 255, 255), (255, 230, 60)], ids=["white", "yellow"])
def test_light_ink_on_a_transparent_picture_is_read_like_dark_ink(colour):
    # A formula exported in a light colour for a dark page: on white it would vanish.
    dark = Image.new("RGBA", (100, 40), (0, 0, 0, 0))
    dark.paste((0, 0, 0, 255), (20, 10, 60, 30))
    light = Image.new("RGBA", (100, 40), (*colour, 0))
    light.paste((*colour, 255), (20, 10, 60, 30))
    expected = prepare_strip(dark, SPEC)
    assert expected.min() < 50
    np.testing.assert_array_equal(prepare_strip(light, SPEC), expected)


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


# -- pictures that hold no formula --------------------------------------------


@pytest.mark.parametrize(
    "image",
    [
        Image.new("RGB", (1, 1), (0, 0, 0)),
        Image.new("L", (60000, 1), 0),
        Image.new("RGB", (640, 480), (70, 130, 180)),  # a uniform colour
        Image.new("L", (800, 600), 255),
    ],
    ids=["1x1", "60000x1", "uniform colour", "all white"],
)
def test_a_picture_with_no_ink_becomes_an_empty_strip(image):
    assert prepare_strip(image, SPEC).shape == (SPEC.height, 0)


def test_an_all_black_16_megapixel_upload_is_blank_not_a_formula():
    item = FormulaPreprocessor(SPEC, 64, 16_000_000)(encode(Image.new("L", (4000, 4000), 0)))
    assert item.blank and item.width == 0


def test_the_model_does_not_read_a_blank_picture(tiny_models) -> None:
    """A blank input is answered with no tokens; the inked one beside it is decoded."""
    import torch

    from models.formula.adapter import FormulaRecognizer

    cpu = torch.device("cpu")
    recognizer = FormulaRecognizer(str(tiny_models["formula"]), [cpu], decoder="generate")
    recognizer.open()
    recognizer.load(cpu)
    blank = recognizer.preprocess(encode(Image.new("L", (300, 80), 255)))
    inked = recognizer.preprocess(encode(ink_box()))
    out = recognizer.runner(cpu)([blank, inked], lambda: False)
    assert out[0].token_ids == [] and recognizer.detokenize(out[0]).latex == ""
    assert not inked.blank


# -- decoding ---------------------------------------------------------------------


def test_exif_orientation_is_honoured():
    """A phone stores a landscape photo as portrait pixels plus an orientation tag."""
    upright = ink_box(size=(200, 60), box=(20, 20, 180, 40))
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # what the camera wrote
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", exif=exif.tobytes())
    assert decode_image(buffer.getvalue(), max_pixels=10**6).size == (200, 60)


def test_16_bit_grayscale_is_scaled_to_8_bits_not_clipped_to_white():
    pixels = np.full((60, 200), 65535, dtype=np.uint16)
    pixels[20:35, 50:110] = 20000  # dark gray ink, above 255 in 16 bits
    image = decode_image(encode(Image.fromarray(pixels)), max_pixels=10**6)
    assert image.mode.startswith("I")
    strip = prepare_strip(image, SPEC)
    assert strip.shape[1] > 0 and strip.min() < 60 and strip[:, :3].min() > 200


# -- ink on paper ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ink", "paper"),
    [
        ((230, 180, 0), (255, 255, 255)),  # yellow ink
        ((20, 60, 200), (250, 240, 200)),  # blue ink on cream paper
        ((222, 222, 222), (40, 42, 54)),  # dark mode: light grey on charcoal
        ((150, 150, 150), (225, 225, 225)),  # low contrast
    ],
    ids=["yellow ink", "blue on cream", "dark mode", "low contrast"],
)
def test_any_ink_on_any_paper_becomes_black_on_white(ink, paper):
    image = Image.new("RGB", (200, 60), paper)
    image.paste(ink, (50, 20, 80, 35))
    image.paste(ink, (100, 20, 130, 35))
    strip = prepare_strip(image, SPEC)
    gap = strip.shape[1] // 2  # the paper between the two strokes
    assert strip[:, gap - 2 : gap + 3].min() >= 250, "paper is white"
    assert strip[12:20, 6 : gap - 20].max() < 40, "ink is black"


def test_gray_stored_as_colour_gives_the_strip_its_gray_gives():
    """A gray picture saved as RGB (most renders) is read from one channel: the same
    strip as the gray picture itself, on even paper, on a card and in uneven light."""
    pictures = [ink_box(mode="L"), _formula_like()]
    card = Image.new("L", (220, 120), 90)
    card.paste(ImageOps.expand(_formula_like(), border=6, fill=250), (12, 20))
    lit = np.asarray(_formula_like().resize((368, 128)), dtype=np.float32)
    lit = lit * np.linspace(0.55, 1.0, lit.shape[1])[None, :]
    pictures += [card, Image.fromarray(lit.astype(np.uint8), "L")]
    for gray in pictures:
        assert np.array_equal(prepare_strip(gray.convert("RGB"), SPEC), prepare_strip(gray, SPEC))


def test_one_differing_pixel_keeps_a_picture_in_colour():
    from models.formula.preprocess import _one_channel

    rgb = _formula_like().convert("RGB")
    assert np.array_equal(np.asarray(_one_channel(rgb)), np.asarray(_formula_like()))
    for channel in (1, 2):
        pixels = np.array(rgb)
        pixels[5, 7, channel] ^= 1  # one pixel, one channel, one level
        assert _one_channel(Image.fromarray(pixels)) is None


def _mostly_white(rng, shape, white: float) -> np.ndarray:
    """Random 8-bit values, about this share of them 255 (white paper)."""
    values = rng.integers(0, 256, shape, dtype=np.uint8)
    values[rng.random(shape) < white] = 255
    return values


@pytest.mark.parametrize("white", [0.0, 0.45, 0.5, 0.55, 0.99, 1.0])
def test_median_of_8_bit_pixels_is_numpys_rounded_median(white):
    rng = np.random.default_rng(3)
    for count in [1, 2, 3, 4, 7, 100, 1001]:
        for _ in range(20):
            values = _mostly_white(rng, (count, 3), white)
            expected = np.median(values, axis=0).round().astype(np.uint8)
            assert np.array_equal(_median_u8(values), expected)


@pytest.mark.parametrize("white", [0.0, 0.005, 0.01, 0.02, 0.45, 0.5, 0.55, 1.0])
def test_a_quantile_of_mostly_white_values_is_its_histograms(white):
    rng = np.random.default_rng(4)
    for count in [1, 2, 3, 4, 7, 100, 199, 200, 201, 1001]:
        for _ in range(20):
            values = _mostly_white(rng, count, white)
            cumulative = np.cumsum(np.bincount(values, minlength=256))
            for q in (0.5, 0.99):
                expected = int(np.searchsorted(cumulative, q * cumulative[-1]))
                assert _quantile_u8(values, q) == expected, (count, q)


def _formula_like() -> Image.Image:
    """Strokes, a fraction bar and a tall bar, dark on white, 12 px from the edges."""
    from PIL import ImageDraw

    image = Image.new("L", (184, 64), 255)
    draw = ImageDraw.Draw(image)
    draw.rectangle((12, 12, 30, 28), outline=0, width=2)
    draw.line((40, 32, 110, 32), fill=0, width=2)  # a fraction bar
    draw.rectangle((60, 38, 90, 51), outline=0, width=2)
    draw.line((160, 12, 160, 51), fill=0, width=2)  # a bar as tall as the ink
    draw.rectangle((120, 20, 150, 40), outline=0, width=2)
    return image


def test_a_frame_around_the_formula_is_taken_off():
    from PIL import ImageDraw

    plain = _formula_like()
    framed = plain.copy()
    ImageDraw.Draw(framed).rectangle((0, 0, 183, 63), outline=100)
    boxed_twice = ImageOps.expand(framed, 8, fill=255)
    ImageDraw.Draw(boxed_twice).rectangle((0, 0, 199, 79), outline=0, width=2)
    expected = prepare_strip(plain, SPEC)
    np.testing.assert_array_equal(prepare_strip(framed, SPEC), expected)
    np.testing.assert_array_equal(prepare_strip(boxed_twice, SPEC), expected)


@pytest.mark.parametrize("sides", ["three sides", "touching the ink"])
def test_lines_that_are_not_a_frame_are_kept(sides):
    from PIL import ImageDraw

    image = ImageOps.expand(_formula_like(), 4, fill=255)
    draw = ImageDraw.Draw(image)
    if sides == "three sides":  # an overline, an underline and one bar: the formula's own
        draw.line((0, 0, 191, 0), fill=0)
        draw.line((0, 71, 191, 71), fill=0)
        draw.line((0, 0, 0, 71), fill=0)
    else:  # four sides, but ink runs into one of them
        draw.rectangle((0, 0, 191, 71), outline=0)
        draw.line((150, 36, 191, 36), fill=0, width=2)
    assert inside_frame(image) is None
    # Kept, the lines make the trimmed picture taller, so its strip narrower.
    assert prepare_strip(image, SPEC).shape[1] < prepare_strip(_formula_like(), SPEC).shape[1]


@pytest.mark.parametrize("page", [(136, 136, 136), (30, 32, 40)], ids=["grey", "dark"])
def test_a_formula_on_a_card_is_read_on_the_card(page):
    from PIL import ImageDraw

    plain = _formula_like()
    shape = Image.new("L", plain.size, 0)
    ImageDraw.Draw(shape).rounded_rectangle((0, 0, plain.width - 1, plain.height - 1), 10, 255)
    on_page = Image.new("RGB", (plain.width + 60, plain.height + 60), page)
    on_page.paste(plain.convert("RGB"), (30, 30), shape)
    np.testing.assert_array_equal(prepare_strip(on_page, SPEC), prepare_strip(plain, SPEC))


def test_sparse_ink_or_a_solid_shape_is_no_card():
    pixels = np.asarray(_formula_like())[..., None]
    assert on_its_card(pixels) is None
    square = np.full((60, 60, 1), 255, dtype=np.uint8)
    square[10:50, 10:50] = 0  # a lone solid shape: read as ink, not as a black card
    assert on_its_card(square) is None
    assert prepare_strip(Image.fromarray(square[..., 0]), SPEC).min() == 0


@pytest.mark.parametrize(
    "variant",
    [
        "dark mode (inverted)",
        "dark mode, grey on charcoal",
        "low contrast",
        "wide margins",
        "in a box",
        "white ink, transparent",
        "on a card, grey page",
        "on a card, dark page",
    ],
)
def test_an_evaluation_variant_reaches_the_model_as_the_clean_picture(variant):
    # `make eval-formula`'s pictures (not run in CI): these must not change the model's input.
    from training.formula.evaluate import VARIANTS

    clean = _formula_like().convert("RGB")
    upload = decode_image(VARIANTS[variant](clean), max_pixels=10**7)
    np.testing.assert_array_equal(prepare_strip(upload, SPEC), prepare_strip(clean, SPEC))


def _lit_unevenly(image: Image.Image) -> Image.Image:
    """The paper from white on the left to 45% grey on the right; the ink stays black."""
    gray = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
    light = np.linspace(255.0, 115.0, image.width)[None, :]
    return Image.fromarray((gray * light).astype(np.uint8))


def test_uneven_paper_is_measured_from_the_paper_nearby():
    plain = _formula_like()
    expected = prepare_strip(plain, SPEC) < 128
    got = prepare_strip(_lit_unevenly(plain), SPEC) < 128
    assert got.shape == expected.shape, "the dark side of the paper is not ink"
    assert (got == expected).mean() > 0.97


def test_a_tall_photo_is_measured_in_bands_as_in_one_piece(monkeypatch):
    from models.formula import preprocess

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (700, 90, 3), dtype=np.uint8)
    local = rng.integers(0, 256, (5, 3, 3), dtype=np.uint8)
    banded = preprocess.distance_from_paper_around(pixels, local)
    monkeypatch.setattr(preprocess, "PAPER_BAND", 10_000)
    np.testing.assert_array_equal(banded, preprocess.distance_from_paper_around(pixels, local))


def test_even_paper_is_left_as_it_is():
    for paper in (255, 200, 30):  # white, tinted, dark mode
        image = ImageOps.expand(_formula_like(), 20, fill=255)
        if paper != 255:
            image = Image.eval(image, lambda v, p=paper: p if v == 255 else 255 - p)
        pixels = np.asarray(image)
        distance = np.abs(pixels.astype(np.int16) - paper).astype(np.uint8)
        assert local_paper(pixels[..., None], distance) is None, paper


def test_uneven_paper_is_found_where_a_low_quantile_of_a_block_is_far():
    from models.formula.preprocess import PAPER_QUANTILE, UNEVEN_PAPER, _blocks

    rng = np.random.default_rng(5)
    outcomes = set()
    for near in (0.0, 0.08, 0.1, 0.12, 0.15, 1.0):  # the share of pixels near the median
        for _ in range(20):
            distance = rng.integers(UNEVEN_PAPER, 2 * UNEVEN_PAPER, (40, 70), dtype=np.uint8)
            close = rng.random(distance.shape) < near
            distance[close] = rng.integers(0, UNEVEN_PAPER, close.sum())
            tiles = _blocks(distance)
            low = int(PAPER_QUANTILE * (tiles.shape[2] - 1))
            even = np.partition(tiles, low, axis=2)[:, :, low].max() < UNEVEN_PAPER
            pixels = np.full((*distance.shape, 1), 255, dtype=np.uint8)
            assert (local_paper(pixels, distance) is None) == even, near
            outcomes.add(bool(even))
    assert outcomes == {False, True}


def test_a_picture_smaller_than_a_block_of_paper_is_read():
    image = _lit_unevenly(_formula_like()).resize((92, 12))
    assert prepare_strip(image, SPEC).shape[1] > 0


# -- scale ------------------------------------------------------------------------------


def _glyphs(scale: int) -> Image.Image:
    """Three box-and-bar glyphs with strokes `2 * scale` px thick, drawn `scale` times
    the size of the 1x drawing."""
    from PIL import ImageDraw

    image = Image.new("L", (90 * scale, 30 * scale), 255)
    draw = ImageDraw.Draw(image)
    for i in range(3):
        x = (10 + 25 * i) * scale
        draw.rectangle((x, 9 * scale, x + 12 * scale, 21 * scale), outline=0, width=2 * scale)
        draw.line((x, 15 * scale, x + 12 * scale, 15 * scale), fill=0, width=2 * scale)
    return image


def scaled_spec() -> FormulaImageSpec:
    """A model trained on `_glyphs(1)`'s scale: 2 px strokes, 13 px glyphs, upscaled at most
    twice."""
    return FormulaImageSpec(
        height=64, max_width=512, max_upscale=2.0, stroke_width=2.0, glyph_height=13.0
    )


def ink_height(strip: np.ndarray) -> int:
    return int(np.count_nonzero((strip < 128).any(axis=1)))


def test_a_hidpi_picture_is_brought_to_the_training_scale_not_blown_up():
    native = ink_height(prepare_strip(_glyphs(1), scaled_spec()))
    for scale in (2, 3):
        assert abs(ink_height(prepare_strip(_glyphs(scale), scaled_spec())) - native) <= 2


def test_a_picture_at_the_training_scale_keeps_the_usual_upscale():
    strip = prepare_strip(_glyphs(1), scaled_spec())
    assert ink_height(strip) == pytest.approx(2.0 * 13, abs=2)


def test_stroke_width_measures_strokes_in_pixels():
    from models.formula.preprocess import stroke_width

    for scale in (1, 2, 3):
        assert stroke_width(_glyphs(scale)) == pytest.approx(2.0 * scale, rel=0.2)


def _mathtext(source: str, font: str, em_px: int) -> Image.Image:
    """`source` drawn by matplotlib's mathtext in math font `font` with an em of `em_px`,
    dark on white with a margin: a light font (cm) or a heavy one (dejavusans)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.font_manager import FontProperties
    from matplotlib.mathtext import MathTextParser

    prop = FontProperties(size=10, math_fontfamily=font)
    raster = MathTextParser("agg").parse(f"${source}$", dpi=em_px * 7.2, prop=prop)
    ink = Image.fromarray(255 - np.asarray(raster.image))
    picture = Image.new("L", (ink.width + 16, ink.height + 16), 255)
    picture.paste(ink, (8, 8))
    return picture


FORMULAS = (r"f(x)=a \ln x+\frac{1}{2} x^{2}", r"\frac{x+1}{x-1}>2 y", r"a_{n+1}=2 a_{n}+1")
# Drawn large enough, a radical's vinculum touches its contents, which then count as one glyph.
RADICAL = r"y=\sqrt{x^{2}+1}-3 x"


@pytest.mark.parametrize("font", ["cm", "dejavusans"])
def test_glyph_height_follows_the_font_size_whatever_the_stroke_weight(font):
    from models.formula.preprocess import glyph_height

    for source in FORMULAS:
        per_em = [glyph_height(_mathtext(source, font, em)) / em for em in (15, 20, 30)]
        assert max(per_em) / min(per_em) < 1.15, (source, per_em)


def test_the_glyph_height_is_numpys_median_of_the_glyph_heights():
    from PIL import ImageDraw

    from models.formula.preprocess import glyph_height, glyph_heights, stroke_width

    counts = set()
    for glyphs in range(3, 9):  # odd and even counts; heights 10, 13, 16, ... px
        image = Image.new("L", (20 * glyphs + 20, 60), 255)
        draw = ImageDraw.Draw(image)
        for i in range(glyphs):
            x = 10 + 20 * i
            draw.rectangle((x, 5, x + 10, 5 + 10 + 3 * i), outline=0, width=2)
        heights = glyph_heights(image, stroke_width(image))
        counts.add(heights.size % 2)
        assert glyph_height(image) == float(np.median(heights)), glyphs
    assert counts == {0, 1}, "both an odd and an even number of glyphs"


def test_a_light_font_drawn_twice_as_large_reaches_the_model_at_the_same_scale():
    from models.formula.preprocess import glyph_height, stroke_width, trim_margins

    spec = FormulaImageSpec.from_pretrained("models/formula/default")
    source = RADICAL
    small, large = _mathtext(source, "cm", 15), _mathtext(source, "cm", 30)
    # Its strokes alone say the large one is drawn at nearly the training scale.
    assert stroke_width(trim_margins(large, 2)) < spec.stroke_width / 0.8
    heights = [glyph_height(Image.fromarray(prepare_strip(p, spec))) for p in (small, large)]
    assert heights[1] == pytest.approx(heights[0], rel=0.15)


def test_a_picture_at_the_training_scale_with_tall_parts_keeps_the_usual_upscale():
    from models.formula.preprocess import native_upscale, trim_margins

    spec = FormulaImageSpec.from_pretrained("models/formula/default")
    for source in (r"\left(\frac{a+b}{c_{1}}\right)^{2}=\sum_{i} x_{i}", r"\sum"):
        picture = trim_margins(_mathtext(source, "cm", 15), 2)
        assert native_upscale(picture, spec) == spec.max_upscale, source


def test_specks_of_noise_do_not_change_the_glyph_height():
    from models.formula.preprocess import glyph_height

    clean = _mathtext(FORMULAS[0], "cm", 30)
    pixels = np.array(clean)
    rng = np.random.default_rng(0)
    ys, xs = rng.integers(0, pixels.shape[0], 60), rng.integers(0, pixels.shape[1], 60)
    pixels[ys, xs] = 0
    assert glyph_height(Image.fromarray(pixels)) == pytest.approx(glyph_height(clean), rel=0.15)


# -- rotation ---------------------------------------------------------------------------


def test_a_picture_tilted_by_two_degrees_is_levelled():
    level = _glyphs(2)
    tilted = level.rotate(2, Image.Resampling.BICUBIC, expand=True, fillcolor=255)
    spec = FormulaImageSpec(height=64, max_width=512, max_upscale=1.0, stroke_width=None)
    assert (
        abs(ink_height(prepare_strip(tilted, spec)) - ink_height(prepare_strip(level, spec))) <= 2
    )


def test_a_level_picture_is_not_turned():
    from models.formula.preprocess import skew_angle

    assert skew_angle(_glyphs(2), 3.0) == 0.0


def test_an_xy_cut_finds_each_slice_and_each_piece_stacked_in_it():
    ink = np.zeros((12, 16), dtype=bool)
    ink[1:4, 2:5] = True  # a slice of columns 2-4 holding two pieces, one above the other
    ink[7:11, 3:5] = True
    ink[0:12, 9:10] = True  # a full-height bar alone in its slice
    ink[5:6, 12:16] = True  # a flat piece touching the right edge
    tops, bottoms, lefts, rights = _pieces(ink)
    assert list(zip(tops, bottoms, lefts, rights, strict=True)) == [
        (1, 4, 2, 5), (7, 11, 2, 5), (0, 12, 9, 10), (5, 6, 12, 16)
    ]  # fmt: skip
    assert all(len(part) == 0 for part in _pieces(np.zeros((4, 4), dtype=bool)))


def test_a_pngs_pixels_are_read_from_its_header_and_nothing_else_claims_any() -> None:
    from models.formula.preprocess import png_pixels
    from tests.conftest import formula_png

    png = formula_png(size=(321, 47))
    assert png_pixels(png) == 321 * 47
    assert png_pixels(png[:23]) is None  # too short to hold the size
    assert png_pixels(formula_png(size=(321, 47), fmt="JPEG")) is None
    assert png_pixels(formula_png(size=(321, 47), fmt="WEBP")) is None
    assert png_pixels(b"\x89PNG\r\n\x1a\n" + b"\x00" * 16) is None  # no IHDR first


def test_a_picture_too_large_even_for_pillow_to_open_names_the_servers_limit() -> None:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0)  # 10^10 grey pixels
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
    with pytest.raises(ImageTooLarge, match="limit of 16000000"):
        decode_image(png, max_pixels=16_000_000)


@pytest.mark.parametrize(
    "start",
    [
        b"\x89PNG\r\n\x1a\n",
        b"\xff\xd8\xff\xe0",
        b"GIF89a",
        b"RIFF\x00\x00\x00\x00WEBP",
        b"BM",
    ],
    ids=["PNG", "JPEG", "GIF", "WebP", "BMP"],
)
def test_data_that_begins_as_an_accepted_format_but_is_not_one_is_corrupt(start) -> None:
    with pytest.raises(CorruptImage, match="begins as a"):
        decode_image(start + b"\x00" * 4096, max_pixels=10**6)
    with pytest.raises(UnsupportedImage):  # no signature at all
        decode_image(b"\x00" * 4096, max_pixels=10**6)


def test_a_bmp_cut_short_in_its_header_is_corrupt_not_unsupported() -> None:
    bmp = encode(ink_box(), "BMP")
    with pytest.raises(CorruptImage, match="begins as a BMP"):
        decode_image(bmp[:30], max_pixels=10**6)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data and checksum."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def with_chunk_before_image_data(png: bytes, chunk: bytes) -> bytes:
    """The PNG with `chunk` inserted just before its first IDAT chunk."""
    at = png.index(b"IDAT") - 4
    return png[:at] + chunk + png[at:]


def with_jpeg_segment(jpeg: bytes, segment: bytes) -> bytes:
    """The JPEG with an APP1 segment holding `segment` inserted before its first
    quantization table, after the JFIF header that Pillow writes."""
    at = jpeg.index(b"\xff\xdb")
    return jpeg[:at] + b"\xff\xe1" + struct.pack(">H", len(segment) + 2) + segment + jpeg[at:]


def saved(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


GARBAGE_EXIF = b"Exif\x00\x00garbage!garbage"


@pytest.mark.parametrize(
    ("fmt", "damaged"),
    [
        ("PNG", lambda image: saved(image, "PNG", exif=GARBAGE_EXIF)),
        ("WEBP", lambda image: saved(image, "WEBP", exif=GARBAGE_EXIF)),
        (
            "PNG",
            lambda image: with_chunk_before_image_data(
                saved(image, "PNG"), png_chunk(b"eXIf", b"MM\x00")
            ),
        ),
        (
            "PNG",
            lambda image: with_chunk_before_image_data(
                saved(image, "PNG"),
                png_chunk(b"tEXt", b"Raw profile type exif\x00\nexif\n   10\nzzzz\n"),
            ),
        ),
        ("JPEG", lambda image: with_jpeg_segment(saved(image, "JPEG", dpi=(72, 72)), GARBAGE_EXIF)),
    ],
    ids=["PNG exif", "WebP exif", "PNG eXIf cut short", "PNG text profile not hex", "JPEG"],
)
def test_a_picture_whose_exif_cannot_be_read_is_read_as_stored(fmt, damaged) -> None:
    preprocess = FormulaPreprocessor(SPEC, bucket_step=32, max_pixels=10**6)
    image = ink_box(mode="L")
    read = preprocess(damaged(image))
    assert read.width > 0
    assert np.array_equal(read.strip, preprocess(saved(image, fmt)).strip)


def palette_png(transparency: bytes) -> bytes:
    """A black box on white as a two-colour palette PNG, with a tRNS chunk of
    `transparency` (one alpha value per palette index)."""
    image = ink_box(mode="L").convert("P")
    image.putpalette([255, 255, 255, 0, 0, 0])
    image.putdata([1 if value < 128 else 0 for value in ink_box(mode="L").getdata()])
    return with_chunk_before_image_data(saved(image, "PNG"), png_chunk(b"tRNS", transparency))


def test_a_palette_png_with_more_alpha_values_than_a_palette_holds_is_read() -> None:
    preprocess = FormulaPreprocessor(SPEC, bucket_step=32, max_pixels=10**6)
    opaque = preprocess(palette_png(b"\xff\xff"))
    long_table = preprocess(palette_png(b"\xff\xff" + b"\x00" * 298))  # 300 values
    assert opaque.width > 0
    assert np.array_equal(long_table.strip, opaque.strip)


def test_a_decoded_upload_that_pillow_refuses_to_convert_is_corrupt() -> None:
    """The tRNS chunk names palette index 300 transparent (all others opaque): the file
    decodes, and Pillow refuses the index when it converts the picture."""
    preprocess = FormulaPreprocessor(SPEC, bucket_step=32, max_pixels=10**6)
    with pytest.raises(CorruptImage, match="palette index out of range"):
        preprocess(palette_png(b"\xff" * 300 + b"\x00"))


def test_only_errors_raised_inside_pillow_are_taken_for_the_uploads() -> None:
    from models.formula.preprocess import _raised_by_pillow

    def raised(action) -> Exception:
        try:
            action()
        except Exception as exc:
            return exc
        raise AssertionError("nothing was raised")

    assert _raised_by_pillow(raised(lambda: Image.new("L", (4, 4)).convert("no such mode")))
    assert not _raised_by_pillow(raised(lambda: np.zeros((2, 2))[:, 5]))
    assert not _raised_by_pillow(raised(lambda: 1 / 0))


def test_a_small_png_padded_past_the_byte_bound_is_not_preprocessed_on_the_event_loop() -> None:
    """Pillow reads every chunk of a PNG, so the pixels its header announces do not bound
    its cost: hundreds of thousands of empty chunks after a small picture take seconds."""
    import torch

    from models.formula.adapter import QUICK_BYTES, FormulaRecognizer
    from tests.conftest import formula_png

    recognizer = FormulaRecognizer("unused", [torch.device("cpu")])
    small = formula_png()
    empty = png_chunk(b"abCd", b"")  # ancillary, private, safe to copy: skipped by readers
    padded = with_chunk_before_image_data(small, empty * (QUICK_BYTES // len(empty) + 1))
    assert recognizer.quick_request(small)
    assert not recognizer.quick_request(padded)
