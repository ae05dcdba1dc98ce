"""The school-maths evaluation: its pictures in unseen styles, its split, its scores."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.backends import ensure_backend, needs_latex, unavailable
from training.formula import evaluate, school
from training.formula.evaluate import SchoolStyle

needs_matplotlib = pytest.mark.skipif(
    not evaluate.have_matplotlib(), reason="matplotlib is not installed (the train extra)"
)

TYPED = [r"f(x)=a \ln x+\frac{1}{2} x^{2}(a>0)", r"\overrightarrow{C B}", r"a+b \geqslant 4"]


def write_school(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / school.FORMULAS_FILE).write_text("".join(f"{line}\n" for line in lines))
    return folder


def ink_height(png: bytes) -> int:
    with Image.open(io.BytesIO(png)) as image:
        return int((np.asarray(image.convert("L")) < 128).any(axis=1).sum())


def test_every_style_is_unseen_by_training():
    from training.formula.latex_render import TRAIN_FONTS

    latex_fonts = {s.font for s in evaluate.SCHOOL_STYLES if s.renderer == "latex"}
    assert latex_fonts and not latex_fonts & set(TRAIN_FONTS)
    assert {s.renderer for s in evaluate.SCHOOL_STYLES} == {"latex", "katex", "mathtext"}


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's Chromium, unpacked as for the browser tests, with Playwright to drive it."""
    launcher = ensure_backend("chromium.sh")
    try:
        import playwright  # noqa: F401
    except ImportError:
        unavailable("playwright is not installed: pip install -e '.[dev]'")
    return str(launcher)


@pytest.mark.timeout(300)
def test_katex_pictures_are_sized_by_their_em_and_a_formula_katex_refuses_is_left_out(
    chromium,
):
    small = evaluate.school_pictures(
        [*TYPED, r"\frac{1}{"], SchoolStyle("katex", "main", 15), seed=3, chromium=chromium
    )
    large = evaluate.school_pictures(
        TYPED[:1], SchoolStyle("katex", "main", 30), seed=3, chromium=chromium
    )
    assert all(small[:3]) and small[3] is None
    assert 1.7 < ink_height(large[0]) / ink_height(small[0]) < 2.3
    with Image.open(io.BytesIO(small[1])) as picture:  # dark ink on white paper
        gray = np.asarray(picture.convert("L"))
    assert gray[0, 0] == 255 and gray.min() < 64


@needs_matplotlib
def test_mathtext_pictures_are_deterministic_and_sized_by_their_em():
    small, large = SchoolStyle("mathtext", "dejavusans", 15), SchoolStyle("mathtext", "cm", 30)
    first = evaluate.school_pictures(TYPED, small, seed=3)
    assert first == evaluate.school_pictures(TYPED, small, seed=3)
    assert all(first)
    ratio = ink_height(evaluate.school_pictures(TYPED[:1], large)[0]) / ink_height(first[0])
    assert 1.6 < ratio < 2.4


@needs_matplotlib
def test_a_formula_the_renderer_cannot_draw_is_left_out():
    pictures = evaluate.school_pictures(
        [r'" m \cdot n<0 "', "x"], SchoolStyle("mathtext", "cm", 15)
    )
    assert pictures[0] is None and pictures[1] is not None


@needs_latex
def test_latex_pictures_in_an_unseen_font_are_sized_by_their_em():
    small = evaluate.school_pictures(TYPED[:2], SchoolStyle("latex", "kp", 15))
    large = evaluate.school_pictures(TYPED[:2], SchoolStyle("latex", "kp", 30))
    assert all(small) and all(large)
    assert 1.7 < ink_height(large[0]) / ink_height(small[0]) < 2.3


def test_the_dev_formulas_are_a_fixed_random_sample_of_the_whole_dev_split(tmp_path):
    lines = [f"x_{{{i}}}+{i}" for i in range(400)]
    dev = [f for f in map(school.normalize, lines) if school.is_dev(f)]
    assert len(dev) > 20, "the fixture needs enough dev formulas"
    data = write_school(tmp_path, lines)
    chosen = evaluate.school_dev(data, limit=10)
    formulas = [formula for formula, _ in chosen]
    assert chosen == evaluate.school_dev(data, limit=10)
    assert len(set(formulas)) == 10 and set(formulas) <= set(dev)
    assert formulas != dev[:10], "not the first of the file"
    assert max(dev.index(f) for f in formulas) > len(dev) // 2, "drawn from the whole split"
    assert [typed for _, typed in chosen] == [
        lines[[*map(school.normalize, lines)].index(f)] for f in formulas
    ]


def test_a_smaller_school_sample_is_the_start_of_the_larger_one(tmp_path):
    data = write_school(tmp_path, [f"x_{{{i}}}+{i}" for i in range(400)])
    assert evaluate.school_dev(data, limit=5) == evaluate.school_dev(data, limit=12)[:5]


def test_the_table_compares_answers_in_the_normalized_style_and_pools_all_rows():
    a, b = SchoolStyle("latex", "kp", 15), SchoolStyle("mathtext", "cm", 30)
    references = [r"\left( x \right) + 1", r"\geqslant 4"]
    table = evaluate.school_table(
        [(a, references, [r"\left(x\right)+1", r"\geqslant 4"]), (b, references[:1], ["y"])],
        asked=2,
    )
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert lines[2].startswith("| latex kp | 15 px | 2/2 | 1.000 | 0.000 | 100.0% |")
    assert lines[3].startswith("| mathtext cm | 30 px | 1/2 |") and lines[3].endswith("| 0.0% |")
    assert lines[4].startswith("| all |  | 3/4 |") and lines[4].endswith("| 66.7% |")


@needs_matplotlib
def test_the_evaluation_reads_every_style_with_a_model_and_says_when_latex_is_missing(
    tmp_path, tiny_models, monkeypatch
):
    data = write_school(tmp_path, [f"x_{{{i}}}+{i}" for i in range(40)])
    recognizer, run = evaluate.served_runner(tiny_models["formula"], "cpu", "float32", 4, 64)
    styles = [SchoolStyle("mathtext", "cm", 15), SchoolStyle("latex", "sans", 15)]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no latex on this PATH
    table = evaluate.school_evaluation(
        recognizer, run, recognizer.preprocessor, data, batch_size=4, limit=3, styles=styles
    )
    lines = table.splitlines()
    assert "LaTeX styles skipped" in lines[0]
    assert lines[3].startswith("| mathtext cm | 15 px | 3/3 |")
    assert lines[4].startswith("| all |  | 3/3 |")
    assert not any("latex sans" in line for line in lines)
