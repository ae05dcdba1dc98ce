"""The formula model's tokenization, split and scoring, as specifications."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from models.formula.style import canonical_latex
from training.formula.data import is_dev
from training.formula.evaluate import (
    auroc,
    corpus_bleu,
    edit_distance,
    normalized_edit_distance,
    rendered_identically,
    score,
)
from training.formula.synth import FormulaComposer, mathtext_source
from training.formula.tokenizer import (
    build_tokenizer,
    build_vocabulary,
    encode_formula,
    latex_tokens,
)


def test_latex_tokens_keep_commands_and_escapes_whole():
    assert latex_tokens(r"\frac{1}{2}") == [r"\frac", "{", "1", "}", "{", "2", "}"]
    assert latex_tokens(r"\{ a \} \\ \,x") == [r"\{", "a", r"\}", r"\\", r"\,", "x"]


def test_texels_style_writes_each_latex_alias_one_way():
    assert canonical_latex(r"a \to b \ge \lbrace c \rbrace") == r"a \rightarrow b \geq \{ c \}"
    # A delimiter joined to \left or \right keeps its side.
    assert canonical_latex(r"\left\vert x \right\Vert") == r"\left| x \right\|"
    # Alike on the page but spaced differently, or drawn differently: not aliases.
    assert (
        canonical_latex(r"\mid \perp \bot \geqslant \ldots") == r"\mid \perp \bot \geqslant \ldots"
    )


def test_an_answer_that_spells_an_alias_otherwise_scores_as_its_reference():
    """A picture of `\to` is a picture of `\rightarrow`: choosing either is not an error."""
    same = score([r"f : A \to B ^ { \dag }"], [r"f : A \rightarrow B ^ { \dagger }"])
    assert (same.exact_match, same.edit_distance) == (1.0, 0.0)
    assert score([r"a \mid b"], [r"a | b"]).exact_match == 0.0


def test_training_labels_are_written_in_texels_style():
    tokenizer = build_tokenizer(build_vocabulary([r"a \to \rightarrow b"]))
    assert encode_formula(tokenizer, r"a \to b", 16) == encode_formula(
        tokenizer, r"a \rightarrow b", 16
    )


def test_latex_tokens_ignore_whitespace():
    assert latex_tokens(r"\frac { 1 } { 2 }") == latex_tokens(r"\frac{1}{2}")


def test_latex_tokens_split_multi_letter_words_into_characters():
    assert latex_tokens("sin x") == ["s", "i", "n", "x"]


def test_edit_distance_counts_insertions_deletions_substitutions():
    assert edit_distance(list("kitten"), list("sitting")) == 3
    assert edit_distance([], ["a", "b"]) == 2


def test_normalized_edit_distance_is_zero_for_identical_and_one_for_disjoint():
    assert normalized_edit_distance(["a", "b"], ["a", "b"]) == 0.0
    assert normalized_edit_distance(["a", "b"], ["c", "d"]) == 1.0
    assert normalized_edit_distance([], []) == 0.0


def test_bleu_is_one_for_perfect_hypotheses():
    refs = [list("abcdefg"), list("hijklmnop")]
    assert corpus_bleu(refs, refs) == pytest.approx(1.0)


def test_bleu_penalizes_short_hypotheses():
    refs = [list("abcdefgh")]
    assert corpus_bleu(refs, [list("abcdef")]) == pytest.approx(np.exp(1 - 8 / 6))


def test_bleu_is_zero_without_any_four_gram_match():
    assert corpus_bleu([list("abcd")], [list("dcba")]) == 0.0


def test_score_reports_exact_match_on_tokens_not_spacing():
    result = score([r"\frac { 1 } { 2 }", "a + b"], [r"\frac{1}{2}", "a - b"])
    assert result.exact_match == 0.5
    assert result.count == 2
    assert result.edit_distance == pytest.approx((0 + 1 / 3) / 2)


def test_dev_split_is_a_fixed_tenth_by_name():
    names = [f"{i}.png" for i in range(5000)]
    dev = [n for n in names if is_dev(n)]
    assert 400 < len(dev) < 600
    assert is_dev(dev[0]) and dev == [n for n in names if is_dev(n)]


def test_tokenizer_round_trips_normalized_latex():
    formulas = [r"\frac { 1 } { 2 }", r"x ^ { 2 } + \alpha _ { i } = \{ a \}"]
    tokenizer = build_tokenizer(build_vocabulary(formulas))
    for formula in formulas:
        ids = encode_formula(tokenizer, formula, max_length=64)
        assert ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == formula


def test_tokenizer_maps_unknown_tokens_to_unk():
    tokenizer = build_tokenizer(build_vocabulary(["a + b"]))
    ids = encode_formula(tokenizer, r"a + \beta", max_length=64)
    assert ids[2] == tokenizer.unk_token_id


def test_encode_formula_drops_targets_longer_than_the_limit():
    tokenizer = build_tokenizer(build_vocabulary(["a + b"]))
    assert encode_formula(tokenizer, "a + b", max_length=3) == []


def test_vocabulary_puts_special_tokens_first():
    assert build_vocabulary(["b a"])[:6] == ["<pad>", "<s>", "</s>", "<unk>", "a", "b"]


def test_mathtext_source_removes_spaces_before_scripts_but_not_after_commands():
    rng = np.random.default_rng(0)
    assert mathtext_source(r"x _ { 1 } + \alpha x", rng) == r"$x_{1}+\alpha x$"


def test_swap_scripts_exchanges_contents_keeping_order():
    tokens = ["x", "_", "{", "i", "}", "^", "{", "2", "}"]
    swapped = FormulaComposer.swap_scripts(tokens, np.random.default_rng(0))
    assert " ".join(swapped) == "x _ { 2 } ^ { i }"


def test_rename_variables_is_consistent():
    rng = np.random.default_rng(3)
    renamed = FormulaComposer.rename_variables(["a", "+", "a", "=", "b"], rng)
    assert renamed[0] == renamed[2]


def test_scores_by_length_put_each_formula_in_its_bin() -> None:
    from training.formula.evaluate import by_length

    references = ["a + b", " ".join("x" * 30), " ".join("y" * 130), "c"]
    hypotheses = ["a + b", " ".join("x" * 29), " ".join("y" * 130), "d"]
    rows = by_length(references, hypotheses).splitlines()[2:]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    assert [(c[0], c[1], c[4]) for c in cells] == [
        ("0-19", "2", "50.0%"),
        ("20-39", "1", "0.0%"),
        ("120+", "1", "100.0%"),
    ]


def test_confidence_auroc_is_the_chance_a_right_answer_is_surer_than_a_wrong_one():
    assert auroc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert auroc([0.1], [0.9]) == 0.0
    assert auroc([0.5, 0.9], [0.5, 0.1]) == pytest.approx((1 + 0.5 + 1 + 1) / 4)
    assert auroc([], [0.3]) is None and auroc([0.3], []) is None


@pytest.mark.skipif(
    shutil.which("latex") is None or shutil.which("dvipng") is None,
    reason="latex and dvipng are not installed (apt-get install texlive-latex-base dvipng)",
)
def test_rendered_identically_counts_what_a_reader_sees():
    references = [
        r"{ \frac { 1 } { 2 } } + x",  # braces that draw nothing
        r"\frac 1 2",  # the same fraction without its braces
        r"a + b",
        r"x ^ { 2 }",
        r"\sum _ { i } x _ { i }",
        r"\frac { 1 } { 2",  # LaTeX cannot draw this reference: not counted
    ]
    answers = [
        r"\frac { 1 } { 2 } + x",  # drawn alike
        r"\frac { 1 } { 2 }",  # drawn alike
        r"a - b",  # another formula
        r"x ^ { 2 }",  # equal tokens
        r"\sum _ { i } x _ { i",  # LaTeX cannot draw the answer: different
        r"\frac { 1 } { 2 }",
    ]
    assert rendered_identically(references, answers) == (3, 5)
    assert score(references, answers).exact_match == pytest.approx(1 / 6)


def test_the_servers_answers_are_written_in_texels_style():
    from models.formula.adapter import FormulaRecognizer, FormulaTokens
    from tests.conftest import ROOT

    recognizer = FormulaRecognizer(str(ROOT / "models" / "formula" / "default"), [])
    recognizer.open()
    ids = recognizer.tokenizer.convert_tokens_to_ids(["a", r"\to", r"\left\vert", "b"])
    assert recognizer.detokenize(FormulaTokens(ids, 0.0)).latex == r"a \rightarrow \left| b"
