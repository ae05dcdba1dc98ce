"""The recall check: train and dev formulas drawn by LaTeX in one font, read by the model."""

from __future__ import annotations

from tests.backends import needs_latex
from training.formula import recall
from training.formula.data import is_dev

FORMULAS = [r"x + y", r"\frac { a } { b }", r"a ^ { 2 } - b", r"\sqrt { x }", r"x _ { 1 } = 0"]


@needs_latex
def test_a_formula_latex_cannot_draw_is_left_out() -> None:
    pictures = recall.drawn([r"x + y", r"\frac { a", r"a ^ { 2 }"], "sans")
    assert [formula for formula, _ in pictures] == [r"x + y", r"a ^ { 2 }"]
    assert all(png.startswith(b"\x89PNG") for _, png in pictures)


@needs_latex
def test_both_splits_are_drawn_and_read(tmp_path, capsys) -> None:
    from training.tiny import build_tiny_formula_model

    # Names chosen so that each split gets three formulas of its own.
    names = [f"{i}.png" for i in range(100)]
    train = [n for n in names if not is_dev(n)][:3]
    dev = [n for n in names if is_dev(n)][:3]
    rows = zip(train + dev, FORMULAS[:3] + FORMULAS[2:], strict=True)
    (tmp_path / "formulas.tsv").write_text("".join(f"{n}\t{f}\n" for n, f in rows))
    model = build_tiny_formula_model(tmp_path / "model")

    recall.main(
        ["--data", str(tmp_path), "--model", str(model), "--font", "sans", "--count", "2"]
        + ["--threads", "1", "--batch-size", "2"]
    )

    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].startswith("| formulas (sans) |")
    assert [row.split("|")[1].strip() for row in table[2:]] == ["train split", "dev split"]
    assert all(row.split("|")[2].strip() == "2 of 2" for row in table[2:])
