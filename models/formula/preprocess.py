"""Formula image preprocessing shared by the server, training and evaluation.

A formula picture becomes a grayscale strip of fixed height and variable width:
decode (honouring EXIF orientation), reduce whatever colours it has to dark ink on
white paper with full contrast (uneven paper measured from the paper nearby), take off
a frame drawn around it, trim the margins, level a small tilt, scale it so that its
strokes are as thick (or, for a light font drawn large, its glyphs as tall) as in the
images the model was trained on and it fits the model's height, then pad on the right
to the bucket width. A picture with no ink becomes an empty strip, which the model does
not read. Training and `make eval-formula` call the same functions, so the model sees
exactly what the server feeds it.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageOps

from models.errors import CorruptImage, ImageTooLarge, UnsupportedImage

log = logging.getLogger(__name__)

# MPO is the JPEG of phone cameras that store more than one picture (Pillow names it
# apart): its first picture is a JPEG.
ACCEPTED_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "BMP", "GIF"})
EXIF_ORIENTATION = 0x0112
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# How files of the accepted formats begin. BMP's two letters are a weak sign, but the
# upload is refused either way: as a damaged BMP, not as a format Texel does not take.
SIGNATURES = {
    PNG_SIGNATURE: "PNG",
    b"\xff\xd8\xff": "JPEG",
    b"GIF87a": "GIF",
    b"GIF89a": "GIF",
    b"BM": "BMP",
}
# A palette holds at most this many colours, and so at most this many alpha values.
PALETTE_SIZE = 256

# Pixels darker than this count as ink when trimming margins (0 = black, 255 = white).
INK_THRESHOLD = 200
# Differences from the paper colour up to this are noise (JPEG, scanner, gradients), not ink.
INK_MIN_CONTRAST = 32
# Ink this far from the paper is left as it is; fainter ink is stretched to black.
FULL_CONTRAST = 192
# A picture needs at least this many pixels each way to hold something legible.
MIN_SIDE = 4
# Statistics of the whole picture (its paper colour, whether it sits on a card) are taken
# on a regular sample of about this many pixels.
SAMPLE_PIXELS = 16384
# Median stroke width, in pixels, of the im2latex images (im2markup's 200 dpi renders
# downsampled by 2) that the default model was trained on: `stroke_width` measures it.
IM2LATEX_STROKE_WIDTH = 1.17
# Uneven paper (a photo's lighting, a gradient behind the formula): in some block of the
# picture (`local_paper`) this share of the pixels or more lie this far from the median
# colour or further.
PAPER_QUANTILE = 0.1
UNEVEN_PAPER = INK_MIN_CONTRAST // 2
PAPER_BAND = 256  # rows measured from it at a time
# A frame around the formula (a screenshot of a bordered box): thin lines at all four
# edges of the ink, each along at least this share of its side, at most this share of
# the other side thick, and clear of the ink inside.
FRAME_COVER = 0.75
FRAME_THICKNESS = 0.1
# A card (a light formula panel on a dark or grey page): at least this share of the
# rectangle that holds everything off the page colour is off it, and at most the
# complementary share of the picture's outermost pixels is.
CARD_FILL = 0.9
# Deskew tries tilts this many degrees apart, and turns a picture only when the best one
# levels its rows this much better than no turn: clean renders, which a smaller gain
# turns now and then, stay as they are.
SKEW_STEP = 0.5
SKEW_HEIGHT = 48  # px: taller pictures are searched at a reduced size
SKEW_GAIN = 1.2
# Strokes up to 1 / this times the training images' keep the usual scale: their own
# spread of stroke widths (bold, large operators, thin fonts).
SCALE_TOLERANCE = 0.8
# Median height, in pixels, of the glyphs of those images (`glyph_height`, over 1,500
# train images; 5th to 95th percentile 6-12 px, from what each formula is made of).
IM2LATEX_GLYPH_HEIGHT = 9.0
# A picture is brought down to the training images' glyph height when its glyphs are
# taller and its strokes thicker by this much together (the product of the two ratios):
# glyph heights spread widely with what a formula is made of, so a clean picture with
# tall parts (delimiters, stacked scripts: 1 in 150 over 1.54x) must not count as large,
# but a light font drawn twice as large, with strokes only a little thicker, does.
# Strokes thicker than 1 / this alone say how large a picture is (a HiDPI screenshot).
GLYPH_TOLERANCE = 0.6
# Pieces taller than this many stroke widths are glyphs; flatter ones are fraction bars,
# minus signs, dots and noise, which say nothing of the font size.
GLYPH_MIN_STROKES = 1.5
# With fewer glyphs than this (a lone symbol, which may be a tall operator) the glyph
# height is not estimated; the stroke width alone sets the scale.
GLYPH_MIN_COUNT = 3
# Pieces more than this many times wider than tall are cut again, up to this depth.
GLYPH_WIDE = 2.0
GLYPH_CUTS = 3


@dataclass(frozen=True)
class FormulaImageSpec:
    """How a model wants its formula images.

    `height` is the fixed input height, `max_width` the widest input the encoder
    accepts, `width_multiple` the granularity every padded width must respect
    (the patch size times the encoder's total downsampling). `max_upscale`
    limits how much a small formula is enlarged; the rest is vertical padding.
    `mean` and `std` normalize the pixels (0 to 1): one value for every channel, or
    one per channel (an RGB model's ImageNet statistics).
    """

    height: int = 64
    max_width: int = 1024
    width_multiple: int = 32
    channels: int = 1
    mean: float | tuple[float, ...] = 0.5
    std: float | tuple[float, ...] = 0.5
    margin: int = 2
    max_upscale: float | None = None
    # The median stroke width (px) of the model's training images at their native scale:
    # pictures drawn finer or coarser are resampled to it, within `max_upscale`'s role
    # (so only where `max_upscale` is set). None leaves the scale to the height alone.
    stroke_width: float | None = IM2LATEX_STROKE_WIDTH
    # The median glyph height (px, `glyph_height`) of the same images: pictures whose
    # glyphs are clearly taller are brought down to it whatever their stroke weight (a
    # light font at a large size). None leaves the scale to the stroke width.
    glyph_height: float | None = IM2LATEX_GLYPH_HEIGHT
    # Pictures tilted by up to this many degrees are turned level (0: never).
    max_skew: float = 3.0
    # Encoders with fixed position embeddings (ViT, DeiT: TrOCR-style models) take
    # one size only; the strip is then stretched to height x max_width.
    fixed_size: bool = False

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        channels: int = 1,
        fixed_size: bool = False,
        image_size: int | list[int] | tuple[int, int] | None = None,
    ) -> FormulaImageSpec:
        """Read the image processor's settings saved beside a formula model
        (`image_processor_config`).

        `image_size` is a fixed-size encoder's input size (its config's `image_size`, one
        side or height and width). It wins over the size the processor names: it is what
        the weights were trained with, and the only size the encoder takes.
        """
        raw = image_processor_config(model_dir)
        height, width = _processor_size(raw)
        if fixed_size and image_size is not None:
            sides = [image_size] * 2 if isinstance(image_size, int) else list(image_size)
            encoder = (int(sides[0]), int(sides[1]))
            named = (height or encoder[0], width or encoder[1])
            if named != encoder:
                log.warning(
                    "the image processor of %s names an input size of %dx%d, its encoder's "
                    "config %dx%d; using the encoder's, which its weights were trained with",
                    model_dir,
                    *named,
                    *encoder,
                )
            height, width = encoder
        normalize = bool(raw.get("do_normalize", True))
        return cls(
            height=height or cls.height,
            max_width=width or cls.max_width,
            width_multiple=int(raw.get("texel_width_multiple", cls.width_multiple)),
            channels=channels,
            # Without normalization a model reads the rescaled pixels as they are.
            mean=_per_channel(raw.get("image_mean", 0.5), channels) if normalize else 0.0,
            std=_per_channel(raw.get("image_std", 0.5), channels) if normalize else 1.0,
            margin=int(raw.get("texel_margin", cls.margin)),
            max_upscale=raw.get("texel_max_upscale"),
            stroke_width=raw.get("texel_stroke_width", cls.stroke_width),
            glyph_height=raw.get("texel_glyph_height", cls.glyph_height),
            max_skew=float(raw.get("texel_max_skew", cls.max_skew)),
            fixed_size=fixed_size,
        )

    def to_preprocessor_config(self) -> dict:
        """The `preprocessor_config.json` content that `from_pretrained` reads back."""
        return {
            "image_processor_type": "ViTImageProcessor",
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "size": {"height": self.height, "width": self.max_width},
            "image_mean": list(self.channel_values(self.mean)),
            "image_std": list(self.channel_values(self.std)),
            "texel_width_multiple": self.width_multiple,
            "texel_margin": self.margin,
            "texel_max_upscale": self.max_upscale,
            "texel_stroke_width": self.stroke_width,
            "texel_glyph_height": self.glyph_height,
            "texel_max_skew": self.max_skew,
        }

    def channel_values(self, value: float | tuple[float, ...]) -> tuple[float, ...]:
        """`mean` or `std` as one value per channel."""
        return value if isinstance(value, tuple) else (value,) * self.channels

    @property
    def uniform(self) -> bool:
        """Whether every channel is normalized alike (one gray strip, repeated)."""
        return not isinstance(self.mean, tuple) and not isinstance(self.std, tuple)


def image_processor_config(model_dir: str | Path) -> dict:
    """The image processor's settings in a model folder, where transformers looks for them:
    the "image_processor" section of `processor_config.json` (what a processor's
    `save_pretrained` writes in transformers 5, such as TrOCRProcessor's), else
    `preprocessor_config.json` (an image processor saved alone, and older processors)."""
    folder = Path(model_dir)
    processor = folder / "processor_config.json"
    if processor.is_file():
        nested = json.loads(processor.read_text()).get("image_processor")
        if isinstance(nested, dict):
            return nested
    image_processor = folder / "preprocessor_config.json"
    if image_processor.is_file():
        return json.loads(image_processor.read_text())
    raise FileNotFoundError(
        f"{model_dir} has no preprocessor_config.json, nor a processor_config.json with an "
        '"image_processor" section: the image processor\'s settings (save it with '
        "save_pretrained beside the model)"
    )


def _processor_size(raw: dict) -> tuple[int | None, int | None]:
    """The input height and width an image processor's settings name (None: not named):
    its crop where it crops the centre, else its size, as height and width, one square
    side, or a shortest edge (the height of a formula, which is wider than tall) and an
    optional longest edge."""
    size = raw.get("crop_size") if raw.get("do_center_crop") else None
    size = size if size is not None else raw.get("size")
    if isinstance(size, int):  # older processors store one square size
        return size, size
    if not isinstance(size, dict):
        return None, None
    if "height" in size or "width" in size:
        return _side(size.get("height")), _side(size.get("width"))
    return _side(size.get("shortest_edge")), _side(size.get("longest_edge"))


def _side(value) -> int | None:
    return None if value is None else int(value)


def _per_channel(value, channels: int) -> float | tuple[float, ...]:
    """An image processor's `image_mean` or `image_std` for a model of `channels`
    channels: one float where every channel has the same value, else one per channel."""
    values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]
    if len(set(values)) == 1:
        return values[0]
    if channels == 1:  # per-colour statistics for a gray model: its one channel's
        return values[0]
    if len(values) != channels:
        raise ValueError(
            f"the image processor has {len(values)} normalization values ({values}) for an "
            f"encoder of {channels} channels"
        )
    return tuple(values)


def png_pixels(data: bytes) -> int | None:
    """Width times height from a PNG's header (its first chunk, IHDR), without opening
    it; None for anything else or a header too short to say."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big") * int.from_bytes(data[20:24], "big")


def _claimed_format(data: bytes) -> str | None:
    """The accepted format whose signature the data begins with, if any."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return next((name for sig, name in SIGNATURES.items() if data.startswith(sig)), None)


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """Decode uploaded bytes into an RGB-or-gray PIL image, refusing bombs before decoding.

    Raises `UnsupportedImage` for unknown formats, `ImageTooLarge` when the header
    announces more than `max_pixels` pixels, and `CorruptImage` when the data of a
    known format cannot be decoded.
    """
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # more pixels than even Pillow opens
        raise ImageTooLarge(f"image has more pixels than the limit of {max_pixels}") from exc
    except Exception as exc:  # PIL raises several types for unidentifiable data
        claimed = _claimed_format(data)
        if claimed is not None:
            raise CorruptImage(
                f"the upload begins as a {claimed} file but cannot be read as one"
            ) from exc
        raise UnsupportedImage(
            "the upload is not a supported image (PNG, JPEG, WebP, BMP or GIF)"
        ) from exc
    if image.format not in ACCEPTED_FORMATS:
        raise UnsupportedImage(
            f"image format {image.format} is not supported; send PNG, JPEG, WebP, BMP or GIF"
        )
    width, height = image.size
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}"
        )
    if width < 1 or height < 1:
        raise CorruptImage("image has no pixels")
    try:
        image.seek(0)  # GIF and animated WebP: first frame only
        image.load()
    except Exception as exc:
        raise CorruptImage(f"the {image.format} data could not be decoded: {exc}") from exc
    transparency = image.info.get("transparency")
    if image.mode == "P" and isinstance(transparency, bytes):
        # A PNG's tRNS chunk may list more alpha values than a palette has colours; Pillow
        # refuses such a table when it converts the picture. The extra ones name no colour.
        image.info["transparency"] = transparency[:PALETTE_SIZE]
    if _orientation(image) != 1:  # phone photos are stored sideways
        try:
            image = ImageOps.exif_transpose(image)
        except Exception as exc:
            raise CorruptImage(f"the image's EXIF orientation could not be applied: {exc}") from exc
    return image


def _orientation(image: Image.Image) -> object:
    """The EXIF orientation tag of a decoded picture: 1 (as stored) where it has none, or
    where its EXIF cannot be read. The pixels have decoded by then, so damaged metadata
    beside them (not a TIFF structure, cut short, a PNG text profile that is not hex) is
    no reason to refuse the picture; Pillow raises several types for it."""
    try:
        return image.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:
        return 1


def _raised_by_pillow(exc: Exception) -> bool:
    """Whether `exc` was raised inside Pillow (its innermost frame is Pillow's, which is
    where Pillow's C code raises too), not in Texel's own arithmetic or NumPy's."""
    frame = exc.__traceback__
    if frame is None:
        return False
    while frame.tb_next is not None:
        frame = frame.tb_next
    module = frame.tb_frame.f_globals.get("__name__", "")
    return module == "PIL" or module.startswith("PIL.")


def _flat_pixels(image: Image.Image) -> np.ndarray:
    """8-bit pixels, gray [H, W] or RGB [H, W, 3]: transparency flattened onto white (onto
    black under light ink), 16-bit or float gray scaled to 8 bits (PIL's own conversion
    clips it to white)."""
    if image.mode.startswith("I") or image.mode == "F":
        values = np.asarray(image, dtype=np.float32)
        if image.mode.startswith("I;16"):
            full = 65535.0
        else:  # 32-bit modes: 16-bit PNGs on some Pillow versions, or 0-1 floats
            peak = float(values.max(initial=0))
            full = 65535.0 if peak > 255 else 1.0 if image.mode == "F" and peak <= 1 else 255.0
        return np.clip(np.rint(values * (255.0 / full)), 0, 255).astype(np.uint8)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        if int(np.asarray(image.convert("L")).min()) > 127:
            # Even the darkest ink is light (a formula exported in white for a dark page):
            # it stands out from black more, as dark mode, which `ink_on_paper` turns.
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (0, 0, 0, 255)), rgba)
    if image.mode in ("L", "RGB"):
        return np.asarray(image)
    return np.asarray(image.convert("RGB" if image.mode not in ("1", "L") else "L"))


def _one_channel(image: Image.Image) -> Image.Image | None:
    """An RGB picture's one channel where all three are the same, else None (compared by
    PIL, without copying the picture into an array)."""
    red, green, blue = image.split()
    same = ImageChops.difference(red, green).getbbox() is None
    return red if same and ImageChops.difference(red, blue).getbbox() is None else None


def _quantile_u8(values: np.ndarray, q: float) -> int:
    """The `q` quantile of 8-bit values, from their histogram (no sort). Where less than a
    `q` share of them lie below 255 (white paper, black ink on it) it is 255: no histogram."""
    values = values.ravel()
    if np.count_nonzero(values < 255) < q * values.size:
        return 255
    cumulative = np.cumsum(np.bincount(values, minlength=256))
    return int(np.searchsorted(cumulative, q * cumulative[-1]))


def _median_u8(values: np.ndarray) -> np.ndarray:
    """Per channel, the median of 8-bit pixels [N, C], rounded half to even: what
    `np.median(values, axis=0).round()` gives, from histograms (no sort). A channel too
    white for its lower middle value to lie below 255 (white paper) needs no histogram."""
    middle = [(len(values) - 1) // 2, len(values) // 2]
    out = np.empty(values.shape[1], dtype=np.uint8)
    for c in range(values.shape[1]):
        if np.count_nonzero(values[:, c] < 255) <= middle[0]:
            out[c] = 255
            continue
        cumulative = np.cumsum(np.bincount(values[:, c], minlength=256))
        low, high = np.searchsorted(cumulative, middle, side="right").tolist()
        out[c] = round((low + high) / 2)  # Python's round, as NumPy's: half to even
    return out


def ink_on_paper(image: Image.Image) -> np.ndarray | None:
    """Dark ink on white paper, 8-bit gray pixels [H, W], whatever the picture's colours;
    None when it holds no ink (blank, uniform, or too small to hold anything legible).

    The paper is the picture's median colour; a pixel's ink is its largest channel
    difference from it. So coloured ink, tinted paper and dark mode (light ink on a dark
    background) all become dark on white, and the ink's own level is stretched to black.
    Where the paper is uneven (`local_paper`), ink is measured from the paper around it.
    """
    if min(image.size) < MIN_SIDE:
        return None
    # Gray stored as colour (most renders and screenshots of black on white): every step
    # below gives the same answer from one channel as from three.
    gray = _one_channel(image) if image.mode == "RGB" else None
    if gray is not None:
        channels = np.asarray(gray)[:, :, None]
    else:
        channels = _flat_pixels(image)
        channels = channels.reshape(*channels.shape[:2], -1)
        if image.mode != "RGB" and channels.shape[2] > 1 and (channels[:, :, :1] == channels).all():
            channels = channels[:, :, :1].copy()
    card = on_its_card(channels)
    if card is not None:
        channels = card
    height, width = channels.shape[:2]
    step = _sample_step(height, width)
    sample = channels[::step, ::step]
    paper = [_quantile_u8(sample[:, :, c], 0.5) for c in range(channels.shape[2])]
    near = _distance(sample, paper)
    local = local_paper(sample, near)
    if local is None:
        distance = near if step == 1 else _distance(channels, paper)  # step 1: all of it
    else:
        distance = distance_from_paper_around(channels, local)
    strong = distance[::step, ::step]
    strong = strong[strong >= INK_MIN_CONTRAST]
    if strong.size < 64:  # sparse ink in a large picture: look at every pixel
        strong = distance[distance >= INK_MIN_CONTRAST]
    if strong.size < MIN_SIDE:
        return None
    level = max(float(_quantile_u8(strong, 0.99)), 2.0 * INK_MIN_CONTRAST)
    if level >= FULL_CONTRAST:  # ink the model knows as it is: left alone
        level = 255.0
    return np.take(_stretch(level), distance)


@functools.cache
def _stretch(level: float) -> np.ndarray:
    """The lookup table that maps each difference from the paper to its gray, `level` and
    beyond to black (made once for each of the few levels there are)."""
    lut = np.clip(np.rint(255.0 - np.arange(256) * (255.0 / level)), 0, 255).astype(np.uint8)
    lut.flags.writeable = False
    return lut


def on_its_card(channels: np.ndarray) -> np.ndarray | None:
    """The card that a picture's ink sits on, or None without one: a rectangle of another
    colour than the page around it (a formula panel in a dark or grey app, a white image
    on a coloured web page), cut out, its rounded corners filled with its own colour.
    The page must ring the picture in one colour, and what is off that colour must fill
    its bounding box (`CARD_FILL`): a formula on plain paper, whose ink is sparse, has no
    card, nor has a solid shape with nothing on it. Decided on a sample of the picture,
    so a picture without a card costs little."""
    height, width, depth = channels.shape
    if min(height, width) < 4 * MIN_SIDE:
        return None
    ring = np.concatenate(
        [channels[:2].reshape(-1, depth), channels[-2:].reshape(-1, depth)]
        + [channels[:, :2].reshape(-1, depth), channels[:, -2:].reshape(-1, depth)]
    )
    page = _median_u8(ring)
    if np.count_nonzero(_far_from(ring, page)) / len(ring) > 1 - CARD_FILL:
        return None  # no single page colour around the picture
    step = _sample_step(height, width)
    if _card_box(_far_from(channels[::step, ::step], page)) is None:
        return None
    box = _card_box(_far_from(channels, page))
    if box is None:
        return None
    card = channels[box].copy()
    colour = _median_u8(card.reshape(-1, depth))
    if _far_from(card, colour).sum() < MIN_SIDE:
        return None  # a solid shape, not a card with something on it
    corner = max(2, min(card.shape[:2]) // 8)
    for ys in (slice(0, corner), slice(-corner, None)):
        for xs in (slice(0, corner), slice(-corner, None)):
            square = card[ys, xs]
            square[~_far_from(square, page)] = colour
    return card


def _card_box(off_page: np.ndarray) -> tuple[slice, slice] | None:
    """The bounding box of what is off the page colour, where it is a filled rectangle of
    a few pixels or more each way; else None."""
    rows, cols = np.flatnonzero(off_page.any(axis=1)), np.flatnonzero(off_page.any(axis=0))
    if rows.size == 0:
        return None
    box = (slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1))
    if min(rows[-1] - rows[0], cols[-1] - cols[0]) < 2 * MIN_SIDE:
        return None
    # Everything off the page lies in the box: its share there is the whole count's.
    area = (rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1)
    return box if np.count_nonzero(off_page) / area >= CARD_FILL else None


def _sample_step(height: int, width: int) -> int:
    """The stride, each way, of a sample of about `SAMPLE_PIXELS` pixels."""
    return max(1, math.isqrt(height * width // SAMPLE_PIXELS))


# Row a of this table holds |a - b| for every 8-bit b: `_distance`'s lookups, made once.
_DIFFERENCES = np.abs(np.arange(256)[:, None] - np.arange(256)).astype(np.uint8)


def _distance(pixels: np.ndarray, colour) -> np.ndarray:
    """Each pixel's largest channel difference from `colour` [C], uint8 [...] for pixels
    [..., C]: per channel, a 256-entry table gives each value's difference."""
    distance = None
    for c, value in enumerate(colour):
        # np.take: the same lookup as indexing, cheaper for uint8 indices (bench.preprocess)
        here = np.take(_DIFFERENCES[int(value)], pixels[..., c])
        distance = here if distance is None else np.maximum(distance, here, out=distance)
    return distance


def _far_from(pixels: np.ndarray, colour) -> np.ndarray:
    """Whether each pixel [..., C] lies `INK_MIN_CONTRAST` or more from `colour` [C]."""
    return _distance(pixels, colour) >= INK_MIN_CONTRAST


def _blocks(values: np.ndarray) -> np.ndarray | None:
    """`values` [H, W, ...] cut into square blocks about a third of its shorter side (16
    at least): [rows, cols, pixels of a block, ...]; None when smaller than one block."""
    height, width = values.shape[:2]
    block = max(16, min(height, width) // 3)
    rows, cols = height // block, width // block
    if rows == 0 or cols == 0:
        return None
    rest = values.shape[2:]
    tiles = values[: rows * block, : cols * block].reshape(rows, block, cols, block, *rest)
    return tiles.swapaxes(1, 2).reshape(rows, cols, block * block, *rest)


def local_paper(pixels: np.ndarray, distance: np.ndarray) -> np.ndarray | None:
    """The paper's colour block by block [rows, cols, C] over `pixels` [H, W, C], where
    it is uneven (a photo's lighting, a gradient behind the formula); None where it is
    even (most pictures), which leaves them as they are. `distance` [H, W] is each
    pixel's distance from the median colour: a block's paper lies at least
    `UNEVEN_PAPER` from it when this low a quantile of the block's distances does. A
    block's paper colour is its median: ink does not move it unless it covers half the
    block."""
    even = _blocks(distance < UNEVEN_PAPER)
    if even is None:  # too small for the lighting to vary across it
        return None
    low = int(PAPER_QUANTILE * (even.shape[2] - 1))  # np.quantile's "lower" index
    # A block's `low`-th smallest distance is under `UNEVEN_PAPER` where more than `low`
    # of its distances are: counted, not sorted.
    if np.count_nonzero(even, axis=2).min() > low:
        return None
    return np.median(_blocks(pixels), axis=2).round().astype(np.uint8)


def distance_from_paper_around(channels: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Each pixel's largest channel difference from the paper around it (`local_paper`'s
    blocks, interpolated linearly between their centres), as uint8 [H, W]; where that
    paper leaves ink less room (dark ink in a shadow) the difference is raised to what it
    would be on the most even-lit paper, so that one stroke keeps one darkness across the
    picture. Computed in bands of rows, so a large photo needs little memory."""
    height, width = channels.shape[:2]
    room = np.maximum(local, 255 - local).max(axis=2)  # how far ink can lie from the paper
    gain = room.max() / room.astype(np.float32)
    down, across = _spread(height, local.shape[0]), _spread(width, local.shape[1])
    out = np.empty((height, width), dtype=np.uint8)
    for top in range(0, height, PAPER_BAND):
        rows = down[top : top + PAPER_BAND]
        distance = None
        for c in range(channels.shape[2]):
            paper = rows @ local[:, :, c].astype(np.float32) @ across.T
            here = np.abs(channels[top : top + PAPER_BAND, :, c] - paper)
            distance = here if distance is None else np.maximum(distance, here, out=distance)
        distance *= rows @ gain @ across.T
        np.minimum(distance, 255.0, out=distance)
        out[top : top + PAPER_BAND] = distance
    return out


def _spread(size: int, blocks: int) -> np.ndarray:
    """Weights [size, blocks] that interpolate `blocks` values, one per equal block of a
    line of `size` pixels, linearly between the blocks' centres (flat beyond the outer
    ones)."""
    centres = (np.arange(blocks) + 0.5) * size / blocks - 0.5
    pixels = np.arange(size)
    weights = [np.interp(pixels, centres, one) for one in np.eye(blocks)]
    return np.stack(weights, axis=1).astype(np.float32)


def inside_frame(gray: Image.Image | np.ndarray) -> np.ndarray | None:
    """What a frame around all of the ink holds (a screenshot of a bordered box), or None
    without one. The frame's four sides are thin lines along the ink's bounding box that
    touch nothing inside it; a formula's own bars, brackets and fraction lines never make
    up all four (but an `\\fbox` around a whole formula is taken for a frame)."""
    pixels = np.asarray(gray)
    ink = pixels < INK_THRESHOLD
    rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
    if rows.size == 0:
        return None
    top, left = int(rows[0]), int(cols[0])
    box = ink[top : int(rows[-1]) + 1, left : int(cols[-1]) + 1]
    height, width = box.shape

    def lines(cover: np.ndarray, across: int) -> int:
        """How many of the lines `cover` starts with are one side of a frame (0: none)."""
        full = cover >= FRAME_COVER
        count = int(np.argmin(full)) if not full.all() else full.size
        return count if count <= max(2, FRAME_THICKNESS * across) else 0

    # Most pictures have no line along the top, where `lines` finds none: no need to measure
    # every row and column (the top row's share counted, the same float as its mean).
    if np.count_nonzero(box[0]) / width < FRAME_COVER:
        return None
    across_rows, down_columns = box.mean(axis=1), box.mean(axis=0)
    above, below = lines(across_rows, height), lines(across_rows[::-1], height)
    before, after = lines(down_columns, width), lines(down_columns[::-1], width)
    if not (above and below and before and after):
        return None
    if above + below + 2 >= height or before + after + 2 >= width:
        return None  # nothing inside
    inner = box[above : height - below, before : width - after]
    if inner[0].any() or inner[-1].any() or inner[:, 0].any() or inner[:, -1].any():
        return None  # ink runs into the lines: they are the formula's own
    return pixels[top + above : top + height - below, left + before : left + width - after]


def trim_margins(gray: Image.Image | np.ndarray, margin: int) -> np.ndarray:
    """Crop to the ink's bounding box plus `margin` white pixels on each side."""
    pixels = np.asarray(gray)
    ink = pixels < INK_THRESHOLD
    ink_rows = np.flatnonzero(ink.any(axis=1))
    if ink_rows.size == 0:
        return pixels  # a blank image stays blank; the model answers with an empty formula
    ink_cols = np.flatnonzero(ink.any(axis=0))
    cropped = pixels[ink_rows[0] : ink_rows[-1] + 1, ink_cols[0] : ink_cols[-1] + 1]
    # What np.pad gives, without its generality's cost.
    height, width = cropped.shape
    out = np.full((height + 2 * margin, width + 2 * margin), 255, dtype=cropped.dtype)
    out[margin : margin + height, margin : margin + width] = cropped
    return out


def skew_angle(gray: Image.Image | np.ndarray, max_degrees: float) -> float:
    """The rotation (degrees, counter-clockwise) that levels the ink's rows best, within
    `max_degrees`: formulas sit on baselines and fraction bars, whose row profile is
    sharpest when level. 0 unless a tilt is clearly better than none.

    For angles this small a rotation moves each ink pixel by `x * tan(angle)` rows, so
    each candidate's row profile is one weighted histogram of the ink, not a resampling."""
    pixels = np.asarray(gray)
    if max_degrees <= 0 or min(pixels.shape) < MIN_SIDE:
        return 0.0
    factor = pixels.shape[0] // SKEW_HEIGHT  # an angle needs no detail
    small = Image.fromarray(pixels).reduce(factor) if factor > 1 else pixels
    darkness = 255.0 - np.asarray(small, dtype=np.float32)
    ink = np.flatnonzero(darkness > 0)  # then rows and columns: cheaper than np.nonzero
    if ink.size == 0:
        return 0.0
    ys = ink // darkness.shape[1]
    xs = ink - ys * darkness.shape[1]
    xs = xs - xs.mean()
    # In float64 once: the arithmetic below would convert them on every call.
    weights, ys_float = np.take(darkness, ink).astype(np.float64), ys.astype(np.float64)

    def levelness(angle: float) -> float:
        """How sharply the ink falls into rows: the row profile's sum of squares."""
        if angle == 0.0:  # each pixel wholly in its own row: the same sums, less work
            index = ys - ys.min()
            profile = np.bincount(index, weights, minlength=int(index.max()) + 2)
            return float(np.dot(profile, profile))
        rows = ys_float - xs * np.tan(np.radians(angle))
        below = np.floor(rows)
        upper = rows - below  # each pixel splits between its two nearest rows
        index = (below - below.min()).astype(np.int64)
        size = int(index.max()) + 2
        profile = np.bincount(index, weights * (1.0 - upper), minlength=size)
        profile += np.bincount(index + 1, weights * upper, minlength=size)
        return float(np.dot(profile, profile))

    level = levelness(0.0)
    # Most pictures are level: if neither half-way tilt beats none, no search is needed.
    if max(levelness(-max_degrees / 2), levelness(max_degrees / 2)) <= level:
        return 0.0
    best, best_score = 0.0, level
    for angle in np.arange(-max_degrees, max_degrees + 1e-6, SKEW_STEP):
        if abs(angle) > 1e-6:
            score = levelness(float(angle))
            if score > best_score:
                best, best_score = float(angle), score
    for angle in (best - SKEW_STEP / 2, best + SKEW_STEP / 2):  # one finer step
        score = levelness(angle)
        if abs(angle) <= max_degrees and score > best_score:
            best, best_score = angle, score
    return best if best_score > level * SKEW_GAIN else 0.0


def stroke_width(gray: Image.Image | np.ndarray) -> float:
    """The typical stroke width of the ink, in pixels: twice its area over its outline's
    length (total variation), both from gray levels, so blur and anti-aliasing do not
    change it. Strokes thinner than about a pixel all measure about a pixel."""
    darkness = 1.0 - np.asarray(gray, dtype=np.float32) / 255.0
    outline = np.abs(np.diff(darkness, axis=0)).sum() + np.abs(np.diff(darkness, axis=1)).sum()
    return float(2.0 * darkness.sum() / outline) if outline > 0 else 0.0


def _edges(mask: np.ndarray) -> np.ndarray:
    """Along the last axis of a boolean mask, True at each i (0 to its length) where the
    positions i - 1 and i differ, positions outside the mask holding no ink: where a run
    of ink starts, and just past where one ends."""
    padded = np.zeros((*mask.shape[:-1], mask.shape[-1] + 2), dtype=bool)
    padded[..., 1:-1] = mask
    return padded[..., 1:] != padded[..., :-1]


def _pieces(ink: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One level of an XY cut of a boolean ink mask: (top, bottom, left, right) of each
    piece, the mask cut at its blank columns and each slice at its blank rows."""
    columns = np.flatnonzero(_edges(ink.any(axis=0)))
    if columns.size == 0:
        return (np.zeros(0, dtype=np.int64),) * 4
    starts, ends = columns[0::2], columns[1::2]
    # Slice by slice, which rows hold ink (the blank columns between slices add nothing).
    rows = np.logical_or.reduceat(ink, starts, axis=1).T
    slices, cuts = np.nonzero(_edges(rows))
    # A slice's cuts alternate: where a piece starts, then just past its end.
    return cuts[0::2], cuts[1::2], starts[slices[0::2]], ends[slices[0::2]]


def glyph_heights(gray: Image.Image | np.ndarray, stroke: float) -> np.ndarray:
    """Heights in pixels of the ink's glyphs: the picture cut at its blank columns, each
    slice at its blank rows, and each piece much wider than tall (a fraction's numerator,
    a matrix row) cut again, up to `GLYPH_CUTS` times; the pieces taller than
    `GLYPH_MIN_STROKES` strokes of width `stroke` count (a fraction bar, a minus sign or
    a speck of noise does not). Glyphs that touch count as one."""
    ink = np.asarray(gray) < 128
    flat = GLYPH_MIN_STROKES * stroke
    heights = []
    pending = [(ink, 0)]
    while pending:
        mask, depth = pending.pop()
        # A few dozen pieces: plain Python costs less than NumPy calls on arrays this small.
        tops, bottoms, lefts, rights = (side.tolist() for side in _pieces(mask))
        for top, bottom, left, right in zip(tops, bottoms, lefts, rights, strict=True):
            tall = bottom - top
            # A piece the cut left whole (as tall as its mask) will not split again.
            wide = right - left > GLYPH_WIDE * tall and flat < tall < mask.shape[0]
            if wide and depth + 1 < GLYPH_CUTS:
                pending.append((mask[top:bottom, left:right], depth + 1))
            elif tall > flat:
                heights.append(tall)
    return np.array(heights, dtype=np.int64)


def glyph_height(gray: Image.Image | np.ndarray, stroke: float | None = None) -> float | None:
    """The median height of the ink's glyphs (`glyph_heights`) in pixels, which follows
    the font size whatever its weight; None for fewer than `GLYPH_MIN_COUNT` glyphs."""
    heights = glyph_heights(gray, stroke_width(gray) if stroke is None else stroke)
    if heights.size < GLYPH_MIN_COUNT:
        return None
    # Whole numbers: the same median as np.median's, without its cost on a few dozen.
    return float(statistics.median(heights.tolist()))


def native_upscale(gray: Image.Image | np.ndarray, spec: FormulaImageSpec) -> float | None:
    """`spec.max_upscale` for this picture: the same cap for one drawn at the training
    scale, proportionally less for a larger drawing (a HiDPI screenshot), so that its
    strokes end up as thick as the model's training images'; or its glyphs as tall,
    where they say it is larger still and its strokes are not thick enough to say so
    alone (a light font at a large size). A smaller drawing keeps the cap: its strokes,
    under a pixel, cannot tell how much smaller it is, and its glyphs' heights vary too
    much with what they are."""
    if spec.max_upscale is None or (spec.stroke_width is None and spec.glyph_height is None):
        return spec.max_upscale
    measured = stroke_width(gray)
    if measured <= 0:
        return spec.max_upscale
    strokes = 1.0 if spec.stroke_width is None else spec.stroke_width / measured
    if spec.glyph_height is not None and strokes >= GLYPH_TOLERANCE:
        height = glyph_height(gray, measured)
        if height and spec.glyph_height / height * min(strokes, 1.0) < GLYPH_TOLERANCE:
            return float(spec.max_upscale) * spec.glyph_height / height
    if strokes < SCALE_TOLERANCE:
        return float(spec.max_upscale) * strokes  # beyond the training images' own variety
    return spec.max_upscale


def fit_to_height(
    gray: Image.Image | np.ndarray, spec: FormulaImageSpec, max_upscale: float | None = None
) -> Image.Image:
    """Scale to the model's height keeping the aspect ratio; never wider than `max_width`.

    A formula too wide for `max_width` at full height is scaled to fit the width
    and centred vertically on white, as is one that `max_upscale` (by default the
    spec's) keeps small.
    """
    if isinstance(gray, np.ndarray):
        gray = Image.fromarray(gray)
    if spec.fixed_size:
        return gray.resize((spec.max_width, spec.height), Image.Resampling.BILINEAR)
    width, height = gray.size
    scale = spec.height / height
    cap = spec.max_upscale if max_upscale is None else max_upscale
    if cap is not None:
        scale = min(scale, float(cap))
    scale = min(scale, spec.max_width / width)
    new_w = max(1, min(spec.max_width, round(width * scale)))
    new_h = max(1, min(spec.height, round(height * scale)))
    resized = gray.resize((new_w, new_h), Image.Resampling.BILINEAR)
    if new_h == spec.height:
        return resized
    canvas = Image.new("L", (new_w, spec.height), 255)
    canvas.paste(resized, (0, (spec.height - new_h) // 2))
    return canvas


def bucket_width(width: int, spec: FormulaImageSpec, step: int) -> int:
    """The padded width for a strip `width` pixels wide: the next multiple of `step`; a
    fixed-size encoder's one width for every strip (each is stretched to it)."""
    if spec.fixed_size:
        return spec.max_width
    step = max(spec.width_multiple, step - step % spec.width_multiple)
    return min(spec.max_width, max(step, math.ceil(width / step) * step))


def prepare_strip(image: Image.Image, spec: FormulaImageSpec) -> np.ndarray:
    """Ink on paper, trimmed, at the training scale, height-fitted: a uint8 strip
    [height, width] (unpadded); [height, 0] for a picture with no ink."""
    gray = ink_on_paper(image)
    if gray is None:
        return np.full((spec.height, 0), 255, dtype=np.uint8)
    for _ in range(2):  # a box in a box
        framed = inside_frame(gray)
        if framed is None:
            break
        gray = framed
    gray = trim_margins(gray, spec.margin)
    angle = skew_angle(gray, spec.max_skew)
    if angle:
        turned = Image.fromarray(gray).rotate(
            angle, Image.Resampling.BICUBIC, expand=True, fillcolor=255
        )
        gray = trim_margins(turned, spec.margin)
    return np.asarray(fit_to_height(gray, spec, native_upscale(gray, spec)), dtype=np.uint8)


def pad_strips(strips: list[np.ndarray], width: int, out: np.ndarray | None = None) -> np.ndarray:
    """Stack strips into a uint8 batch [N, H, width], padded with white on the right
    (into `out` when given, such as a view of pinned memory)."""
    height = strips[0].shape[0]
    batch = np.empty((len(strips), height, width), dtype=np.uint8) if out is None else out
    batch.fill(255)
    for i, strip in enumerate(strips):
        w = min(width, strip.shape[1])
        batch[i, :, :w] = strip[:, :w]
    return batch


def pad_and_normalize(strips: list[np.ndarray], width: int, spec: FormulaImageSpec) -> np.ndarray:
    """Stack strips into a float32 batch [N, C, H, width], padded with white on the right."""
    if spec.uniform:
        pixels = (pad_strips(strips, width).astype(np.float32) / 255.0 - spec.mean) / spec.std
        return np.repeat(pixels[:, None], spec.channels, axis=1)
    gray = pad_strips(strips, width).astype(np.float32)[:, None] / 255.0
    mean = np.array(spec.channel_values(spec.mean), dtype=np.float32)[None, :, None, None]
    std = np.array(spec.channel_values(spec.std), dtype=np.float32)[None, :, None, None]
    return (gray - mean) / std


def normalize_pixels(batch, spec: FormulaImageSpec):
    """`pad_and_normalize`'s arithmetic on a uint8 torch batch [N, H, W], on its device:
    float32 [N, C, H, W] with the same values."""
    if spec.uniform:
        pixels = (batch.float() / 255.0 - spec.mean) / spec.std
        return pixels[:, None].expand(-1, spec.channels, -1, -1)
    gray = batch.float()[:, None] / 255.0
    mean = gray.new_tensor(spec.channel_values(spec.mean)).view(1, -1, 1, 1)
    std = gray.new_tensor(spec.channel_values(spec.std)).view(1, -1, 1, 1)
    return (gray - mean) / std


@dataclass(frozen=True)
class FormulaInput:
    """One preprocessed formula: its grayscale strip and the bucket it pads to."""

    strip: np.ndarray  # uint8 [height, width]
    bucket: int  # padded width

    @property
    def width(self) -> int:
        return int(self.strip.shape[1])

    @property
    def blank(self) -> bool:
        """No ink found: there is no formula to read, and the answer is empty."""
        return self.strip.shape[1] == 0


@dataclass(frozen=True)
class FormulaPreprocessor:
    """Upload bytes to a `FormulaInput`: decode, strip, bucket.

    Plain data and a module of numpy and PIL only: it runs in an HTTP process, which
    holds no model.
    """

    spec: FormulaImageSpec
    bucket_step: int
    max_pixels: int

    def __call__(self, data: bytes) -> FormulaInput:
        image = decode_image(data, self.max_pixels)
        try:
            strip = prepare_strip(image, self.spec)
        except Exception as exc:
            # A decoded upload can still carry what Pillow refuses later, when it converts
            # the picture (a transparent palette index past the palette): that is the
            # upload's fault, so the client hears it is corrupt, not that the server
            # failed. Errors raised outside Pillow are Texel's own, and running out of
            # memory is the server's: both stay errors.
            if isinstance(exc, MemoryError) or not _raised_by_pillow(exc):
                raise
            raise CorruptImage(f"the image could not be read: {exc}") from exc
        return FormulaInput(strip, bucket_width(strip.shape[1], self.spec, self.bucket_step))
