"""A pre-rendered synthetic formula set, drawn by real LaTeX the way im2latex was made.

    python -m models.formula.latex_render --data ../shared/data/im2latex-val --out .rs \\
        --count 30000 --seed 0 --workers 2 --pack .rs/rs.tar.xz

The im2latex images were rendered by pdflatex in Computer Modern, then cropped to
the ink, padded by 8 px, placed top-left in a fixed-size bucket and downsampled by
2 (the im2markup scripts). This module does the same with `latex` and `dvipng`
(far faster than pdflatex and a PDF rasterizer): one document per chunk of
formulas, one formula per page, and a LaTeX error is traced to its formula
through markers written to the log, so a formula that does not compile is
skipped rather than saved with a garbled picture. Unlike matplotlib's mathtext
(`models.formula.synth`), it draws arrays, `\\\\`, `\\big` and the rest.

The formulas are train-split formulas and new ones composed from them by
`synth.FormulaComposer`; no dev formula is ever written. The set is a folder
`images/*.png` (16-gray-level PNGs, like the carried real images) plus
`formulas.tsv` (`name<TAB>formula`, normalized: what the model should output),
deterministic from the seed, and packs into one `.tar.xz` for a device run.
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
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from models.formula.data import quantized_png, read_formulas, split_samples
from models.formula.synth import FormulaComposer

# im2markup's rendering: article at its default 10pt, display math, no page numbers. amssymb is
# loaded as well since normalized im2latex formulas use its symbols. A glyph
# missing from a font is an error (\tracinglostchars=3) instead of a silent gap.
PREAMBLE = r"""\documentclass{article}
\usepackage{amsmath}
\usepackage{amssymb}
\pagestyle{empty}
\tracinglostchars=3
\begin{document}
"""
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


@dataclass(frozen=True)
class RenderJob:
    """Formulas to draw in one LaTeX document, each with its resolution and padding."""

    formulas: tuple[str, ...]
    dpis: tuple[int, ...]
    pads: tuple[int, ...]
    strokes: tuple[int, ...]


def latex_document(formulas: Sequence[str]) -> str:
    """One page per formula, each between log markers that name its index."""
    pages = [
        f"\\typeout{{{BEGIN_MARK} {i}}}\n\\begin{{displaymath}}\n{formula}\n"
        f"\\end{{displaymath}}\n\\typeout{{{END_MARK} {i}}}\n\\newpage\n"
        for i, formula in enumerate(formulas)
    ]
    return PREAMBLE + "".join(pages) + "\\end{document}\n"


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


def _compile(formulas: Sequence[str], work: Path) -> tuple[Path, set[int], bool]:
    """Run latex on one document of `formulas`: the DVI, the failed indices, and whether
    the log accounts for the whole document (see `failed_formulas`)."""
    tex = work / "f.tex"
    tex.write_text(latex_document(formulas))
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


def render_pages(formulas: Sequence[str], dpis: Sequence[int]) -> list[Image.Image | None]:
    """Each formula drawn by LaTeX at its dpi (uncropped), or None where it does not compile.

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
            dvi, failed, complete = _compile([formulas[i] for i in pending], work)
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
            images = render_pages([formulas[i] for i in half], [dpis[i] for i in half])
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


def im2markup_image(
    page: Image.Image, pad: int = IM2MARKUP_PAD, stroke: int = 1
) -> Image.Image | None:
    """Crop to the ink, pad, place top-left in the smallest bucket, downsample by 2;
    with `stroke` 1 the strokes are thickened first, as calibrated.

    None for a page without ink.
    """
    if stroke:
        page = thicken(page)
    ink = np.asarray(page) < 255
    rows, cols = np.nonzero(ink.any(axis=1))[0], np.nonzero(ink.any(axis=0))[0]
    if rows.size == 0:
        return None
    crop = page.crop((int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1))
    width, height = crop.width + 2 * pad, crop.height + 2 * pad
    bucket = next(
        ((w, h) for w, h in IM2MARKUP_BUCKETS if w >= width and h >= height), (width, height)
    )
    canvas = Image.new("L", bucket, 255)
    canvas.paste(crop, (pad, pad))
    size = (canvas.width // DOWNSAMPLE, canvas.height // DOWNSAMPLE)
    return canvas.resize(size, Image.Resampling.LANCZOS)


def render_job(job: RenderJob) -> list[bytes | None]:
    """The job's formulas as quantized PNGs, None where LaTeX failed."""
    pages = render_pages(job.formulas, job.dpis)
    out: list[bytes | None] = []
    for page, pad, stroke in zip(pages, job.pads, job.strokes, strict=True):
        image = im2markup_image(page, pad, stroke) if page is not None else None
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

    def __init__(self, data_dir: str | Path, train_share: float = 0.3):
        samples = read_formulas(data_dir)
        train, dev = split_samples(samples)
        self.train = [s.formula for s in train]
        self.train_set = frozenset(self.train)
        self.dev = frozenset(s.formula for s in dev)
        self.composer = FormulaComposer(self.train, max_tokens=MAX_TOKENS - 1)
        self.train_share = train_share
        self.rejected_dev = 0

    def draw(self, rng: np.random.Generator) -> tuple[str, bool]:
        """(formula, is_composed); anything equal to a dev formula is drawn again."""
        while True:
            if rng.random() < self.train_share:
                formula = self.train[rng.integers(len(self.train))]
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

    def job(self, seed: int, index: int, size: int) -> tuple[RenderJob, list[bool]]:
        """Chunk `index` of the set made with `seed`: the same formulas wherever it runs."""
        rng = np.random.default_rng([seed, index])
        drawn = [self.draw(rng) for _ in range(size)]
        dpis = tuple(int(d) for d in rng.choice(DPI_CHOICES, size))
        pads = tuple(int(p) for p in rng.choice(PAD_CHOICES, size))
        strokes = tuple(int(s) for s in rng.choice(STROKE_CHOICES, size))
        job = RenderJob(tuple(f for f, _ in drawn), dpis, pads, strokes)
        return job, [c for _, c in drawn]


def render_set(
    data_dir: str | Path,
    out_dir: str | Path,
    count: int,
    seed: int,
    workers: int,
    chunk: int = CHUNK,
    max_minutes: float = 0,
) -> dict[str, int]:
    """Write `count` images (fewer if `max_minutes` runs out) and formulas.tsv to `out_dir`."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    source = FormulaSource(data_dir)
    stats = {"images": 0, "composed": 0, "train": 0, "failed": 0, "chunks": 0}
    started = time.perf_counter()

    def jobs() -> Iterator[tuple[RenderJob, list[bool]]]:
        index = 0
        while True:
            yield source.job(seed, index, chunk)
            index += 1

    planned = jobs()
    lines = []
    with ProcessPoolExecutor(workers) as pool:
        # A few chunks in flight per worker; results are taken in chunk order, so the
        # set depends on the seed only, not on which worker finished first.
        window = []
        for _ in range(2 * workers):
            job, composed = next(planned)
            window.append((pool.submit(render_job, job), job, composed))
        while stats["images"] < count:
            future, job, composed = window.pop(0)
            pngs = future.result()
            following, following_composed = next(planned)
            window.append((pool.submit(render_job, following), following, following_composed))
            stats["chunks"] += 1
            for png, formula, is_composed in zip(pngs, job.formulas, composed, strict=True):
                if stats["images"] >= count:
                    break
                if png is None:
                    stats["failed"] += 1
                    continue
                name = f"{stats['images']:07d}.png"
                (out / "images" / name).write_bytes(png)
                lines.append(f"{name}\t{formula}\n")
                stats["images"] += 1
                stats["composed" if is_composed else "train"] += 1
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
    (out / "formulas.tsv").write_text("".join(lines))
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


def pack(set_dir: str | Path, archive: str | Path, max_bytes: int = 0) -> int:
    """Pack a rendered set into one .tar.xz (`rendered/formulas.tsv`, `rendered/images/`).

    With `max_bytes`, the set is cut (from its end) until the archive fits.
    Returns the number of images packed.
    """
    set_dir, archive = Path(set_dir), Path(archive)
    lines = (set_dir / "formulas.tsv").read_text().splitlines()
    keep = len(lines)
    while True:
        with (
            lzma.open(archive, "wb", preset=9) as xz,
            tarfile.open(fileobj=xz, mode="w") as tar,
        ):
            table = "".join(line + "\n" for line in lines[:keep]).encode()
            _add_bytes(tar, "rendered/formulas.tsv", table)
            for line in lines[:keep]:
                name = line.split("\t", 1)[0]
                tar.add(set_dir / "images" / name, f"rendered/images/{name}")
        size = archive.stat().st_size
        if not max_bytes or size <= max_bytes:
            return keep
        keep = int(keep * max_bytes / size * 0.995)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/im2latex-val", help="im2latex-val folder")
    parser.add_argument("--out", help="folder for images/ and formulas.tsv")
    parser.add_argument("--count", type=int, default=1000, help="images to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="rendering processes")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="formulas per LaTeX document")
    parser.add_argument(
        "--max-minutes", type=float, default=0, help="stop early after this long (0 = no limit)"
    )
    parser.add_argument("--pack", default="", help="also pack the set into this .tar.xz")
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
    if args.count:
        stats = render_set(
            args.data, args.out, args.count, args.seed, args.workers, args.chunk, args.max_minutes
        )
        print(
            f"{stats['images']} images ({stats['train']} train formulas, {stats['composed']} "
            f"compositions) in {stats['seconds']} s; {stats['failed']} formulas did not "
            f"compile; {stats['rejected_dev']} dev formulas drawn and rejected",
            flush=True,
        )
    if args.pack:
        packed = pack(args.out, args.pack, int(args.pack_max_mb * 1e6))
        size = Path(args.pack).stat().st_size
        print(f"{args.pack}: {packed} images, {size / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()


def read_rendered(path: str | Path) -> list[tuple[bytes, str]]:
    """(PNG bytes, formula) of a rendered set: its folder or its packed .tar.xz."""
    path = Path(path)
    if path.is_dir():
        rows = (line.split("\t", 1) for line in (path / "formulas.tsv").read_text().splitlines())
        return [((path / "images" / name).read_bytes(), formula) for name, formula in rows]
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
    return [(files[f"{root}images/{name}"], formula) for name, formula in rows]
