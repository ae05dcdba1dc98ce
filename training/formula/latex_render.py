"""A pre-rendered synthetic formula set, drawn by real LaTeX the way im2latex was made.

    python -m training.formula.latex_render --data ../shared/data/im2latex-val --out .rs/set \\
        --count 30000 --seed 0 --workers 2 --pack .rs/rs.lvl.xz --pack-max-mb 26 \\
        --verbatim-share 0.15

The im2latex images were rendered by pdflatex in Computer Modern, then cropped to
the ink, padded by 8 px, placed top-left in a fixed-size bucket and downsampled by
2 (the im2markup scripts). This module does the same with `latex` and `dvipng`
(far faster than pdflatex and a PDF rasterizer): one document per chunk of
formulas, one formula per page, and a LaTeX error is traced to its formula
through markers written to the log, so a formula that does not compile is
skipped rather than saved with a garbled picture. Unlike matplotlib's mathtext
(`training.formula.synth`), it draws arrays, `\\\\`, `\\big` and the rest.

The formulas are train-split formulas and new ones composed from them by
`synth.FormulaComposer`; no dev formula is ever written. The set is a folder
`images/*.png` (16-gray-level PNGs, like the carried real images) plus
`formulas.tsv` (`name<TAB>formula`, normalized: what the model should output) and
`origins.tsv` (`name<TAB>train|composed`), deterministic from the seed; `--append`
adds to it. For a device run it packs into one archive: a `.lvl.xz` (gray levels
compressed across images, about a quarter of the PNGs' bytes) or a `.tar.xz` of the
PNGs, optionally cut to a size and to a share of verbatim train formulas.

Font setups (`FONTS`, `--fonts`): Computer Modern as im2latex, and Latin Modern, Times
(newtx) and Palatino (newpx) for training; Utopia (fourier), Kp and a sans serif
(cmbright) are kept for evaluation as styles the model never saw, and training
renders refuse them. Each LaTeX document (a chunk) is in one font.

    python -m training.formula.latex_render --school ../shared/data/k12-formulas \\
        --fonts cm,lmodern,times,palatino --out .rs/school --count 40000 --seed 31 \\
        --workers 2 --pack .rs/school.lvl.xz --pack-max-mb 12

renders the school collection's train formulas instead (`school.split_formulas`; never
a dev one), each drawn as typed and labelled normalized, as screenshots: cropped to
the ink with a margin, no bucket, at an em of about 9, 14 or 24 px (`SCHOOL_DPIS`).
"""

from __future__ import annotations

import argparse
import io
import lzma
import re
import subprocess
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from training.formula import school
from training.formula.data import add_bytes, quantized_png, read_formulas, split_samples
from training.formula.synth import LONG_TOKENS, FormulaComposer

# im2markup's rendering: article at its default 10pt, display math, no page numbers. amssymb is
# loaded as well since normalized im2latex formulas use its symbols, and what school maths
# needs beyond it (`\mathscr`; `\overparen`, an arc over a chord, where the font has none).
# A glyph missing from a font is an error (\tracinglostchars=3) instead of a silent gap.
_PREAMBLE_HEAD = "\\documentclass{article}\n\\usepackage{amsmath}\n"
_PREAMBLE_TAIL = r"""\usepackage{mathrsfs}
\providecommand{\overparen}[1]{\overset{\frown}{#1}}
\pagestyle{empty}
\tracinglostchars=3
\begin{document}
"""
# Font setups: the preamble lines that choose the text and math fonts (after amsmath, which
# newtxmath and kpfonts want first). Those whose math fonts bring the AMS symbols
# themselves leave amssymb out: loading it again redefines them, an error.
FONTS = {
    "cm": (r"\usepackage{amssymb}",),
    "lmodern": (r"\usepackage[T1]{fontenc}", r"\usepackage{lmodern}", r"\usepackage{amssymb}"),
    "times": (r"\usepackage{newtxtext}", r"\usepackage{newtxmath}"),
    "palatino": (r"\usepackage{newpxtext}", r"\usepackage{newpxmath}"),
    "utopia": (r"\usepackage{amssymb}", r"\usepackage[T1]{fontenc}", r"\usepackage{fourier}"),
    "kp": (r"\usepackage{kpfonts}",),
    "sans": (r"\usepackage{cmbright}", r"\usepackage{amssymb}"),
}
# Training renders only these; the others are the evaluation's unseen styles.
TRAIN_FONTS = ("cm", "lmodern", "times", "palatino")
EVAL_FONTS = ("utopia", "kp", "sans")
DEFAULT_FONT = "cm"


def preamble(font: str = DEFAULT_FONT) -> str:
    """The document's preamble in font setup `font` (a key of FONTS)."""
    return _PREAMBLE_HEAD + "".join(line + "\n" for line in FONTS[font]) + _PREAMBLE_TAIL


PREAMBLE = preamble()
BEGIN_MARK = "TEXEL-BEGIN"
END_MARK = "TEXEL-END"
_MARK = re.compile(rf"^({BEGIN_MARK}|{END_MARK}) (\d+)$")
_PAGES = re.compile(r"Output written on .* \((\d+) pages?,")

# im2markup's preprocessing: content padded by 8 px, the smallest bucket that holds
# it (width, height at render resolution), then downsampled by 2 with Lanczos.
IM2MARKUP_PAD = 8
IM2MARKUP_BUCKETS = (
    (240, 100), (320, 80), (400, 80), (400, 100), (480, 80), (480, 100), (560, 80),
    (560, 100), (640, 80), (640, 100), (720, 80), (720, 100), (720, 120), (720, 200),
    (800, 100), (800, 320), (1000, 200), (1000, 400), (1200, 200), (1600, 200),
    (1600, 1600),
)  # fmt: skip
DOWNSAMPLE = 2

# Calibrated against the real train images (see `calibrate`): the im2latex renders
# are 10pt article (not 12pt: 12pt glyphs come out 14-17% too large), and dvipng at
# 200 dpi (im2markup rasterized its PDFs at 200 dpi) gives the same glyph sizes.
BASE_DPI = 200
# Mild variety around the calibration, since the test images are real im2latex ones.
DPI_CHOICES = (185, 192, 200, 200, 200, 208, 215)
PAD_CHOICES = (6, 8, 8, 8, 10, 12)
# dvipng's anti-aliasing interpolation (its default); higher draws darker edges.
GAMMA = 1.0
# The real renders have bolder strokes than dvipng's: growing the ink by one pixel
# right and down at render resolution matches their ink mass and share of black
# pixels (see `calibrate`); some images keep dvipng's thinner strokes for variety.
STROKE_CHOICES = (0, 1, 1, 1, 1)

LATEX_TIMEOUT_S = 60
# Compiles of one chunk (each without the formulas that failed before) before the
# rest is split in two.
MAX_COMPILES = 4
CHUNK = 200
MAX_TOKENS = 200  # the training script's longest target
COMPOSE_TRIES = 4

# A set's origins.tsv says, per image, whether its formula is a verbatim train formula.
ORIGINS = "origins.tsv"
VERBATIM, COMPOSED = "train", "composed"

# The compact archive (`_write_levels`): gray levels, one byte a pixel, column by column,
# in one xz stream. A formula is a row of glyphs; read column by column, a glyph is one
# run of bytes that recurs wherever it does (in any image within xz's 64 MiB window),
# where row by row it is cut into slices between other glyphs'. Images of one shape come
# together, and xz's extreme preset searches longer. Measured on 3,000 images of a set:
# PNGs in a .tar.xz 1,200 bytes each, rows 772, columns 474, columns with the extreme
# preset 410, and also by shape 385; on 12,000 images the last, 289. A 26 MB archive of
# 85,614 images (blocks of 16,384): 303 bytes an image, packed in 21 minutes on one core.
LEVELS_SUFFIX = ".lvl.xz"
LEVELS_MAGIC = b"TEXEL-LEVELS 1\n"
LEVEL_STEP = 17  # gray = level x 17: quantized_png's 16 levels
# Pixels come by shape within blocks of the pack order rather than over the whole set,
# so that a size cap can end the single pass in a block: blocks shrink as the cap nears.
LEVEL_BLOCK = 16384
LEVEL_MIN_BLOCK = 64
# Compressed bytes that xz may hold back at any moment (an LZMA2 chunk is at most 64 KiB),
# kept free under a cap (at most 1% of it: a small archive is retried instead).
LEVEL_LAG = 96 * 1024
LEVEL_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "pb": 0}]


@dataclass(frozen=True)
class RenderJob:
    """Formulas to draw in one LaTeX document, each with its resolution and padding; in
    im2latex's layout (a bucket, see `im2markup_image`) or cropped as a screenshot is."""

    formulas: tuple[str, ...]
    dpis: tuple[int, ...]
    pads: tuple[int, ...]
    strokes: tuple[int, ...]
    font: str = DEFAULT_FONT
    bucket: bool = True


def latex_document(formulas: Sequence[str], font: str = DEFAULT_FONT) -> str:
    """One page per formula, each between log markers that name its index."""
    pages = [
        f"\\typeout{{{BEGIN_MARK} {i}}}\n\\begin{{displaymath}}\n{formula}\n"
        f"\\end{{displaymath}}\n\\typeout{{{END_MARK} {i}}}\n\\newpage\n"
        for i, formula in enumerate(formulas)
    ]
    return preamble(font) + "".join(pages) + "\\end{document}\n"


def failed_formulas(log: str, count: int) -> tuple[set[int], bool]:
    """Indices of the formulas with a LaTeX error in `log`, and whether the log accounts
    for the whole document (every formula reached, no error outside one, every page out).

    An error between two formulas is charged to the one before: a formula that ends the
    display early spills its errors past its end marker.
    """
    failed: set[int] = set()
    current: int | None = None  # the formula begun last: text after its end is still its own
    ended: set[int] = set()
    stray = False
    pages = None
    for line in log.splitlines():
        if mark := _MARK.match(line):
            kind, index = mark.group(1), int(mark.group(2))
            if kind == BEGIN_MARK:
                current = index
            else:
                ended.add(index)
        elif line.startswith("!"):
            if current is None:
                stray = True
            else:
                failed.add(current)
        elif found := _PAGES.search(line):
            pages = int(found.group(1))
    complete = not stray and ended == set(range(count)) and pages == count
    return failed, complete


def _compile(formulas: Sequence[str], work: Path, font: str) -> tuple[Path, set[int], bool]:
    """Run latex on one document of `formulas`: the DVI, the failed indices, and whether
    the log accounts for the whole document (see `failed_formulas`)."""
    tex = work / "f.tex"
    tex.write_text(latex_document(formulas, font))
    dvi, log = work / "f.dvi", work / "f.log"
    for stale in (dvi, log):
        stale.unlink(missing_ok=True)
    try:
        subprocess.run(
            ["latex", "-interaction=nonstopmode", "-no-shell-escape", tex.name],
            cwd=work,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=LATEX_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return dvi, set(), False
    if not log.exists():
        return dvi, set(), False
    failed, complete = failed_formulas(log.read_text(errors="replace"), len(formulas))
    return dvi, failed, complete


def _rasterize(dvi: Path, pages: dict[int, int], work: Path) -> dict[int, Image.Image]:
    """Pages (1-based) of `dvi` at their resolutions, as grayscale images (ink dark)."""
    by_dpi: dict[int, list[int]] = {}
    for page, dpi in pages.items():
        by_dpi.setdefault(dpi, []).append(page)
    images = {}
    for dpi, group in sorted(by_dpi.items()):
        out = work / f"d{dpi}"
        out.mkdir(exist_ok=True)
        subprocess.run(
            ["dvipng", "-q", "-D", str(dpi), "-T", "tight", "-bg", "White", "--gamma", str(GAMMA)]
            + ["-pp", ",".join(map(str, sorted(group))), "-o", str(out / "p%d.png"), str(dvi)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=LATEX_TIMEOUT_S,
            check=False,
        )
        for page in group:
            path = out / f"p{page}.png"
            if path.exists():
                with Image.open(path) as image:
                    images[page] = image.convert("L")
                path.unlink()
    return images


def render_pages(
    formulas: Sequence[str], dpis: Sequence[int], font: str = DEFAULT_FONT
) -> list[Image.Image | None]:
    """Each formula drawn by LaTeX at its dpi in font setup `font` (uncropped), or None
    where it does not compile.

    The formulas with errors are dropped and the rest compiled again, until a compile
    is error-free; so every image returned comes from an error-free document. When
    an error cannot be traced to a formula, each half is rendered on its own.
    """
    results: list[Image.Image | None] = [None] * len(formulas)
    with tempfile.TemporaryDirectory(prefix="texel-latex-") as tmp:
        work = Path(tmp)
        pending = list(range(len(formulas)))
        for _ in range(MAX_COMPILES):
            if not pending:
                return results
            dvi, failed, complete = _compile([formulas[i] for i in pending], work, font)
            if complete and not failed:
                pages = {k + 1: dpis[i] for k, i in enumerate(pending)}
                for page, image in _rasterize(dvi, pages, work).items():
                    results[pending[page - 1]] = image
                return results
            if not failed:
                break
            # Errors can spill into later pages, so the rest is compiled again.
            pending = [i for k, i in enumerate(pending) if k not in failed]
    if len(pending) > 1:
        for half in (pending[: len(pending) // 2], pending[len(pending) // 2 :]):
            images = render_pages([formulas[i] for i in half], [dpis[i] for i in half], font)
            for i, image in zip(half, images, strict=True):
                results[i] = image
    return results


def thicken(page: Image.Image) -> Image.Image:
    """Ink grown by one pixel to the right and down (a 2x2 minimum filter)."""
    pixels = np.asarray(page)
    out = pixels.copy()
    out[:, 1:] = np.minimum(out[:, 1:], pixels[:, :-1])
    out[1:, :] = np.minimum(out[1:, :], out[:-1, :])
    return Image.fromarray(out)


def crop_to_ink(page: Image.Image) -> Image.Image | None:
    """A grayscale picture (ink dark, white paper) cropped to its ink; None without ink."""
    ink = np.asarray(page) < 255
    rows, cols = np.nonzero(ink.any(axis=1))[0], np.nonzero(ink.any(axis=0))[0]
    if rows.size == 0:
        return None
    return page.crop((int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1))


def im2markup_image(
    page: Image.Image, pad: int = IM2MARKUP_PAD, stroke: int = 1
) -> Image.Image | None:
    """Crop to the ink, pad, place top-left in the smallest bucket, downsample by 2;
    with `stroke` 1 the strokes are thickened first, as calibrated.

    None for a page without ink.
    """
    crop = crop_to_ink(thicken(page) if stroke else page)
    if crop is None:
        return None
    width, height = crop.width + 2 * pad, crop.height + 2 * pad
    bucket = next(
        ((w, h) for w, h in IM2MARKUP_BUCKETS if w >= width and h >= height), (width, height)
    )
    canvas = Image.new("L", bucket, 255)
    canvas.paste(crop, (pad, pad))
    size = (canvas.width // DOWNSAMPLE, canvas.height // DOWNSAMPLE)
    return canvas.resize(size, Image.Resampling.LANCZOS)


def screen_image(page: Image.Image, pad: int, stroke: int = 0) -> Image.Image | None:
    """Crop to the ink, pad and downsample by 2, as a screenshot of a formula is cropped
    (no bucket); with `stroke` 1 the strokes are thickened first. None for a page without
    ink."""
    crop = crop_to_ink(thicken(page) if stroke else page)
    if crop is None:
        return None
    canvas = Image.new("L", (crop.width + 2 * pad, crop.height + 2 * pad), 255)
    canvas.paste(crop, (pad, pad))
    size = (max(1, canvas.width // DOWNSAMPLE), max(1, canvas.height // DOWNSAMPLE))
    return canvas.resize(size, Image.Resampling.LANCZOS)


def render_job(job: RenderJob) -> list[bytes | None]:
    """The job's formulas as quantized PNGs, None where LaTeX failed."""
    pages = render_pages(job.formulas, job.dpis, job.font)
    layout = im2markup_image if job.bucket else screen_image
    out: list[bytes | None] = []
    for page, pad, stroke in zip(pages, job.pads, job.strokes, strict=True):
        image = layout(page, pad, stroke) if page is not None else None
        out.append(quantized_png(image) if image is not None else None)
    return out


def renderable(formula: str) -> bool:
    """Cheap checks before LaTeX: balanced braces and no command that ends the document."""
    depth = 0
    for token in formula.split():
        depth += {"{": 1, "}": -1}.get(token, 0)
        if depth < 0:
            return False
    banned = {r"\end{document}", r"\input", r"\include", r"\def", r"\newpage", r"\clearpage"}
    return depth == 0 and not banned.intersection(formula.split())


class FormulaSource:
    """Train formulas and compositions of them, never a dev formula, from a seed."""

    def __init__(
        self,
        data_dir: str | Path,
        train_share: float = 0.3,
        fonts: Sequence[str] = (DEFAULT_FONT,),
        long_share: float = 0.0,
    ):
        samples = read_formulas(data_dir)
        train, dev = split_samples(samples)
        self.train = [s.formula for s in train]
        self.train_set = frozenset(self.train)
        self.dev = frozenset(s.formula for s in dev)
        self.composer = FormulaComposer(self.train, MAX_TOKENS - 1, long_share)
        self.train_share = train_share
        self.fonts = training_fonts(fonts)
        self.rejected_dev = 0

    def draw(self, rng: np.random.Generator) -> tuple[str, bool]:
        """(formula, is_composed); anything equal to a dev formula is drawn again."""
        while True:
            if rng.random() < self.train_share:
                formula = self.composer.pick(rng)
            else:  # compose() sometimes changes nothing: try again a few times
                for _ in range(COMPOSE_TRIES):
                    formula = self.composer.compose(rng)
                    if formula not in self.train_set:
                        break
            composed = formula not in self.train_set
            if formula in self.dev:  # a train formula can also appear under a dev name
                self.rejected_dev += 1
                continue
            if len(formula.split()) < MAX_TOKENS and renderable(formula):
                return formula, composed

    def job(self, seed: int, index: int, size: int) -> tuple[RenderJob, list[str], list[str]]:
        """Chunk `index` of the set made with `seed`: the same formulas wherever it runs,
        with each one's label (the formula itself) and origin (VERBATIM or COMPOSED)."""
        rng = np.random.default_rng([seed, index])
        drawn = [self.draw(rng) for _ in range(size)]
        dpis = tuple(int(d) for d in rng.choice(DPI_CHOICES, size))
        pads = tuple(int(p) for p in rng.choice(PAD_CHOICES, size))
        strokes = tuple(int(s) for s in rng.choice(STROKE_CHOICES, size))
        # Its own generator, so that a set in Computer Modern alone is what it always was.
        font = self.fonts[int(np.random.default_rng([seed, index, 1]).integers(len(self.fonts)))]
        formulas = tuple(f for f, _ in drawn)
        job = RenderJob(formulas, dpis, pads, strokes, font)
        return job, list(formulas), [COMPOSED if c else VERBATIM for _, c in drawn]


def training_fonts(fonts: Sequence[str]) -> tuple[str, ...]:
    """`fonts` checked: known, and none kept for evaluation (ValueError)."""
    for font in fonts:
        if font not in FONTS:
            raise ValueError(f"unknown font setup {font!r}; known: {', '.join(FONTS)}")
        if font not in TRAIN_FONTS:
            raise ValueError(
                f"font setup {font!r} is kept for evaluation (unseen styles); "
                f"training renders {', '.join(TRAIN_FONTS)}"
            )
    if not fonts:
        raise ValueError("no font setup given")
    return tuple(fonts)


# School maths at screen-like sizes: 10pt at these resolutions, halved, gives an em of
# about 9, 14 (im2latex's) and 24 px, each varied by some 7%; a screenshot's crop. Few
# resolutions, since dvipng runs once per resolution in a document.
SCHOOL_DPIS = ((120, 130, 140), (185, 200, 215), (325, 350, 375))
SCHOOL_PADS = (4, 8, 12, 16, 24)
SCHOOL_STROKES = (0, 0, 1)
SCHOOL = "school"  # the origin of a school-maths image: a verbatim train formula


def school_sources(data_dir: str | Path) -> dict[str, str]:
    """Normalized school formula -> the first line of the collection that normalizes to it,
    as its author typed it: what LaTeX draws (their spacing inside `\\text` kept)."""
    sources: dict[str, str] = {}
    for line in (Path(data_dir) / school.FORMULAS_FILE).read_text().splitlines():
        sources.setdefault(school.normalize(line), line.strip())
    return sources


class SchoolSource:
    """The school collection's train formulas (`school.split_formulas`, never a dev one),
    each pass over them in a fresh order from the seed, drawn in training fonts at
    screen-like sizes (SCHOOL_DPIS) and labelled with the normalized formula."""

    def __init__(self, data_dir: str | Path, fonts: Sequence[str] = TRAIN_FONTS):
        train, _ = school.split_formulas(school.read_formulas(data_dir))
        sources = school_sources(data_dir)
        self.formulas = [
            (f, sources[f]) for f in train if len(f.split()) < MAX_TOKENS and renderable(f)
        ]
        self.fonts = training_fonts(fonts)
        self.rejected_dev = 0  # none can be drawn: the pool is the train split

    def job(self, seed: int, index: int, size: int) -> tuple[RenderJob, list[str], list[str]]:
        """Chunk `index` of the set made with `seed` (formulas index x size on, in the
        seed's order), with each one's label and origin."""
        count = len(self.formulas)
        orders: dict[int, np.ndarray] = {}  # pass -> its order
        picks = []
        for position in range(index * size, (index + 1) * size):
            turn = position // count
            if turn not in orders:
                orders[turn] = np.random.default_rng([seed, turn, 2]).permutation(count)
            picks.append(self.formulas[int(orders[turn][position % count])])
        rng = np.random.default_rng([seed, index])
        font = self.fonts[int(rng.integers(len(self.fonts)))]
        sizes, steps = rng.integers(len(SCHOOL_DPIS), size=size), rng.integers(3, size=size)
        dpis = tuple(SCHOOL_DPIS[a][b] for a, b in zip(sizes, steps, strict=True))
        pads = tuple(int(p) for p in rng.choice(SCHOOL_PADS, size))
        # Thickened strokes only from im2latex's size up: on the small ones a pixel is a lot.
        strokes = tuple(
            int(s) if a else 0 for s, a in zip(rng.choice(SCHOOL_STROKES, size), sizes, strict=True)
        )
        job = RenderJob(tuple(source for _, source in picks), dpis, pads, strokes, font, False)
        return job, [formula for formula, _ in picks], [SCHOOL] * size


def render_set(
    data_dir: str | Path,
    out_dir: str | Path,
    count: int,
    seed: int,
    workers: int,
    chunk: int = CHUNK,
    max_minutes: float = 0,
    train_share: float = 0.3,
    append: bool = False,
    fonts: Sequence[str] = (DEFAULT_FONT,),
    long_share: float = 0.0,
) -> dict[str, int]:
    """Write `count` images (fewer if `max_minutes` runs out), formulas.tsv and origins.tsv
    to `out_dir`; `train_share` of the draws are verbatim train formulas, each chunk in
    one of `fonts` (training fonts only); `long_share` of the draws, verbatim or the base
    of a composition, come from the long train formulas alone (`synth.LONG_TOKENS`).

    With `append`, the images join the set already there, named after its last one (give
    a seed the set was not made with, or its formulas come again).
    """
    out = Path(out_dir)
    if append and (out / "formulas.tsv").exists():
        recover_origins(out, data_dir)
    source = FormulaSource(data_dir, train_share, fonts, long_share)
    return _write_set(source, out, count, seed, workers, chunk, max_minutes, append)


def render_school_set(
    data_dir: str | Path,
    out_dir: str | Path,
    count: int,
    seed: int,
    workers: int,
    fonts: Sequence[str] = TRAIN_FONTS,
    chunk: int = CHUNK,
    max_minutes: float = 0,
    append: bool = False,
) -> dict[str, int]:
    """As `render_set`, for the school collection in `data_dir` (see `SchoolSource`)."""
    source = SchoolSource(data_dir, fonts)
    return _write_set(source, Path(out_dir), count, seed, workers, chunk, max_minutes, append)


def _write_set(
    source: FormulaSource | SchoolSource,
    out: Path,
    count: int,
    seed: int,
    workers: int,
    chunk: int,
    max_minutes: float,
    append: bool,
) -> dict[str, int]:
    (out / "images").mkdir(parents=True, exist_ok=True)
    first = 0
    if append and (out / "formulas.tsv").exists():
        names = [name for name, _ in _set_rows(out)]
        first = 1 + max((int(Path(name).stem) for name in names), default=-1)
    stats = {"images": 0, "composed": 0, "train": 0, "failed": 0, "chunks": 0}
    started = time.perf_counter()

    def jobs() -> Iterator[tuple[RenderJob, list[str], list[str]]]:
        index = 0
        while True:
            yield source.job(seed, index, chunk)
            index += 1

    planned = jobs()
    lines, origins = [], []
    with ProcessPoolExecutor(workers) as pool:
        # A few chunks in flight per worker; results are taken in chunk order, so the
        # set depends on the seed only, not on which worker finished first.
        window = []
        for _ in range(2 * workers):
            job, labels, kinds = next(planned)
            window.append((pool.submit(render_job, job), labels, kinds))
        while stats["images"] < count:
            future, labels, kinds = window.pop(0)
            pngs = future.result()
            job, following_labels, following_kinds = next(planned)
            window.append((pool.submit(render_job, job), following_labels, following_kinds))
            stats["chunks"] += 1
            for png, formula, origin in zip(pngs, labels, kinds, strict=True):
                if stats["images"] >= count:
                    break
                if png is None:
                    stats["failed"] += 1
                    continue
                name = f"{first + stats['images']:07d}.png"
                (out / "images" / name).write_bytes(png)
                lines.append(f"{name}\t{formula}\n")
                origins.append(f"{name}\t{origin}\n")
                stats["images"] += 1
                stats["composed" if origin == COMPOSED else "train"] += 1
            elapsed = time.perf_counter() - started
            print(
                f"{stats['images']}/{count} images, {stats['failed']} failed, "
                f"{stats['images'] / elapsed:.1f} images/s",
                flush=True,
            )
            if max_minutes and elapsed > max_minutes * 60:
                break
        for future, _, _ in window:
            future.cancel()
    mode = "a" if first else "w"
    with open(out / "formulas.tsv", mode) as table, open(out / ORIGINS, mode) as origin_table:
        table.write("".join(lines))
        origin_table.write("".join(origins))
    stats["rejected_dev"] = source.rejected_dev
    stats["seconds"] = round(time.perf_counter() - started)
    return stats


def _ink_stats(image: Image.Image) -> tuple[int, int, float, float]:
    """(ink box height, ink box width, ink mass per box pixel, share of near-black ink)."""
    pixels = np.asarray(image.convert("L"), dtype=np.float32)
    ink = pixels < 250
    rows, cols = np.nonzero(ink.any(axis=1))[0], np.nonzero(ink.any(axis=0))[0]
    box = pixels[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    darkness = (255.0 - box).sum() / 255.0 / box.size
    black = float((box < 64).sum() / max(1, (box < 250).sum()))
    return int(box.shape[0]), int(box.shape[1]), float(darkness), black


def calibrate(
    data_dir: str | Path, count: int, dpi: int = BASE_DPI, stroke: int = 1, seed: int = 0
) -> dict[str, float]:
    """Render `count` train formulas at `dpi` and compare with their real images."""
    samples, _ = split_samples(read_formulas(data_dir))
    rng = np.random.default_rng(seed)
    picks = [samples[i] for i in rng.choice(len(samples), count, replace=False)]
    picks = [s for s in picks if renderable(s.formula)]
    pages = render_pages([s.formula for s in picks], [dpi] * len(picks))
    ratios, same_size = [], 0
    real_stats, synth_stats = [], []
    for sample, page in zip(picks, pages, strict=True):
        image = im2markup_image(page, stroke=stroke) if page is not None else None
        if image is None:
            continue
        with Image.open(Path(data_dir) / "images" / sample.name) as real:
            real = real.convert("L")
        if np.asarray(real).min() > 250:
            continue
        a, b = _ink_stats(real), _ink_stats(image)
        real_stats.append(a)
        synth_stats.append(b)
        ratios.append((b[0] / a[0], b[1] / a[1]))
        same_size += real.size == image.size
    r = np.asarray(ratios)
    real_arr, synth_arr = np.asarray(real_stats), np.asarray(synth_stats)
    return {
        "compared": len(ratios),
        "height_ratio_median": float(np.median(r[:, 0])),
        "width_ratio_median": float(np.median(r[:, 1])),
        "height_ratio_p10": float(np.percentile(r[:, 0], 10)),
        "height_ratio_p90": float(np.percentile(r[:, 0], 90)),
        "width_ratio_p10": float(np.percentile(r[:, 1], 10)),
        "width_ratio_p90": float(np.percentile(r[:, 1], 90)),
        "same_image_size": same_size / len(ratios),
        "real_ink_mass": float(real_arr[:, 2].mean()),
        "rendered_ink_mass": float(synth_arr[:, 2].mean()),
        "real_black_share": float(real_arr[:, 3].mean()),
        "rendered_black_share": float(synth_arr[:, 3].mean()),
    }


def _set_rows(set_dir: Path) -> list[tuple[str, str]]:
    """(name, formula) of a set folder, in its order."""
    lines = (set_dir / "formulas.tsv").read_text().splitlines()
    return [(name, formula) for name, formula in (line.split("\t", 1) for line in lines)]


def recover_origins(set_dir: str | Path, data_dir: str | Path) -> None:
    """Write origins.tsv for a set rendered before it was recorded: a formula is verbatim
    when it is a train-split formula, the test `FormulaSource.draw` makes too."""
    set_dir = Path(set_dir)
    if (set_dir / ORIGINS).exists():
        return
    train, _ = split_samples(read_formulas(data_dir))
    train_formulas = {s.formula for s in train}
    lines = (
        f"{name}\t{VERBATIM if formula in train_formulas else COMPOSED}\n"
        for name, formula in _set_rows(set_dir)
    )
    (set_dir / ORIGINS).write_text("".join(lines))


def read_origins(set_dir: str | Path) -> dict[str, str]:
    """Image name -> VERBATIM or COMPOSED, from a set's origins.tsv."""
    lines = (Path(set_dir) / ORIGINS).read_text().splitlines()
    return dict(line.split("\t", 1) for line in lines)


def pack_order(origins: Sequence[str], verbatim_share: float) -> list[int]:
    """Indices of a set's images in the order a size cap keeps them (it cuts from the end).

    Set order, except that a verbatim train formula comes only while it keeps every
    prefix at most `verbatim_share` verbatim; the ones left over are not packed. Those
    have real images already, drawn by the same renderer; compositions are new.
    """
    if verbatim_share >= 1:
        return list(range(len(origins)))
    verbatim = deque(i for i, origin in enumerate(origins) if origin == VERBATIM)
    composed = deque(i for i, origin in enumerate(origins) if origin != VERBATIM)
    order: list[int] = []
    taken = 0  # verbatim ones in `order`
    while verbatim or composed:
        # The tolerance lets a share such as 0.15 x 20 count as the 3 it is.
        if verbatim and taken + 1 <= verbatim_share * (len(order) + 1) + 1e-9:
            order.append(verbatim.popleft())
            taken += 1
        elif composed:
            order.append(composed.popleft())
        else:
            break
    return order


def pack(
    set_dir: str | Path, archive: str | Path, max_bytes: int = 0, verbatim_share: float = 1.0
) -> int:
    """Pack a rendered set into one archive: `.lvl.xz` (see `_write_levels`) or else a
    `.tar.xz` (`rendered/formulas.tsv`, `rendered/images/`).

    With `verbatim_share` below 1, at most that share of the packed images are verbatim
    train formulas (see `pack_order`; the set needs its origins.tsv). With `max_bytes`,
    images are cut from the end of that order until the archive fits (in one pass for a
    `.lvl.xz`, whose last few images are then the smallest of its last, short block).
    Returns the number of images packed.
    """
    set_dir, archive = Path(set_dir), Path(archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    rows = _set_rows(set_dir)
    if verbatim_share < 1:
        origins = read_origins(set_dir)
        rows = [rows[i] for i in pack_order([origins[name] for name, _ in rows], verbatim_share)]
    keep = len(rows)
    if archive.name.endswith(LEVELS_SUFFIX):
        images = [_png_levels((set_dir / "images" / name).read_bytes()) for name, _ in rows]
        while True:  # one pass, unless xz held back more than LEVEL_LAG at the end
            size, packed = _write_levels(archive, rows[:keep], images[:keep], max_bytes)
            if not max_bytes or size <= max_bytes:
                return packed
            keep = int(packed * max_bytes / size * 0.995)
    while True:
        size = _write_tar(set_dir, archive, rows[:keep])
        if not max_bytes or size <= max_bytes:
            return keep
        keep = int(keep * max_bytes / size * 0.998)


def _write_tar(set_dir: Path, archive: Path, rows: Sequence[tuple[str, str]]) -> int:
    """Write a `.tar.xz` of `rows`' PNGs; returns its size."""
    with lzma.open(archive, "wb", preset=9) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        table = "".join(f"{name}\t{formula}\n" for name, formula in rows).encode()
        add_bytes(tar, "rendered/formulas.tsv", table)
        for name, _ in rows:
            tar.add(set_dir / "images" / name, f"rendered/images/{name}")
    return archive.stat().st_size


def _png_levels(png: bytes) -> np.ndarray:
    """A quantized PNG's gray levels (0-15) as uint8 [height, width]."""
    gray = _png_gray(png)
    if np.any(gray % LEVEL_STEP):
        raise ValueError("the image has gray values other than quantized_png's 16 levels")
    return gray // LEVEL_STEP


def _by_shape(shapes: Sequence[tuple[int, int]], start: int, stop: int) -> list[int]:
    """Indices start..stop-1 by height, then width (stable): the pixels' order in a block."""
    return sorted(range(start, stop), key=lambda i: shapes[i])


def _index_bytes(rows: Sequence[tuple[str, str]], images: Sequence[np.ndarray]) -> bytes:
    lines = (
        f"{name}\t{image.shape[0]}\t{image.shape[1]}\t{formula}\n"
        for (name, formula), image in zip(rows, images, strict=True)
    )
    return "".join(lines).encode()


def _write_levels(
    archive: Path, rows: Sequence[tuple[str, str]], images: Sequence[np.ndarray], max_bytes: int
) -> tuple[int, int]:
    """Write a `.lvl.xz`, one xz stream of:

        TEXEL-LEVELS 1
        <pixels>
        <name> TAB <height> TAB <width> TAB <formula>      (a line an image, pack order)
        blocks <count> <count> ...
        <bytes of the lines above, 20 digits>

    The pixels are each image's gray levels (0-15), one byte each, column by column. The
    pack order is cut into blocks (LEVEL_BLOCK images, fewer as `max_bytes` nears) and a
    block's pixels come by shape (`_by_shape`). With `max_bytes`, the pass stops before
    an image that might not fit, so the last block can keep only its first images in
    pixel order. Returns the archive's size and the number of images in it.
    """
    shapes = [image.shape for image in images]
    # The index comes last; its share of the cap is reserved from the start.
    index_share = len(lzma.compress(_index_bytes(rows, images))) / len(rows) if max_bytes else 0
    lag = min(LEVEL_LAG, max_bytes // 100)
    compressor = lzma.LZMACompressor(format=lzma.FORMAT_XZ, filters=LEVEL_FILTERS)
    kept: list[int] = []
    blocks: list[int] = []
    with open(archive, "wb") as out:
        written = out.write(compressor.compress(LEVELS_MAGIC))
        start = 0
        while start < len(rows):
            size = LEVEL_BLOCK
            if max_bytes and kept:  # about half of what still fits, at the rate so far
                room = max_bytes - written - lag - index_share * len(kept)
                size = int(room / 2 / (written / len(kept) + index_share))
                size = min(LEVEL_BLOCK, max(LEVEL_MIN_BLOCK, size))
            fed = 0
            for i in _by_shape(shapes, start, min(start + size, len(rows))):
                room = max_bytes - written - lag - index_share * (len(kept) + 1)
                if max_bytes and room < 0:
                    break
                written += out.write(compressor.compress(images[i].T.tobytes()))
                kept.append(i)
                fed += 1
            if fed:
                blocks.append(fed)
            if fed < size:
                break
            start += size
        kept.sort()
        index = _index_bytes([rows[i] for i in kept], [images[i] for i in kept])
        index += f"blocks {' '.join(map(str, blocks))}\n".encode()
        written += out.write(compressor.compress(index + f"{len(index):020d}\n".encode()))
        written += out.write(compressor.flush())
    return written, len(kept)


def _read_levels(path: Path) -> list[tuple[np.ndarray, str]]:
    with lzma.open(path) as stream:
        data = stream.read()
    if not data.startswith(LEVELS_MAGIC):
        raise ValueError(f"{path} is not a rendered set ({LEVELS_SUFFIX})")
    index_end = len(data) - 21
    index_start = index_end - int(data[index_end:])
    *lines, block_line = data[index_start:index_end].decode().splitlines()
    shapes, formulas = [], []
    for line in lines:
        _, height, width, formula = line.split("\t", 3)
        shapes.append((int(height), int(width)))
        formulas.append(formula)
    count = index_start - len(LEVELS_MAGIC)
    levels = np.frombuffer(data, dtype=np.uint8, count=count, offset=len(LEVELS_MAGIC))
    images: list[np.ndarray] = [np.empty(0, np.uint8)] * len(lines)
    first = offset = 0
    for size in map(int, block_line.split()[1:]):
        for i in _by_shape(shapes, first, first + size):
            height, width = shapes[i]
            columns = levels[offset : offset + height * width].reshape(width, height)
            images[i] = np.multiply(columns.T, np.uint8(LEVEL_STEP), order="C")
            offset += height * width
        first += size
    if first != len(lines) or offset != levels.size:
        raise ValueError(f"{path}: the index does not account for the pixels")
    return list(zip(images, formulas, strict=True))


def read_rendered(path: str | Path) -> list[tuple[np.ndarray, str]]:
    """(gray image as uint8 [height, width], formula) of a rendered set: its folder, its
    `.lvl.xz` or its `.tar.xz`, in the set's order."""
    path = Path(path)
    if path.is_dir():
        return [
            (_png_gray((path / "images" / name).read_bytes()), formula)
            for name, formula in _set_rows(path)
        ]
    if path.name.endswith(LEVELS_SUFFIX):
        return _read_levels(path)
    files: dict[str, bytes] = {}
    with tarfile.open(path, "r:*") as tar:
        for member in tar:
            if member.isfile():
                handle = tar.extractfile(member)
                assert handle is not None
                files[member.name] = handle.read()
    table = next(name for name in files if name.endswith("formulas.tsv"))
    root = table[: -len("formulas.tsv")]
    rows = (line.split("\t", 1) for line in files[table].decode().splitlines())
    return [(_png_gray(files[f"{root}images/{name}"]), formula) for name, formula in rows]


def _png_gray(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("L"))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/im2latex-val", help="im2latex-val folder")
    parser.add_argument(
        "--school",
        default="",
        help="render this school-maths collection's train formulas instead (k12-formulas folder)",
    )
    parser.add_argument(
        "--fonts",
        default="",
        help=f"comma-separated font setups, one per chunk at random (training ones: "
        f"{', '.join(TRAIN_FONTS)}; default cm, or all of them with --school)",
    )
    parser.add_argument("--out", help="folder for images/ and formulas.tsv")
    parser.add_argument("--count", type=int, default=1000, help="images to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="rendering processes")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="formulas per LaTeX document")
    parser.add_argument(
        "--max-minutes", type=float, default=0, help="stop early after this long (0 = no limit)"
    )
    parser.add_argument(
        "--train-share", type=float, default=0.3, help="share of verbatim train formulas drawn"
    )
    parser.add_argument(
        "--long-share",
        type=float,
        default=0.0,
        help="share of draws from the long train formulas alone (at least "
        f"{LONG_TOKENS} tokens; im2latex sets only)",
    )
    parser.add_argument(
        "--append", action="store_true", help="add to the set in --out (give it a new --seed)"
    )
    parser.add_argument(
        "--pack",
        default="",
        help=f"also pack the set into this archive: {LEVELS_SUFFIX} (compact) or .tar.xz (PNGs)",
    )
    parser.add_argument(
        "--verbatim-share",
        type=float,
        default=1.0,
        help="most share of verbatim train formulas in the packed set (1 = as rendered)",
    )
    parser.add_argument(
        "--pack-max-mb", type=float, default=0, help="cut the packed set to fit (MB, 10^6 bytes)"
    )
    parser.add_argument(
        "--calibrate",
        type=int,
        default=0,
        help="only compare N train formulas rendered here with their real images",
    )
    args = parser.parse_args(argv)

    if args.calibrate:
        for stroke in (0, 1):
            figures = calibrate(args.data, args.calibrate, BASE_DPI, stroke)
            print(f"stroke {stroke}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
        return
    if not args.out:
        parser.error("--out is required")
    default_fonts = TRAIN_FONTS if args.school else (DEFAULT_FONT,)
    fonts = tuple(f for f in args.fonts.split(",") if f) or default_fonts
    try:
        training_fonts(fonts)
    except ValueError as error:
        parser.error(str(error))
    if args.count and args.school:
        stats = render_school_set(
            args.school,
            args.out,
            args.count,
            args.seed,
            args.workers,
            fonts,
            args.chunk,
            args.max_minutes,
            args.append,
        )
    elif args.count:
        stats = render_set(
            args.data,
            args.out,
            args.count,
            args.seed,
            args.workers,
            args.chunk,
            args.max_minutes,
            args.train_share,
            args.append,
            fonts,
            args.long_share,
        )
    if args.count:
        print(
            f"{stats['images']} images ({stats['train']} train formulas, {stats['composed']} "
            f"compositions) in {stats['seconds']} s; {stats['failed']} formulas did not "
            f"compile; {stats['rejected_dev']} dev formulas drawn and rejected",
            flush=True,
        )
    if args.pack:
        started = time.perf_counter()
        if not args.school:
            recover_origins(args.out, args.data)
        packed = pack(args.out, args.pack, int(args.pack_max_mb * 1e6), args.verbatim_share)
        size = Path(args.pack).stat().st_size
        print(
            f"{args.pack}: {packed} images, {size / 1e6:.2f} MB, {size / packed:.0f} bytes "
            f"an image, in {time.perf_counter() - started:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
