"""The real formula images: reading, the deterministic train/dev split, and batching.

The split is a pure function of the file name (md5 modulo 10), so every run,
machine and tool agrees on which images are dev. Images become strips through
the server's own `decode_image` and `prepare_strip`; batches are padded with
the server's `pad_and_normalize` to `bucket_width`.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from models.formula.preprocess import (
    FormulaImageSpec,
    bucket_width,
    decode_image,
    pad_and_normalize,
    prepare_strip,
)

# Large enough for any im2latex image; the server applies its own configured limit.
MAX_PIXELS = 50_000_000
# The server pads batches to multiples of this many pixels.
BUCKET_STEP = 64


@dataclass(frozen=True)
class FormulaSample:
    name: str
    formula: str


def is_dev(name: str) -> bool:
    """Whether an image belongs to the dev split (about one in ten, fixed by its name)."""
    return int(hashlib.md5(name.encode()).hexdigest(), 16) % 10 == 0


def read_formulas(data_dir: str | Path) -> list[FormulaSample]:
    """The `name<TAB>formula` lines of `formulas.tsv`, with spacing normalized."""
    samples = []
    for line in (Path(data_dir) / "formulas.tsv").read_text().splitlines():
        if not line.strip():
            continue
        name, formula = line.split("\t", 1)
        samples.append(FormulaSample(name=name, formula=" ".join(formula.split())))
    return samples


def split_samples(
    samples: Sequence[FormulaSample],
) -> tuple[list[FormulaSample], list[FormulaSample]]:
    """(train, dev) by `is_dev`."""
    train = [s for s in samples if not is_dev(s.name)]
    dev = [s for s in samples if is_dev(s.name)]
    return train, dev


def load_strip(path: str | Path, spec: FormulaImageSpec) -> np.ndarray:
    """One image file as the server would see it: a uint8 strip [height, width]."""
    return prepare_strip(decode_image(Path(path).read_bytes(), MAX_PIXELS), spec)


def load_strips(
    data_dir: str | Path, samples: Sequence[FormulaSample], spec: FormulaImageSpec
) -> list[np.ndarray]:
    images = Path(data_dir) / "images"
    return [load_strip(images / s.name, spec) for s in samples]


def quantized_png(image: Image.Image | str | Path) -> bytes:
    """A 16-gray-level, 4-bit PNG of an image: how formula images travel to a device
    (about a fifth of the bytes, with no visible change to a formula)."""
    if not isinstance(image, Image.Image):
        image = Image.open(image)
    gray = image.convert("L").point(lambda v: min(255, round(v / 17) * 17))
    paletted = gray.quantize(colors=16, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    buffer = io.BytesIO()
    paletted.save(buffer, format="PNG", bits=4, optimize=True)
    return buffer.getvalue()


def width_batches(widths: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    """Indices grouped into batches of similar width (narrowest first), for inference."""
    order = np.argsort(np.asarray(widths), kind="stable")
    for start in range(0, len(order), batch_size):
        yield [int(i) for i in order[start : start + batch_size]]


def server_batch(
    strips: Sequence[np.ndarray], spec: FormulaImageSpec, step: int = BUCKET_STEP
) -> np.ndarray:
    """Pad strips to their bucket width (buckets `step` px apart, the server's
    `bucket_width` setting) and normalize, exactly as the server does."""
    width = bucket_width(max(s.shape[1] for s in strips), spec, step=step)
    return pad_and_normalize(list(strips), width, spec)


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Add `data` to `tar` as the file `name`."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
