"""The LaTeX-rendered synthetic set: real renders, failing formulas skipped, no dev formula."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.formula import latex_render
from models.formula.data import FormulaSample, is_dev

needs_latex = pytest.mark.skipif(
    shutil.which("latex") is None or shutil.which("dvipng") is None,
    reason="latex and dvipng are not installed (apt-get install texlive-latex-base dvipng)",
)

GOOD = [
    r"E = m c ^ { 2 }",
    r"\left( \begin{array} { c c } { 1 } & { 0 } \\ { 0 } & { 1 } \\ \end{array} \right)",
    r"\frac { a } { b } + \sqrt { x _ { i } }",
]


def write_data(folder: Path, samples: list[FormulaSample]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "formulas.tsv").write_text("".join(f"{s.name}\t{s.formula}\n" for s in samples))
    return folder


@needs_latex
def test_rendered_formulas_have_im2latex_heights():
    pages = latex_render.render_pages(GOOD, [latex_render.BASE_DPI] * len(GOOD))
    images = [latex_render.im2markup_image(page) for page in pages]
    # Short formulas land in im2latex's smallest bucket, 120 x 50 after downsampling.
    assert [image.size for image in images] == [(120, 50)] * 3
    # Ink heights as in the real images: a line of capitals with a superscript is about
    # 14 px, a fraction about 27 px, a two-row matrix in parentheses about 35 px.
    ink_heights = [int((np.asarray(image) < 250).any(axis=1).sum()) for image in images]
    for height, (low, high) in zip(ink_heights, [(12, 17), (31, 40), (23, 31)], strict=True):
        assert low <= height <= high


@needs_latex
def test_a_broken_formula_is_skipped_and_its_chunk_still_renders():
    formulas = [GOOD[0], r"\frac { 1", GOOD[2], r"x \undefinedcommand y"]
    pages = latex_render.render_pages(formulas, [latex_render.BASE_DPI] * len(formulas))
    assert pages[1] is None
    assert pages[3] is None
    assert pages[0] is not None and pages[2] is not None


@needs_latex
def test_an_error_that_stops_latex_costs_only_its_formula():
    # `\label` in display math ends the whole document with an emergency stop.
    formulas = [GOOD[0], r"x = 1 { \label A }", GOOD[2]]
    pages = latex_render.render_pages(formulas, [latex_render.BASE_DPI] * len(formulas))
    assert [page is not None for page in pages] == [True, False, True]


def test_dev_formulas_are_never_drawn(tmp_path):
    names = [f"{i}.png" for i in range(60)]
    dev_names = [n for n in names if is_dev(n)]
    assert dev_names, "the fixture needs some dev names"
    samples = [FormulaSample(n, f"x _ {{ {i} }} + y = {i}") for i, n in enumerate(names)]
    # A train formula identical to a dev one must not be drawn either.
    dev_formula = next(s.formula for s in samples if is_dev(s.name))
    train_name = next(n for n in (f"{i}.png" for i in range(60, 200)) if not is_dev(n))
    samples.append(FormulaSample(train_name, dev_formula))
    source = latex_render.FormulaSource(write_data(tmp_path, samples))
    dev_formulas = {s.formula for s in samples if is_dev(s.name)}
    rng = np.random.default_rng(0)
    drawn = {source.draw(rng)[0] for _ in range(500)}
    assert not drawn & dev_formulas
    assert source.rejected_dev > 0


@needs_latex
def test_render_set_writes_images_and_formulas_deterministically(tmp_path):
    samples = [FormulaSample(f"{i}.png", f) for i, f in enumerate(GOOD * 10)]
    data = write_data(tmp_path / "data", samples)
    sets = []
    for out in ("a", "b"):
        stats = latex_render.render_set(data, tmp_path / out, count=12, seed=3, workers=1, chunk=8)
        assert stats["images"] == 12
        sets.append((tmp_path / out / "formulas.tsv").read_text())
    assert sets[0] == sets[1]
    rows = latex_render.read_rendered(tmp_path / "a")
    assert len(rows) == 12
    with Image.open(tmp_path / "a" / "images" / "0000000.png") as image:
        assert image.mode == "P" and len(image.getcolors()) <= 16
    latex_render.pack(tmp_path / "a", tmp_path / "a.tar.xz")
    assert latex_render.read_rendered(tmp_path / "a.tar.xz") == rows
