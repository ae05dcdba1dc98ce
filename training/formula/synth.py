"""Synthetic formula images: new formulas from training formulas, rendered and degraded.

`FormulaComposer` makes new normalized formulas from the training ones (rename
variables, swap sub- and superscript contents, splice terms of two formulas).
`render_formula` draws one with matplotlib's mathtext in a random font set and
size, and `degrade` roughens the picture the way scans, screenshots and
downsampled PDFs do (stroke width, blur, noise, JPEG, rotation, margins). The
result goes through the server's own `prepare_strip`, so a synthetic strip and
a served one are made by the same code. Formulas mathtext cannot parse are
skipped here; they stay in the real-image training set.
"""

from __future__ import annotations

import io
import logging
import os
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter

from models.formula.preprocess import FormulaImageSpec, prepare_strip

# Font sets weighted towards Computer Modern, the face of pdflatex-rendered formulas.
FONTSETS = ("cm", "stix", "dejavuserif", "stixsans", "dejavusans")
FONTSET_WEIGHTS = (0.6, 0.2, 0.1, 0.05, 0.05)

_LOWER = [chr(c) for c in range(ord("a"), ord("z") + 1)]
_UPPER = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
_GREEK = [
    "\\" + name
    for name in [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "kappa",
        "lambda",
        "mu",
        "nu",
        "xi",
        "pi",
        "rho",
        "sigma",
        "tau",
        "phi",
        "chi",
        "psi",
        "omega",
    ]
]
_COMMAND_END = re.compile(r"\\[A-Za-z]+$")
_SPLIT_TOKENS = frozenset({"=", "+", "-", ",", "<", ">", r"\leq", r"\geq", r"\equiv"})


def _group_end(tokens: list[str], start: int) -> int:
    """Index one past the group starting at `start` (a `{...}` block or a single token)."""
    if tokens[start] != "{":
        return start + 1
    depth = 0
    for i in range(start, len(tokens)):
        depth += {"{": 1, "}": -1}.get(tokens[i], 0)
        if depth == 0:
            return i + 1
    return len(tokens)


def _top_level_splits(tokens: list[str]) -> list[int]:
    """Positions of binary operators and commas outside every brace group."""
    depth, splits = 0, []
    for i, token in enumerate(tokens):
        depth += {"{": 1, "}": -1}.get(token, 0)
        if depth == 0 and token in _SPLIT_TOKENS and 0 < i < len(tokens) - 1:
            splits.append(i)
    return splits


# Formulas at least this long are "long" for `FormulaComposer.long_share`: where exact
# match on the dev split falls off (training/formula/NOTES.md, run 22 by length).
LONG_TOKENS = 60


@dataclass
class FormulaComposer:
    """Makes plausible new formulas from a pool of normalized training formulas."""

    formulas: list[str]
    max_tokens: int = 150
    # The share of draws taken from the long formulas alone (at least LONG_TOKENS tokens),
    # for sets that teach long formulas more often than the pool holds them.
    long_share: float = 0.0

    def __post_init__(self) -> None:
        self.long = [f for f in self.formulas if len(f.split()) >= LONG_TOKENS]

    def pick(self, rng: np.random.Generator) -> str:
        """A pool formula: one of the long ones `long_share` of the time, else any."""
        if self.long_share and self.long and rng.random() < self.long_share:
            return self.long[rng.integers(len(self.long))]
        return self.formulas[rng.integers(len(self.formulas))]

    def compose(self, rng: np.random.Generator) -> str:
        """One new formula; an unchanged training formula when the result grows too long."""
        tokens = self.pick(rng).split()
        if rng.random() < 0.3:
            tokens = self.splice(tokens, rng)
        if rng.random() < 0.4:
            tokens = self.rename_variables(tokens, rng)
        if rng.random() < 0.3:
            tokens = self.swap_scripts(tokens, rng)
        if len(tokens) > self.max_tokens:
            return self.formulas[rng.integers(len(self.formulas))]
        return " ".join(tokens)

    def splice(self, tokens: list[str], rng: np.random.Generator) -> list[str]:
        """Head of this formula up to an operator, tail of another from an operator."""
        other = self.formulas[rng.integers(len(self.formulas))].split()
        cuts_a, cuts_b = _top_level_splits(tokens), _top_level_splits(other)
        if not cuts_a or not cuts_b:
            return tokens
        a = cuts_a[rng.integers(len(cuts_a))]
        b = cuts_b[rng.integers(len(cuts_b))]
        return tokens[:a] + other[b:]

    @staticmethod
    def rename_variables(tokens: list[str], rng: np.random.Generator) -> list[str]:
        """Consistently replace some letters (and Greek letters) by others of the same kind."""
        mapping: dict[str, str] = {}
        for alphabet in (_LOWER, _UPPER, _GREEK):
            present = sorted({t for t in tokens if t in alphabet})
            if not present:
                continue
            chosen = [t for t in present if rng.random() < 0.5]
            targets = rng.permutation(alphabet)[: len(chosen)]
            mapping.update(zip(chosen, targets, strict=True))
        # Letters inside \mathrm{...}, \operatorname-like words are renamed too: harmless.
        return [mapping.get(t, t) for t in tokens]

    @staticmethod
    def swap_scripts(tokens: list[str], rng: np.random.Generator) -> list[str]:
        """Exchange the contents of one `_ X ^ Y` (or `^ Y _ X`) pair, keeping the order."""
        candidates = [
            i for i in range(len(tokens) - 1) if tokens[i] in ("_", "^") and i + 1 < len(tokens)
        ]
        rng.shuffle(candidates)
        for i in candidates:
            first_end = _group_end(tokens, i + 1)
            if (
                first_end < len(tokens)
                and tokens[first_end] in ("_", "^")
                and tokens[first_end] != tokens[i]
            ):
                if first_end + 1 >= len(tokens):
                    continue
                second_end = _group_end(tokens, first_end + 1)
                a, b = tokens[i + 1 : first_end], tokens[first_end + 1 : second_end]
                return tokens[: i + 1] + b + [tokens[first_end]] + a + tokens[second_end:]
        return tokens


def mathtext_source(formula: str, rng: np.random.Generator) -> str:
    """The mathtext string that draws `formula` the way pdflatex display math would."""
    # mathtext reads `x _ { 1 }` as an empty-nucleus script, so spaces go, except
    # where they end a command name (`\alpha x`).
    source = ""
    for token in formula.split():
        if token == r"\frac" and rng.random() < 0.85:
            token = r"\dfrac"
        if source and _COMMAND_END.search(source) and token[0].isalpha():
            source += " "
        source += token
    return "$" + source + "$"


_PARSER = None


def render_formula(
    formula: str, rng: np.random.Generator, oversample: float, any_font: bool = False
) -> Image.Image | None:
    """Draw a formula in grayscale (ink dark), `oversample` times the im2latex resolution,
    in a font set weighted towards Computer Modern (or any, equally, with `any_font`).

    Returns None when mathtext cannot parse the formula.
    """
    weights = None if any_font else FONTSET_WEIGHTS
    fontset = FONTSETS[rng.choice(len(FONTSETS), p=weights)]
    # im2latex images have an em of about 15 px; render `oversample` times larger.
    em_px = rng.uniform(12.5, 17.0) * oversample
    return draw_mathtext(mathtext_source(formula, rng), fontset, em_px)


def draw_mathtext(source: str, fontset: str, em_px: float) -> Image.Image | None:
    """A mathtext string (`$...$`) drawn in grayscale, ink dark, in math font family
    `fontset` at an em of `em_px`; None when mathtext cannot parse it or draws nothing."""
    global _PARSER
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.font_manager import FontProperties
    from matplotlib.mathtext import MathTextParser

    if _PARSER is None:
        _PARSER = MathTextParser("agg")
    prop = FontProperties(size=10, math_fontfamily=fontset)
    try:
        raster = _PARSER.parse(source, dpi=em_px * 7.2, prop=prop)
    except Exception:  # mathtext raises ValueError and assorted parse errors
        return None
    ink = np.asarray(raster.image)
    if ink.size == 0 or ink.max() == 0:
        return None
    return Image.fromarray(255 - ink)


def degrade(
    image: Image.Image, rng: np.random.Generator, oversample: float, scale: float = 1.0
) -> Image.Image:
    """Stroke width, rotation, downsampling, blur, contrast, noise and JPEG, each at random.

    The picture ends at `scale` times the im2latex resolution (a screenshot may be
    larger or smaller; the server's preprocessing brings it back to the trained scale).
    """
    pad = int(rng.integers(4, 24))
    canvas = Image.new("L", (image.width + 2 * pad, image.height + 2 * pad), 255)
    canvas.paste(image, (pad, pad))
    image = canvas
    stroke = rng.random()
    if stroke < 0.2:
        image = image.filter(ImageFilter.MinFilter(3))  # thicker ink
    elif stroke < 0.3 and oversample >= 3:
        image = image.filter(ImageFilter.MaxFilter(3))  # thinner ink
    if rng.random() < 0.25:
        image = image.rotate(
            float(rng.uniform(-2.5, 2.5)),
            resample=Image.Resampling.BILINEAR,
            expand=True,
            fillcolor=255,
        )
    # Downsample to the im2latex scale, as im2markup did with its renders.
    factor = oversample * rng.uniform(0.92, 1.08) / scale
    size = (max(1, round(image.width / factor)), max(1, round(image.height / factor)))
    resample = [Image.Resampling.BILINEAR, Image.Resampling.LANCZOS, Image.Resampling.BOX]
    image = image.resize(size, resample[int(rng.integers(len(resample)))])
    if rng.random() < 0.25:
        image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 0.8))))
    pixels = np.asarray(image, dtype=np.float32)
    if rng.random() < 0.5:
        darkness = rng.uniform(0.8, 1.0)
        paper = rng.uniform(240, 255)
        pixels = paper - (255.0 - pixels) * darkness * paper / 255.0
    if rng.random() < 0.3:
        pixels = pixels + rng.normal(0.0, rng.uniform(2.0, 8.0), pixels.shape)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    if rng.random() < 0.3:
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=int(rng.integers(40, 95)))
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("L")
    return image


def picture_scale(rng: np.random.Generator) -> float:
    """How large a synthetic picture ends, relative to im2latex: mostly at its scale, a
    third of the time anywhere from half to two and a half times it (log-uniform)."""
    if rng.random() < 2 / 3:
        return 1.0
    return float(np.exp(rng.uniform(np.log(0.45), np.log(2.5))))


# Per-process state for rendering workers (set by `init_worker`).
_COMPOSER: FormulaComposer | None = None
_SPEC: FormulaImageSpec | None = None
_SCHOOL: list[str] = []
# With school formulas given, the share of renders drawn from them.
SCHOOL_SHARE = 0.5


def init_worker(
    formulas: list[str], spec: FormulaImageSpec, max_tokens: int, school: list[str] = ()
) -> None:
    global _COMPOSER, _SPEC, _SCHOOL
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Missing-glyph warnings from odd formulas would flood the training log.
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    _COMPOSER = FormulaComposer(formulas, max_tokens=max_tokens)
    _SPEC = spec
    _SCHOOL = list(school)


def render_chunk(job: tuple[int, int]) -> list[tuple[np.ndarray, str]]:
    """Render `count` formulas with seed `seed`: a list of (strip, formula).

    Formulas are composed or verbatim training formulas, and with school formulas
    given, `SCHOOL_SHARE` of them school formulas (some with renamed variables) in
    any font set."""
    seed, count = job
    assert _COMPOSER is not None and _SPEC is not None, "call init_worker first"
    rng = np.random.default_rng(seed)
    out = []
    attempts = 0
    while len(out) < count and attempts < 4 * count:
        attempts += 1
        school = bool(_SCHOOL) and rng.random() < SCHOOL_SHARE
        if school:
            tokens = _SCHOOL[rng.integers(len(_SCHOOL))].split()
            if rng.random() < 0.4:
                tokens = FormulaComposer.rename_variables(tokens, rng)
            formula = " ".join(tokens)
        elif rng.random() < 0.7:
            formula = _COMPOSER.compose(rng)
        else:
            formula = _COMPOSER.formulas[rng.integers(len(_COMPOSER.formulas))]
        oversample = float(rng.choice([2.0, 3.0]))
        image = render_formula(formula, rng, oversample, any_font=school)
        if image is None:
            continue
        picture = degrade(image, rng, oversample, picture_scale(rng))
        out.append((prepare_strip(picture, _SPEC), formula))
    return out
