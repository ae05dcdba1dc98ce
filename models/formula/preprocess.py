"""Formula image preprocessing shared by the server, training and evaluation.

A formula picture becomes a grayscale strip of fixed height and variable width:
decode, flatten onto white, trim the white margins, scale to the model's
height keeping the aspect ratio, then pad on the right to the bucket width.
Training and `make eval-formula` call the same functions, so the model sees
exactly what the server feeds it.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from models.errors import CorruptImage, ImageTooLarge, UnsupportedImage

ACCEPTED_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "BMP", "GIF"})

# Pixels darker than this count as ink when trimming margins (0 = black, 255 = white).
INK_THRESHOLD = 200


@dataclass(frozen=True)
class FormulaImageSpec:
    """How a model wants its formula images.

    `height` is the fixed input height, `max_width` the widest input the encoder
    accepts, `width_multiple` the granularity every padded width must respect
    (the patch size times the encoder's total downsampling). `max_upscale`
    limits how much a small formula is enlarged; the rest is vertical padding.
    """

    height: int = 64
    max_width: int = 1024
    width_multiple: int = 32
    channels: int = 1
    mean: float = 0.5
    std: float = 0.5
    margin: int = 2
    max_upscale: float | None = None
    # Encoders with fixed position embeddings (ViT, DeiT: TrOCR-style models) take
    # one size only; the strip is then stretched to height x max_width.
    fixed_size: bool = False

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, channels: int = 1, fixed_size: bool = False
    ) -> FormulaImageSpec:
        """Read the `preprocessor_config.json` saved beside a formula model."""
        raw = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        size = raw.get("size", {})
        if isinstance(size, int):  # older processors store one square size
            size = {"height": size, "width": size}
        mean = raw.get("image_mean", [0.5])
        std = raw.get("image_std", [0.5])
        return cls(
            height=int(size.get("height", cls.height)),
            max_width=int(size.get("width", cls.max_width)),
            width_multiple=int(raw.get("texel_width_multiple", cls.width_multiple)),
            channels=channels,
            mean=float(mean[0] if isinstance(mean, list) else mean),
            std=float(std[0] if isinstance(std, list) else std),
            margin=int(raw.get("texel_margin", cls.margin)),
            max_upscale=raw.get("texel_max_upscale"),
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
            "image_mean": [self.mean] * self.channels,
            "image_std": [self.std] * self.channels,
            "texel_width_multiple": self.width_multiple,
            "texel_margin": self.margin,
            "texel_max_upscale": self.max_upscale,
        }


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """Decode uploaded bytes into an RGB-or-gray PIL image, refusing bombs before decoding.

    Raises `UnsupportedImage` for unknown formats, `ImageTooLarge` when the header
    announces more than `max_pixels` pixels, and `CorruptImage` when the data of a
    known format cannot be decoded.
    """
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"image exceeds the pixel limit: {exc}") from exc
    except Exception as exc:  # PIL raises several types for unidentifiable data
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
    return image


def to_grayscale(image: Image.Image) -> Image.Image:
    """Flatten transparency onto white and convert to 8-bit grayscale."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    gray = image.convert("L")
    # Light ink on a dark background: invert so ink is always dark.
    if np.asarray(gray).mean() < 110:
        gray = ImageOps.invert(gray)
    return gray


def trim_margins(gray: Image.Image, margin: int) -> Image.Image:
    """Crop to the ink's bounding box plus `margin` white pixels on each side."""
    pixels = np.asarray(gray)
    ink_rows = np.flatnonzero((pixels < INK_THRESHOLD).any(axis=1))
    ink_cols = np.flatnonzero((pixels < INK_THRESHOLD).any(axis=0))
    if ink_rows.size == 0:
        return gray  # a blank image stays blank; the model answers with an empty formula
    top, bottom = ink_rows[0], ink_rows[-1] + 1
    left, right = ink_cols[0], ink_cols[-1] + 1
    cropped = gray.crop((left, top, right, bottom))
    return ImageOps.expand(cropped, border=margin, fill=255)


def fit_to_height(gray: Image.Image, spec: FormulaImageSpec) -> Image.Image:
    """Scale to the model's height keeping the aspect ratio; never wider than `max_width`.

    A formula too wide for `max_width` at full height is scaled to fit the width
    and centred vertically on white, as is one that `max_upscale` keeps small.
    """
    if spec.fixed_size:
        return gray.resize((spec.max_width, spec.height), Image.Resampling.BILINEAR)
    width, height = gray.size
    scale = spec.height / height
    if spec.max_upscale is not None:
        scale = min(scale, float(spec.max_upscale))
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
    """The padded width for a strip `width` pixels wide: the next multiple of `step`."""
    step = max(spec.width_multiple, step - step % spec.width_multiple)
    return min(spec.max_width, max(step, math.ceil(width / step) * step))


def prepare_strip(image: Image.Image, spec: FormulaImageSpec) -> np.ndarray:
    """Grayscale, trimmed, height-fitted strip as uint8 [height, width] (unpadded)."""
    gray = trim_margins(to_grayscale(image), spec.margin)
    return np.asarray(fit_to_height(gray, spec), dtype=np.uint8)


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
    pixels = (pad_strips(strips, width).astype(np.float32) / 255.0 - spec.mean) / spec.std
    return np.repeat(pixels[:, None], spec.channels, axis=1)


def normalize_pixels(batch, spec: FormulaImageSpec):
    """`pad_and_normalize`'s arithmetic on a uint8 torch batch [N, H, W], on its device:
    float32 [N, C, H, W] with the same values."""
    pixels = (batch.float() / 255.0 - spec.mean) / spec.std
    return pixels[:, None].expand(-1, spec.channels, -1, -1)


@dataclass(frozen=True)
class FormulaInput:
    """One preprocessed formula: its grayscale strip and the bucket it pads to."""

    strip: np.ndarray  # uint8 [height, width]
    bucket: int  # padded width

    @property
    def width(self) -> int:
        return int(self.strip.shape[1])


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
        strip = prepare_strip(decode_image(data, self.max_pixels), self.spec)
        return FormulaInput(strip, bucket_width(strip.shape[1], self.spec, self.bucket_step))
