"""School mathematics formulas (`../shared/data/k12-formulas`): one normalized style, one split.

The collection's formulas are written the way people type LaTeX (`\\frac{3}{2^{10}}`,
`\\left(x\\right)`, `\\text { A. }`); the model answers in the normalized style of
im2latex: tokens separated by single spaces, one character per token outside commands,
and `\\left`/`\\right` joined to their delimiter (`\\left(`, `\\right\\}`), so that both
data sets teach the model one way of writing a formula. `normalize` makes that style.

The dev split is a pure function of the normalized formula (md5 modulo 10, as for the
im2latex images), so every tool agrees on it; dev formulas are never rendered for training.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

FORMULAS_FILE = "formulas.txt"

# Commands, escaped symbols (`\{`, `\,`) and single characters, as `latex_tokens`.
_TOKEN = re.compile(r"\\[A-Za-z]+|\\.|\S")
_DELIMITED = {r"\left", r"\right"}
# A delimiter word that follows `\left`/`\right` as a command (`\left\langle`).
_DELIMITER_WORDS = {
    r"\langle",
    r"\rangle",
    r"\lbrack",
    r"\rbrack",
    r"\vert",
    r"\Vert",
    r"\{",
    r"\}",
    r"\|",
}


def normalize(formula: str) -> str:
    """`formula` in the model's style: single-space-separated tokens, delimiters joined."""
    tokens = _TOKEN.findall(formula)
    out: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        if (
            token in _DELIMITED
            and following is not None
            and (len(following) == 1 or following in _DELIMITER_WORDS)
        ):
            out.append(token + following)
            i += 2
            continue
        out.append(token)
        i += 1
    return " ".join(out)


def is_dev(formula: str) -> bool:
    """Whether a normalized formula belongs to the dev split (about one in ten)."""
    return int(hashlib.md5(formula.encode()).hexdigest(), 16) % 10 == 0


def read_formulas(data_dir: str | Path) -> list[str]:
    """The collection's formulas, normalized, without duplicates or blanks, in file order."""
    seen: set[str] = set()
    formulas = []
    for line in (Path(data_dir) / FORMULAS_FILE).read_text().splitlines():
        formula = normalize(line)
        if formula and formula not in seen:
            seen.add(formula)
            formulas.append(formula)
    return formulas


def split_formulas(formulas: list[str]) -> tuple[list[str], list[str]]:
    """(train, dev) by `is_dev`."""
    return [f for f in formulas if not is_dev(f)], [f for f in formulas if is_dev(f)]
