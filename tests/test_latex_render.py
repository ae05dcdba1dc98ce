"""The LaTeX-rendered synthetic set: real renders, failing formulas skipped, no dev formula."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.backends import needs_latex
from training.formula import latex_render, school
from training.formula.data import FormulaSample, is_dev, quantized_png
from training.formula.synth import LONG_TOKENS

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
    assert len(latex_render.read_origins(tmp_path / "a")) == 12
    latex_render.pack(tmp_path / "a", tmp_path / "a.tar.xz")
    assert_same_rows(latex_render.read_rendered(tmp_path / "a.tar.xz"), rows)


@needs_latex
def test_appended_images_are_named_after_the_set_and_keep_it(tmp_path):
    samples = [FormulaSample(f"{i}.png", f) for i, f in enumerate(GOOD * 10)]
    data = write_data(tmp_path / "data", samples)
    latex_render.render_set(data, tmp_path / "a", count=4, seed=3, workers=1, chunk=8)
    before = (tmp_path / "a" / "formulas.tsv").read_text()
    latex_render.render_set(
        data, tmp_path / "a", count=3, seed=4, workers=1, chunk=8, train_share=0, append=True
    )
    after = (tmp_path / "a" / "formulas.tsv").read_text()
    assert after.startswith(before)
    names = [line.split("\t")[0] for line in after.splitlines()]
    assert names == [f"{i:07d}.png" for i in range(7)]
    assert list(latex_render.read_origins(tmp_path / "a")) == names


def assert_same_rows(rows, expected):
    assert [formula for _, formula in rows] == [formula for _, formula in expected]
    for (gray, _), (want, _) in zip(rows, expected, strict=True):
        assert gray.dtype == want.dtype and gray.flags.c_contiguous and np.array_equal(gray, want)


def write_set(folder: Path, origins: list[str], seed: int = 0) -> Path:
    """A set folder as render_set writes it, with noisy quantized images of a few shapes
    (no LaTeX needed): image i's formula is `x _ { i }`."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True)
    formulas, origin_lines = [], []
    for i, origin in enumerate(origins):
        height, width = [(50, 120), (40, 160), (50, 200)][i % 3]
        pixels = np.full((height, width), 255, dtype=np.uint8)
        pixels[8:24, 8 : 8 + width // 2] = rng.integers(0, 16, (16, width // 2)) * 17
        name = f"{i:07d}.png"
        (folder / "images" / name).write_bytes(quantized_png(Image.fromarray(pixels)))
        formulas.append(f"{name}\tx _ {{ {i} }}\n")
        origin_lines.append(f"{name}\t{origin}\n")
    (folder / "formulas.tsv").write_text("".join(formulas))
    (folder / latex_render.ORIGINS).write_text("".join(origin_lines))
    return folder


def test_a_levels_archive_reads_back_like_the_pngs(tmp_path):
    folder = write_set(tmp_path / "set", [latex_render.COMPOSED] * 12)
    assert latex_render.pack(folder, tmp_path / "rs.lvl.xz") == 12
    latex_render.pack(folder, tmp_path / "rs.tar.xz")
    expected = latex_render.read_rendered(folder)
    assert [gray.shape for gray, _ in expected[:3]] == [(50, 120), (40, 160), (50, 200)]
    assert_same_rows(latex_render.read_rendered(tmp_path / "rs.lvl.xz"), expected)
    assert_same_rows(latex_render.read_rendered(tmp_path / "rs.tar.xz"), expected)


def test_a_levels_archive_of_several_blocks_reads_back_in_set_order(tmp_path, monkeypatch):
    # Each block's pixels are stored by shape; the reader puts the images back in order.
    monkeypatch.setattr(latex_render, "LEVEL_BLOCK", 5)
    folder = write_set(tmp_path / "set", [latex_render.COMPOSED] * 12)
    assert latex_render.pack(folder, tmp_path / "rs.lvl.xz") == 12
    expected = latex_render.read_rendered(folder)
    assert_same_rows(latex_render.read_rendered(tmp_path / "rs.lvl.xz"), expected)


def test_a_levels_archive_is_smaller_than_the_tar_of_pngs(tmp_path):
    folder = write_set(tmp_path / "set", [latex_render.COMPOSED] * 12)
    latex_render.pack(folder, tmp_path / "rs.lvl.xz")
    latex_render.pack(folder, tmp_path / "rs.tar.xz")
    assert (tmp_path / "rs.lvl.xz").stat().st_size < (tmp_path / "rs.tar.xz").stat().st_size


@pytest.mark.parametrize("suffix", [".lvl.xz", ".tar.xz"])
def test_a_size_cap_cuts_images_from_the_end_until_the_archive_fits(tmp_path, suffix):
    folder = write_set(tmp_path / "set", [latex_render.COMPOSED] * 30)
    whole = latex_render.pack(folder, tmp_path / f"whole{suffix}")
    cap = (tmp_path / f"whole{suffix}").stat().st_size * 2 // 3
    packed = latex_render.pack(folder, tmp_path / f"rs{suffix}", max_bytes=cap)
    assert 0 < packed < whole
    assert (tmp_path / f"rs{suffix}").stat().st_size <= cap
    rows = latex_render.read_rendered(tmp_path / f"rs{suffix}")
    assert_same_rows(rows, latex_render.read_rendered(folder)[:packed])


def test_every_prefix_of_the_pack_order_keeps_the_verbatim_share():
    origins = [latex_render.VERBATIM] * 10 + [latex_render.COMPOSED] * 20
    order = latex_render.pack_order(origins, 0.25)
    assert sorted(order) == sorted(set(order))
    # 20 compositions allow 6 verbatim formulas (6 of 26); the other 4 are left out.
    assert len(order) == 26
    verbatim = np.cumsum([origins[i] == latex_render.VERBATIM for i in order])
    assert all(v <= 0.25 * n for n, v in enumerate(verbatim, start=1))
    # Each kind keeps its set order.
    assert [i for i in order if i < 10] == list(range(6))
    assert [i for i in order if i >= 10] == list(range(10, 30))


def test_a_verbatim_share_of_one_packs_the_set_as_rendered():
    origins = [latex_render.VERBATIM, latex_render.COMPOSED] * 3
    assert latex_render.pack_order(origins, 1.0) == list(range(6))


def test_pack_keeps_the_verbatim_share_under_a_size_cap(tmp_path):
    origins = [latex_render.VERBATIM] * 15 + [latex_render.COMPOSED] * 15
    folder = write_set(tmp_path / "set", origins)
    latex_render.pack(folder, tmp_path / "whole.lvl.xz")
    cap = (tmp_path / "whole.lvl.xz").stat().st_size // 2
    packed = latex_render.pack(folder, tmp_path / "rs.lvl.xz", max_bytes=cap, verbatim_share=0.2)
    formulas = [f for _, f in latex_render.read_rendered(tmp_path / "rs.lvl.xz")]
    verbatim = [f for f in formulas if int(f.split()[3]) < 15]
    assert len(formulas) == packed and 0 < len(verbatim) <= 0.2 * packed


def test_origins_of_an_older_set_are_recovered_from_the_train_split(tmp_path):
    folder = write_set(tmp_path / "set", [latex_render.COMPOSED] * 4)
    (folder / latex_render.ORIGINS).unlink()
    # The set's formula `x _ { 1 }` is a train formula; the others are not.
    train_name = next(f"{i}.png" for i in range(100) if not is_dev(f"{i}.png"))
    data = write_data(tmp_path / "data", [FormulaSample(train_name, "x _ { 1 }")])
    latex_render.recover_origins(folder, data)
    origins = latex_render.read_origins(folder)
    assert list(origins.values()) == [
        latex_render.COMPOSED,
        latex_render.VERBATIM,
        latex_render.COMPOSED,
        latex_render.COMPOSED,
    ]


# School maths as written in the k12 collection, using what its preamble has to load.
SCHOOL_FORMULAS = [
    r"a+b \geqslant 4 \because x \leqslant 1 \therefore \complement_{U} A=\varnothing",
    r"\boldsymbol{a} \cdot \overrightarrow{C B}=0, \mathscr{F}, \overparen{A B}",
    r"f(x)=a \ln x+\frac{1}{2} x^{2}(a>0) \text { A. } 3 \mathrm{~cm}",
]


def write_school(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / school.FORMULAS_FILE).write_text("".join(f"{line}\n" for line in lines))
    return folder


@needs_latex
def test_every_font_setup_draws_school_maths():
    for font in latex_render.FONTS:
        pages = latex_render.render_pages(SCHOOL_FORMULAS, [100] * 3, font)
        assert all(page is not None for page in pages), font


@needs_latex
def test_font_setups_draw_different_glyphs():
    pages = {
        font: np.asarray(latex_render.render_pages([r"f(x) = a x"], [150], font)[0])
        for font in ("cm", "times", "sans")
    }
    assert pages["cm"].shape != pages["times"].shape or not np.array_equal(
        pages["cm"], pages["times"]
    )
    assert not np.array_equal(pages["cm"], pages["sans"])


def test_training_renders_refuse_the_evaluation_fonts():
    assert set(latex_render.TRAIN_FONTS) | set(latex_render.EVAL_FONTS) == set(latex_render.FONTS)
    assert not set(latex_render.TRAIN_FONTS) & set(latex_render.EVAL_FONTS)
    for font in latex_render.EVAL_FONTS:
        with pytest.raises(ValueError, match="evaluation"):
            latex_render.training_fonts(["cm", font])
    with pytest.raises(ValueError, match="unknown"):
        latex_render.training_fonts(["comic"])


def test_the_school_command_refuses_an_evaluation_font(tmp_path):
    data = write_school(tmp_path / "k12", SCHOOL_FORMULAS)
    with pytest.raises(SystemExit):
        latex_render.main(["--school", str(data), "--fonts", "cm,kp", "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_school_jobs_draw_train_formulas_as_typed_and_label_them_normalized(tmp_path):
    lines = [f"x_{{{i}}}+y \\geqslant {i}" for i in range(80)]
    source = latex_render.SchoolSource(write_school(tmp_path / "k12", lines), ["cm", "times"])
    normalized = {school.normalize(line): line for line in lines}
    assert any(school.is_dev(f) for f in normalized), "the fixture needs some dev formulas"
    job, labels, origins = source.job(seed=5, index=0, size=len(normalized))
    assert job.font in ("cm", "times") and not job.bucket
    assert not any(school.is_dev(label) for label in labels)
    assert [normalized[label] for label in labels] == list(job.formulas)
    # One pass over the train formulas before any comes again.
    train = [f for f in normalized if not school.is_dev(f)]
    assert sorted(labels[: len(train)]) == sorted(train)
    assert origins == [latex_render.SCHOOL] * len(labels)
    assert source.job(seed=5, index=0, size=len(normalized))[1] == labels


@needs_latex
def test_a_school_set_packs_and_reads_back_in_the_training_format(tmp_path):
    data = write_school(tmp_path / "k12", SCHOOL_FORMULAS * 2 + [r"x \undefinedcommand y"])
    stats = latex_render.render_school_set(
        data, tmp_path / "set", count=4, seed=1, workers=1, fonts=["lmodern"], chunk=4
    )
    assert stats["images"] == 4
    rows = latex_render.read_rendered(tmp_path / "set")
    train = {f for f in school.read_formulas(data) if not school.is_dev(f)}
    assert {formula for _, formula in rows} <= train
    latex_render.pack(tmp_path / "set", tmp_path / "set.lvl.xz", max_bytes=10**6)
    assert_same_rows(latex_render.read_rendered(tmp_path / "set.lvl.xz"), rows)


def test_long_share_draws_long_formulas_more_often(tmp_path):
    short = [f"x = {i}" for i in range(40)]
    long = [" ".join(["a", "+"] * 40) + f" {i}" for i in range(4)]
    names = [f"{i}.png" for i in range(300)]
    train_names = [n for n in names if not is_dev(n)][: len(short) + len(long)]
    samples = [FormulaSample(n, f) for n, f in zip(train_names, short + long, strict=True)]
    data = write_data(tmp_path, samples)

    def long_drawn(share: float) -> float:
        source = latex_render.FormulaSource(data, train_share=1.0, long_share=share)
        rng = np.random.default_rng(0)
        drawn = [source.draw(rng)[0] for _ in range(400)]
        return sum(len(f.split()) >= LONG_TOKENS for f in drawn) / len(drawn)

    assert long_drawn(0.0) < 0.2  # 4 of 44 in the pool
    assert 0.47 < long_drawn(0.5) < 0.62  # half from the long ones, plus 4 in 44 of the rest
