"""The LaTeX style Texel answers in: one way of writing each formula.

The formula model writes im2latex's normalized style: tokens separated by single
spaces, `\\left`/`\\right` joined to their delimiter (`\\left(`). On top of it, commands
that LaTeX defines as another one (`\\let\\to=\\rightarrow`, `\\def\\ne{\\neq}`, the
delimiters `\\lbrace` and `\\{`, the math symbols `\\ast` and `*`) are written in one form,
the one im2latex's train formulas use most: a picture shows the same symbol for both,
so no reader of it could tell which one its author typed. Training labels, answers and
the evaluation's references all go through `ALIASES`, so an answer is never wrong for
choosing the other spelling.

Commands that draw alike but space differently (`\\mid` and `|`, `\\perp` and `\\bot`)
or look different (`\\geqslant` and `\\geq`) are not aliases and stay as written.
"""

from __future__ import annotations

# LaTeX's aliases (fontmath.ltx, latex.ltx, plain TeX), each to the form Texel writes.
ALIASES = {
    r"\ge": r"\geq",
    r"\le": r"\leq",
    r"\ne": r"\neq",
    r"\to": r"\rightarrow",
    r"\gets": r"\leftarrow",
    r"\owns": r"\ni",
    r"\lnot": r"\neg",
    r"\land": r"\wedge",
    r"\lor": r"\vee",
    r"\dag": r"\dagger",
    r"\ddag": r"\ddagger",
    r"\lbrace": r"\{",
    r"\rbrace": r"\}",
    r"\lbrack": "[",
    r"\rbrack": "]",
    r"\vert": "|",
    r"\Vert": r"\|",
    r"\ast": "*",
}
_DELIMITED = (r"\left", r"\right")


def canonical_token(token: str) -> str:
    """`token` in Texel's spelling; a `\\left`/`\\right` token keeps its side."""
    for side in _DELIMITED:
        if token.startswith(side) and token[len(side) :] in ALIASES:
            return side + ALIASES[token[len(side) :]]
    return ALIASES.get(token, token)


def canonical_latex(latex: str) -> str:
    """Space-separated LaTeX in Texel's style: single spaces, aliases in one form."""
    return " ".join(canonical_token(token) for token in latex.split())


def compact_latex(latex: str) -> str:
    """Drop the token-separating spaces except where LaTeX needs them (`\\alpha x`)."""
    tokens = latex.split()
    out = []
    for token in tokens:
        if out and out[-1][-1:].isalpha() and out[-1].startswith("\\") and token[:1].isalpha():
            out.append(" ")
        out.append(token)
    return "".join(out)
