"""Dev-split evaluation of a formula model: BLEU-4, edit distance, exact match, latency.

    python -m training.formula.evaluate --data ../shared/data/im2latex-val \
        --model models/formula/default

Images go through the server's preprocessing and are decoded greedily in
width-sorted batches padded to the server's bucket widths. Scores are computed
on `latex_tokens` (commands, escaped symbols, single characters), so spacing
never counts; where LaTeX is installed, also the share of answers it draws exactly
as their reference (`rendered_identically`). Prints a markdown table.

    python -m training.formula.evaluate --served --variants --limit 120 --threads 2

scores the same formulas once per picture variant (`VARIANTS`: sizes, JPEG, dark
mode, colours, margins, rotation, contrast, a frame, uneven lighting, noise, blur,
transparency, a card on a page), each variant's bytes going through
the server's adapter as an upload would, with the preprocessing time per image.

    python -m training.formula.evaluate --school ../shared/data/k12-formulas --threads 2

scores school maths in several styles (`SCHOOL_STYLES`): 300
formulas drawn at random from the whole school dev split (`school.split_formulas`;
`school_dev`: the same 300 on every run and machine, whatever `--seed`) drawn as typed by LaTeX
in the fonts training never renders (`latex_render.EVAL_FONTS`; left out, with a
message, where `latex` is not installed: unseen styles), by KaTeX in a headless
Chromium, as a web page shows them (a typesetter training never sees; left out where
Playwright or Chromium is missing) and by matplotlib's mathtext (font sets that
training's own renders use too: seen styles), each at an em of
15 and 30 px, dark ink on white, and read through the server's adapter; references and
answers are compared in `school.normalize`'s style. One row per style and size, and
one for all pictures together.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter, ImageOps

from models.devices import resolve_devices, resolve_dtype
from models.formula.preprocess import FormulaImageSpec, FormulaPreprocessor
from training.formula import latex_render, school, synth
from training.formula.data import (
    BUCKET_STEP,
    load_strip,
    load_strips,
    read_formulas,
    server_batch,
    split_samples,
    width_batches,
)
from training.formula.tokenizer import latex_tokens, normalize_spacing


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def corpus_bleu(
    references: Sequence[Sequence[str]], hypotheses: Sequence[Sequence[str]], max_n: int = 4
) -> float:
    """Corpus BLEU (Papineni et al.): clipped 1..max_n-gram precisions, brevity penalty."""
    matches = [0] * max_n
    totals = [0] * max_n
    ref_len = hyp_len = 0
    for ref, hyp in zip(references, hypotheses, strict=True):
        ref_len += len(ref)
        hyp_len += len(hyp)
        for n in range(1, max_n + 1):
            hyp_ngrams = _ngrams(hyp, n)
            ref_ngrams = _ngrams(ref, n)
            matches[n - 1] += sum(min(c, ref_ngrams[g]) for g, c in hyp_ngrams.items())
            totals[n - 1] += max(0, len(hyp) - n + 1)
    if hyp_len == 0 or min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / max_n
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return brevity * math.exp(log_precision)


def edit_distance(a: Sequence[str], b: Sequence[str]) -> int:
    """Levenshtein distance between two token sequences."""
    previous = list(range(len(b) + 1))
    for i, token_a in enumerate(a, start=1):
        current = [i]
        for j, token_b in enumerate(b, start=1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (token_a != token_b))
            )
        previous = current
    return previous[-1]


def normalized_edit_distance(reference: Sequence[str], hypothesis: Sequence[str]) -> float:
    """Edit distance divided by the longer sequence's length (0 = identical, 1 = nothing shared)."""
    longest = max(len(reference), len(hypothesis))
    return 0.0 if longest == 0 else edit_distance(reference, hypothesis) / longest


@dataclass(frozen=True)
class Scores:
    bleu4: float
    edit_distance: float
    exact_match: float
    count: int


def score(references: Sequence[str], hypotheses: Sequence[str]) -> Scores:
    """Token-level scores of hypotheses against references (whitespace ignored)."""
    refs = [latex_tokens(r) for r in references]
    hyps = [latex_tokens(h) for h in hypotheses]
    return Scores(
        bleu4=corpus_bleu(refs, hyps),
        edit_distance=statistics.fmean(
            normalized_edit_distance(r, h) for r, h in zip(refs, hyps, strict=True)
        )
        if refs
        else 0.0,
        exact_match=statistics.fmean(r == h for r, h in zip(refs, hyps, strict=True))
        if refs
        else 0.0,
        count=len(refs),
    )


# The resolution at which `rendered_identically` compares two drawings: a difference it
# cannot see is under a twelfth of a millimetre on paper.
RENDER_DPI = 300


def rendered_identically(
    references: Sequence[str], hypotheses: Sequence[str]
) -> tuple[int, int] | None:
    """How many answers LaTeX draws exactly as their reference, and of how many
    references LaTeX can draw; None where `latex` is not installed.

    Exact match counts `{ \\frac 1 2 }` against `\\frac { 1 } { 2 }` as wrong; a reader
    sees the same formula. So both are drawn by LaTeX in Computer Modern at
    `RENDER_DPI`, cropped to their ink and compared pixel for pixel. An answer equal in
    tokens counts without drawing; one LaTeX cannot draw counts as different.
    """
    if not have_latex():
        return None
    different = [
        i
        for i, (r, h) in enumerate(zip(references, hypotheses, strict=True))
        if latex_tokens(r) != latex_tokens(h)
    ]
    formulas = list(references) + [hypotheses[i] for i in different]
    drawn = [
        None if page is None else latex_render.crop_to_ink(page)
        for page in latex_render.render_pages(formulas, [RENDER_DPI] * len(formulas))
    ]
    answers = dict(zip(different, drawn[len(references) :], strict=True))
    same = drawable = 0
    for i, reference in enumerate(drawn[: len(references)]):
        if reference is None:
            continue
        drawable += 1
        if i not in answers:
            same += 1
            continue
        answer = answers[i]
        same += answer is not None and np.array_equal(np.asarray(reference), np.asarray(answer))
    return same, drawable


def load_model(model_dir: str | Path, device: str = "cpu", dtype: str = "float32"):
    """Model, tokenizer and image spec, loaded the way the server loads them (`dtype` as
    `TEXEL_DTYPE`: auto, float32, float16 or bfloat16)."""
    from transformers import AutoTokenizer, VisionEncoderDecoderModel

    torch_dtype = resolve_dtype(dtype, torch.device(device), torch.bfloat16, torch.bfloat16)
    model = VisionEncoderDecoderModel.from_pretrained(model_dir, dtype=torch_dtype)
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = FormulaImageSpec.from_pretrained(model_dir, channels=model.config.encoder.num_channels)
    return model, tokenizer, spec


@torch.inference_mode()
def recognize(
    model,
    tokenizer,
    spec: FormulaImageSpec,
    strips: Sequence[np.ndarray],
    batch_size: int = 64,
    bucket_step: int = BUCKET_STEP,
) -> list[str]:
    """Greedy transcriptions of strips, in input order, batched as the server batches
    (padded to buckets `bucket_step` px apart)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    max_new_tokens = model.generation_config.max_new_tokens or 256
    out = [""] * len(strips)
    for indices in width_batches([s.shape[1] for s in strips], batch_size):
        pixels = torch.from_numpy(server_batch([strips[i] for i in indices], spec, bucket_step)).to(
            device, dtype
        )
        ids = model.generate(
            pixel_values=pixels, max_new_tokens=max_new_tokens, num_beams=1, do_sample=False
        )
        for i, text in zip(
            indices, tokenizer.batch_decode(ids, skip_special_tokens=True), strict=True
        ):
            out[i] = normalize_spacing(text)
    return out


def served_runner(
    model_dir: str | Path,
    device: str,
    dtype: str,
    batch_size: int,
    bucket_step: int,
    num_beams: int = 1,
):
    """The server's formula adapter loaded and warmed up on `device`, and its batch runner
    (beam search on `generate()` with `num_beams` > 1, as `TEXEL_FORMULA__ADVANCED__NUM_BEAMS`)."""
    from models.formula.adapter import FormulaRecognizer

    # As the server resolves TEXEL_DEVICE: "cuda" is the first GPU, cuda:0, the name its
    # decoder's tensors report.
    target = resolve_devices(device)[0]
    recognizer = FormulaRecognizer(
        str(model_dir), [target], dtype=dtype, bucket_step=bucket_step, num_beams=num_beams
    )
    recognizer.open()
    recognizer.load(target)
    recognizer.warmup(target, batch_size)
    return recognizer, recognizer.runner(target)


def served_latency_ms(
    model_dir: str | Path, dtype: str, image: bytes, bucket_step: int, repeats: int = 10
) -> list[float]:
    """Wall times of one image through the server's adapter on the CPU, decoded alone
    (decoding only, as `single_latency_ms`: no HTTP), after a warm-up."""
    recognizer, run = served_runner(model_dir, "cpu", dtype, 1, bucket_step)
    item = recognizer.preprocess(image)
    run([item], lambda: False)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run([item], lambda: False)
        times.append((time.perf_counter() - start) * 1000)
    return times


def recognize_served(
    model_dir: str | Path,
    device: str,
    dtype: str,
    images: Sequence[bytes],
    batch_size: int = 16,
    bucket_step: int = BUCKET_STEP,
    num_beams: int = 1,
) -> list[str]:
    """Transcriptions of image files, in input order, through the server's own adapter:
    its image decoding, its decoder (the static one where it applies: greedy) in the
    dtype `TEXEL_DTYPE=dtype` gives, batches of similar width as its batcher merges them."""
    recognizer, run = served_runner(model_dir, device, dtype, batch_size, bucket_step, num_beams)
    return transcribe(recognizer, run, recognizer.preprocessor, images, batch_size).latex


@dataclass(frozen=True)
class Transcribed:
    latex: list[str]
    preprocess_ms: list[float]
    confidence: list[float | None]  # as `POST /recognize` answers it


def transcribe(
    recognizer, run, preprocessor: FormulaPreprocessor, images: Sequence[bytes], batch_size: int
) -> Transcribed:
    """Transcriptions of uploads by a loaded recognizer's runner, each upload preprocessed
    by `preprocessor`, the preprocessing wall time of each and the model's confidence."""
    items, times = [], []
    for data in images:
        start = time.perf_counter()
        items.append(preprocessor(data))
        times.append((time.perf_counter() - start) * 1000)
    out = [""] * len(items)
    sure: list[float | None] = [None] * len(items)
    for indices in width_batches([item.width for item in items], batch_size):
        batch = [items[i] for i in indices]
        for i, tokens in zip(indices, run(batch, lambda: False), strict=True):
            out[i], sure[i] = recognizer.detokenize(tokens).latex, tokens.confidence
    return Transcribed(out, times, sure)


def auroc(right: Sequence[float], wrong: Sequence[float]) -> float | None:
    """The chance that a right answer has a higher confidence than a wrong one (ties count
    half): 0.5 says nothing, 1.0 separates them perfectly. None without both kinds."""
    if not right or not wrong:
        return None
    a, b = np.asarray(right)[:, None], np.asarray(wrong)[None, :]
    return float((a > b).mean() + 0.5 * (a == b).mean())


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _resized(image: Image.Image, factor: float) -> Image.Image:
    size = (max(1, round(image.width * factor)), max(1, round(image.height * factor)))
    resample = Image.Resampling.BICUBIC if factor > 1 else Image.Resampling.BOX
    return image.resize(size, resample)


def _recoloured(image: Image.Image, ink: tuple[int, int, int], paper: tuple[int, int, int]):
    """Dark ink drawn as `ink` on `paper`, anti-aliasing kept (a linear map of gray)."""
    coverage = 1.0 - np.asarray(image.convert("L"), dtype=np.float32)[..., None] / 255.0
    rgb = np.asarray(paper, np.float32) + coverage * (
        np.asarray(ink, np.float32) - np.asarray(paper, np.float32)
    )
    return Image.fromarray(np.clip(np.rint(rgb), 0, 255).astype(np.uint8), "RGB")


def _rotated(image: Image.Image, degrees: float) -> Image.Image:
    return image.convert("RGB").rotate(
        degrees, Image.Resampling.BICUBIC, expand=True, fillcolor=(255, 255, 255)
    )


def _framed(image: Image.Image) -> Image.Image:
    """In a thin grey box 12 px from the ink: a screenshot of a bordered panel."""
    framed = ImageOps.expand(image.convert("RGB"), 12, (255, 255, 255))
    ImageDraw.Draw(framed).rectangle(
        (0, 0, framed.width - 1, framed.height - 1), outline=(170, 170, 170)
    )
    return framed


def _on_a_card(image: Image.Image, page: tuple[int, int, int], radius: int) -> Image.Image:
    """On a white card with rounded corners, 16 px of padding, 40 px inside a page of
    another colour: a formula panel in a grey or dark app."""
    card = ImageOps.expand(image.convert("RGB"), 16, (255, 255, 255))
    shape = Image.new("L", card.size, 0)
    ImageDraw.Draw(shape).rounded_rectangle((0, 0, card.width - 1, card.height - 1), radius, 255)
    out = Image.new("RGB", (card.width + 80, card.height + 80), page)
    out.paste(card, (40, 40), shape)
    return out


def _unevenly_lit(image: Image.Image) -> Image.Image:
    """Paper from white at the top left to 50% grey at the bottom right, as a photo under
    a lamp; the ink keeps its darkness."""
    gray = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
    height, width = gray.shape
    light = np.linspace(255.0, 150.0, width)[None, :] * np.linspace(1.0, 0.85, height)[:, None]
    return Image.fromarray(np.clip(gray * light, 0, 255).astype(np.uint8)).convert("RGB")


def _noisy(image: Image.Image, sigma: float) -> Image.Image:
    """Gaussian noise of `sigma` gray levels (the same noise for the same picture)."""
    gray = np.asarray(image.convert("L"), dtype=np.float32)
    noise = np.random.default_rng(0).normal(0.0, sigma, gray.shape)
    return Image.fromarray(np.clip(gray + noise, 0, 255).astype(np.uint8)).convert("RGB")


def _light_on_transparent(image: Image.Image) -> Image.Image:
    """White ink on a transparent background: a formula exported for a dark page."""
    rgba = np.full((image.height, image.width, 4), 255, dtype=np.uint8)
    rgba[..., 3] = 255 - np.asarray(image.convert("L"))
    return Image.fromarray(rgba, "RGBA")


# The pictures of issue 25's table, from an im2latex image (dark ink on white, RGB),
# then more that users send. Larger sizes are bicubic upsamplings, so they are blurrier
# than a real HiDPI render.
VARIANTS = {
    "as rendered": _png,
    "twice the size": lambda im: _png(_resized(im, 2)),
    "three times the size": lambda im: _png(_resized(im, 3)),
    "half the size": lambda im: _png(_resized(im, 0.5)),
    "JPEG quality 55": lambda im: _jpeg(im, 55),
    "dark mode (inverted)": lambda im: _png(ImageOps.invert(im.convert("RGB"))),
    "dark mode, grey on charcoal": lambda im: _png(_recoloured(im, (222, 222, 222), (40, 42, 54))),
    "blue ink": lambda im: _png(_recoloured(im, (20, 60, 200), (255, 255, 255))),
    "tinted background": lambda im: _png(_recoloured(im, (40, 30, 20), (250, 240, 200))),
    "wide margins": lambda im: _png(ImageOps.expand(im.convert("RGB"), 120, (255, 255, 255))),
    "rotated 2°": lambda im: _png(_rotated(im, 2)),
    "low contrast": lambda im: _png(_recoloured(im, (150, 150, 150), (225, 225, 225))),
    "in a box": lambda im: _png(_framed(im)),
    "uneven lighting": lambda im: _png(_unevenly_lit(im)),
    "noise": lambda im: _png(_noisy(im, 14.0)),
    "blurred": lambda im: _png(im.convert("RGB").filter(ImageFilter.GaussianBlur(0.8))),
    "white ink, transparent": lambda im: _png(_light_on_transparent(im)),
    "on a card, grey page": lambda im: _png(_on_a_card(im, (136, 136, 136), 8)),
    "on a card, dark page": lambda im: _png(_on_a_card(im, (30, 32, 40), 12)),
}


def variants_table(
    recognizer,
    run,
    preprocessor: FormulaPreprocessor,
    originals: Sequence[Image.Image],
    references: Sequence[str],
    batch_size: int,
    only: Sequence[str] | None = None,
) -> str:
    """Scores and preprocessing time per picture variant (those named in `only`, else
    every one), as a markdown table."""
    lines = [
        "| picture | BLEU-4 | edit distance | exact | preprocess ms (median / max) "
        "| confidence, median | confidence AUROC |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    pooled: dict[bool, list[float]] = {True: [], False: []}
    for name, make in VARIANTS.items():
        if only and name not in only:
            continue
        uploads = [make(image) for image in originals]
        got = transcribe(recognizer, run, preprocessor, uploads, batch_size)
        s = score(references, got.latex)
        sure = {True: [], False: []}
        for reference, latex, value in zip(references, got.latex, got.confidence, strict=True):
            exact = latex_tokens(latex) == latex_tokens(reference)  # as `score` judges it
            sure[exact].append(0.0 if value is None else value)
        pooled[True] += sure[True]
        pooled[False] += sure[False]
        separation = auroc(sure[True], sure[False])
        times = got.preprocess_ms
        lines.append(
            f"| {name} | {s.bleu4:.3f} | {s.edit_distance:.3f} | {s.exact_match:.1%} "
            f"| {statistics.median(times):.1f} / {max(times):.1f} "
            f"| {statistics.median(sure[True] + sure[False]):.3f} "
            f"| {'-' if separation is None else f'{separation:.3f}'} |"
        )
    separation = auroc(pooled[True], pooled[False])
    if separation is not None:
        lines.append(
            f"\nConfidence AUROC over every picture above: {separation:.3f} (how often an "
            "exact answer is surer than a wrong one)."
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class SchoolStyle:
    """One way of drawing the school evaluation's formulas: a renderer, its font, a size."""

    renderer: str  # "latex" (a font setup of latex_render.FONTS), "katex" or "mathtext"
    font: str  # the LaTeX font setup, "main" (KaTeX's own fonts), or mathtext's math_fontfamily
    em_px: int  # the em (10pt) in pixels of the final picture

    @property
    def name(self) -> str:
        return f"{self.renderer} {self.font}"


SCHOOL_LIMIT = 300
SCHOOL_EMS = (15, 30)
SCHOOL_STYLES = tuple(
    SchoolStyle(renderer, font, em)
    for renderer, fonts in (
        ("latex", latex_render.EVAL_FONTS),
        ("katex", ("main",)),
        ("mathtext", ("cm", "dejavusans")),
    )
    for font in fonts
    for em in SCHOOL_EMS
)
# The margin around the ink, in pixels of the final picture, drawn per formula.
SCHOOL_MARGINS = (4, 6, 8, 12, 16)
SCHOOL_SEED = 0
# Draws which dev formulas the school evaluation reads (`school_dev`); fixed, so that
# every run scores the same sample.
SCHOOL_SAMPLE_SEED = "school-dev-sample-0"


def have_latex() -> bool:
    """Whether `latex` and `dvipng` are installed (the LaTeX styles need both)."""
    import shutil

    return shutil.which("latex") is not None and shutil.which("dvipng") is not None


def have_matplotlib() -> bool:
    """Whether matplotlib is installed (the mathtext styles need it: the `train` extra)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


# KaTeX as Texel's page ships it; the headless Chromium that draws it is found by
# `find_chromium`.
KATEX = Path(__file__).resolve().parents[2] / "app" / "static" / "vendor" / "katex"


def find_chromium() -> str | None:
    """A Chromium to draw the KaTeX styles with: `chromium` on the PATH, or the one
    tests/backends/chromium.sh unpacked (its cache, as that script picks it); None without
    one, or without Playwright to drive it."""
    import importlib.util
    import os
    import shutil

    if importlib.util.find_spec("playwright") is None:
        return None
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    cache = os.environ.get("TEXEL_BACKENDS_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "texel", "backends"
    )
    unpacked = Path(cache, "chromium", "chromium")
    return str(unpacked) if unpacked.is_file() else None


def katex_pictures(sources: Sequence[str], em_px: int, chromium: str) -> list[Image.Image | None]:
    """`sources` typeset by KaTeX (inline style, an em of `em_px`, black on white) in a
    headless `chromium`, one grayscale screenshot each; None where KaTeX refuses one."""
    import tempfile

    from playwright.sync_api import sync_playwright

    page_html = f"""<!doctype html><html><head><meta charset="utf-8">
<link rel="stylesheet" href="{(KATEX / "katex.min.css").as_uri()}">
<script src="{(KATEX / "katex.min.js").as_uri()}"></script>
<style>body {{ margin: 0; background: #fff; color: #000; }}
#f {{ display: inline-block; padding: 8px; }} .katex {{ font-size: {em_px}px; }}</style>
</head><body><div id="f"></div></body></html>"""
    draw = """source => {
        const box = document.getElementById("f");
        try { katex.render(source, box, {throwOnError: true}); return true; }
        catch (error) { box.textContent = ""; return false; }
    }"""
    pictures: list[Image.Image | None] = []
    with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        page_file = Path(folder) / "katex.html"
        page_file.write_text(page_html)
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(device_scale_factor=1)
            page.goto(page_file.as_uri())
            box = page.locator("#f")
            for source in sources:
                if not page.evaluate(draw, source):
                    pictures.append(None)
                    continue
                page.evaluate("document.fonts.ready")  # the glyphs' font files, loaded lazily
                png = box.screenshot()
                pictures.append(Image.open(io.BytesIO(png)).convert("L"))
        finally:
            browser.close()
    return pictures


def _with_margin(ink: Image.Image, margin: int) -> bytes:
    """A PNG of a grayscale picture (ink dark, white paper) cropped to its ink and given
    `margin` px of paper each side; empty bytes for a picture without ink."""
    crop = latex_render.crop_to_ink(ink)
    if crop is None:
        return b""
    canvas = Image.new("L", (crop.width + 2 * margin, crop.height + 2 * margin), 255)
    canvas.paste(crop, (margin, margin))
    return _png(canvas)


def _mathtext_picture(source: str, font: str, em_px: int) -> Image.Image | None:
    """`source` drawn by mathtext in math font family `font`, an em of `em_px`; None when
    mathtext cannot parse it."""
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    return synth.draw_mathtext(f"${source}$", font, em_px)


def school_pictures(
    sources: Sequence[str],
    style: SchoolStyle,
    seed: int = SCHOOL_SEED,
    chromium: str | None = None,
) -> list[bytes | None]:
    """PNGs of formulas (as typed) in `style`, each with a margin drawn from `seed`; None
    where the renderer cannot draw one (a LaTeX error, a KaTeX or mathtext parse error).
    The KaTeX style needs `chromium` (`find_chromium`)."""
    rng = np.random.default_rng(seed)
    margins = [int(m) for m in rng.choice(SCHOOL_MARGINS, len(sources))]
    if style.renderer == "latex":
        # 10pt at this resolution, then latex_render's downsampling by 2, is an em of em_px.
        dpi = round(style.em_px * latex_render.DOWNSAMPLE * 72.27 / 10)
        pages = latex_render.render_pages(sources, [dpi] * len(sources), style.font)
        pictures = [
            latex_render.screen_image(page, 0, stroke=0) if page is not None else None
            for page in pages
        ]
    elif style.renderer == "katex":
        if chromium is None:
            raise ValueError("the KaTeX style needs a Chromium (find_chromium)")
        pictures = katex_pictures(sources, style.em_px, chromium)
    else:
        pictures = [_mathtext_picture(source, style.font, style.em_px) for source in sources]
    out: list[bytes | None] = []
    for picture, margin in zip(pictures, margins, strict=True):
        png = _with_margin(picture, margin) if picture is not None else b""
        out.append(png or None)
    return out


def school_table(
    rows: Sequence[tuple[SchoolStyle, Sequence[str], Sequence[str]]], asked: int
) -> str:
    """A markdown table of (style, references, answers) rows, compared in `school.normalize`'s
    style, and of all of them together; `asked` is how many formulas each style was given."""
    lines = [
        "| style | em | drawn | BLEU-4 | edit distance | exact |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    every_ref: list[str] = []
    every_hyp: list[str] = []

    def line(name: str, em: str, refs: Sequence[str], hyps: Sequence[str], of: int) -> str:
        s = score([school.normalize(r) for r in refs], [school.normalize(h) for h in hyps])
        return (
            f"| {name} | {em} | {s.count}/{of} | {s.bleu4:.3f} | {s.edit_distance:.3f} "
            f"| {s.exact_match:.1%} |"
        )

    for style, refs, hyps in rows:
        lines.append(line(style.name, f"{style.em_px} px", refs, hyps, asked))
        every_ref += refs
        every_hyp += hyps
    lines.append(line("all", "", every_ref, every_hyp, asked * len(rows)))
    return "\n".join(lines)


def school_dev(
    data_dir: str | Path, limit: int = SCHOOL_LIMIT, seed: str = SCHOOL_SAMPLE_SEED
) -> list[tuple[str, str]]:
    """(normalized formula, as typed) of `limit` school dev formulas drawn at random from
    the whole dev split, in the order drawn.

    `formulas.txt` is sorted by its text, so its first dev formulas would be nearly all
    intervals and coordinates. Each formula's place in the draw is the md5 of `seed` and
    the formula: the same sample on every run, machine and library version, independent
    of the split's own hash, and a smaller `limit` takes the first of the same draw."""
    _, dev = school.split_formulas(school.read_formulas(data_dir))
    sources = latex_render.school_sources(data_dir)

    def place(formula: str) -> str:
        return hashlib.md5(f"{seed}\n{formula}".encode()).hexdigest()

    return [(formula, sources[formula]) for formula in sorted(dev, key=place)[:limit]]


def school_evaluation(
    recognizer,
    run,
    preprocessor: FormulaPreprocessor,
    data_dir: str | Path,
    batch_size: int,
    limit: int = SCHOOL_LIMIT,
    styles: Sequence[SchoolStyle] = SCHOOL_STYLES,
    seed: int = SCHOOL_SEED,
) -> str:
    """The school evaluation's table (see `school_table`) for a loaded recognizer; the
    styles of a renderer that is not installed are left out, with a line saying so."""
    formulas = school_dev(data_dir, limit)
    skipped = {}
    if not have_latex():
        skipped["latex"] = (
            "LaTeX styles skipped: `latex` and `dvipng` are not installed "
            "(apt-get install texlive-latex-extra texlive-fonts-extra dvipng)."
        )
    chromium = find_chromium()
    if chromium is None:
        skipped["katex"] = (
            "KaTeX styles skipped: they need Playwright (pip install -e '.[dev]') and a "
            "Chromium (`chromium` on the PATH, or bash tests/backends/chromium.sh)."
        )
    if not have_matplotlib():
        skipped["mathtext"] = (
            "mathtext styles skipped: matplotlib is not installed (pip install -e '.[train]')."
        )
    notes = [
        note for renderer, note in skipped.items() if any(s.renderer == renderer for s in styles)
    ]
    styles = [style for style in styles if style.renderer not in skipped]
    rows = []
    for style in styles:
        pictures = school_pictures([source for _, source in formulas], style, seed, chromium)
        drawn = [(f, p) for (f, _), p in zip(formulas, pictures, strict=True) if p is not None]
        uploads = [p for _, p in drawn]
        hypotheses = transcribe(recognizer, run, preprocessor, uploads, batch_size).latex
        rows.append((style, [f for f, _ in drawn], hypotheses))
    return "\n".join([*notes, school_table(rows, len(formulas))])


@torch.inference_mode()
def single_latency_ms(
    model, spec: FormulaImageSpec, strip: np.ndarray, repeats: int = 10
) -> list[float]:
    """Wall times of greedy recognition of one strip, batch of one, after a warm-up."""
    max_new_tokens = model.generation_config.max_new_tokens or 256
    pixels = torch.from_numpy(server_batch([strip], spec)).to(model.dtype)
    model.generate(pixel_values=pixels, max_new_tokens=max_new_tokens, num_beams=1, do_sample=False)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.generate(
            pixel_values=pixels, max_new_tokens=max_new_tokens, num_beams=1, do_sample=False
        )
        times.append((time.perf_counter() - start) * 1000)
    return times


def markdown_table(scores: Scores, extra: dict[str, str] | None = None) -> str:
    rows = [
        ("BLEU-4", f"{scores.bleu4:.4f}", "≥ 0.90"),
        ("normalized edit distance", f"{scores.edit_distance:.4f}", "≤ 0.065"),
        ("exact match", f"{scores.exact_match:.2%}", "≥ 45%"),
        ("images (n)", str(scores.count), ""),
    ]
    for name, value in (extra or {}).items():
        rows.append((name, value, ""))
    lines = ["| metric | value | target |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


LENGTH_BINS = (20, 40, 60, 80, 120)


def by_length(references: Sequence[str], hypotheses: Sequence[str]) -> str:
    """Scores per reference length (tokens), as a markdown table: where the errors are."""
    bins: dict[str, tuple[list[str], list[str]]] = {}
    for reference, hypothesis in zip(references, hypotheses, strict=True):
        length = len(latex_tokens(reference))
        low = max([0, *(edge for edge in LENGTH_BINS if edge <= length)])
        high = next((edge for edge in LENGTH_BINS if edge > length), None)
        label = f"{low}-{high - 1}" if high else f"{low}+"
        refs, hyps = bins.setdefault(label, ([], []))
        refs.append(reference)
        hyps.append(hypothesis)
    lines = ["| tokens | n | BLEU-4 | edit distance | exact match |", "|---|---:|---:|---:|---:|"]
    for label in sorted(bins, key=lambda b: int(b.split("-")[0].rstrip("+"))):
        s = score(*bins[label])
        lines.append(
            f"| {label} | {s.count} | {s.bleu4:.3f} | {s.edit_distance:.3f} | {s.exact_match:.1%} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/im2latex-val", help="im2latex-val folder")
    parser.add_argument("--model", default="models/formula/default", help="model directory")
    parser.add_argument("--split", choices=("dev", "train", "all"), default="dev")
    parser.add_argument(
        "--limit", type=int, default=0, help="evaluate only the first N images (0 = all)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--bucket-width",
        type=int,
        default=BUCKET_STEP,
        help="padded widths are multiples of this "
        "(the server's TEXEL_FORMULA__ADVANCED__BUCKET_WIDTH)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "float16", "bfloat16"),
        default="float32",
        help="as TEXEL_DTYPE (auto: what the server picks on this device)",
    )
    parser.add_argument(
        "--served",
        action="store_true",
        help="decode through the server's adapter and decoder, not transformers' generate()",
    )
    parser.add_argument(
        "--beams",
        type=int,
        default=1,
        help="with --served: beam search with this many beams (1: greedy, as served by default)",
    )
    parser.add_argument(
        "--latency", action="store_true", help="also time one typical formula on 2 CPU threads"
    )
    parser.add_argument(
        "--errors", type=int, default=0, help="print this many wrong transcriptions"
    )
    parser.add_argument(
        "--by-length", action="store_true", help="also score by reference length in tokens"
    )
    parser.add_argument(
        "--variants",
        action="store_true",
        help="score every picture variant of VARIANTS through the server's adapter",
    )
    parser.add_argument(
        "--variant",
        action="append",
        choices=list(VARIANTS),
        help="with --variants: only this variant (repeatable; default every one)",
    )
    parser.add_argument(
        "--no-deskew",
        action="store_true",
        help="with --variants: preprocess without levelling tilted pictures (max_skew 0)",
    )
    parser.add_argument(
        "--keep-scale",
        action="store_true",
        help="with --variants: preprocess without bringing pictures to the training scale "
        "(the spec's stroke_width and glyph_height unset), to measure that step",
    )
    parser.add_argument(
        "--school",
        default="",
        help="score school maths in several styles instead: the k12-formulas folder "
        f"(--limit dev formulas drawn at random, default {SCHOOL_LIMIT})",
    )
    parser.add_argument(
        "--seed", type=int, default=SCHOOL_SEED, help="with --school: draws the margins"
    )
    parser.add_argument(
        "--renderers",
        default="",
        help="with --school: only these renderers, comma-separated (latex, katex, mathtext)",
    )
    args = parser.parse_args(argv)
    needed = Path(args.school) / "formulas.txt" if args.school else Path(args.data) / "formulas.tsv"
    if not needed.is_file():
        parser.error(
            f"no {needed}: the evaluation data is not in the repository; give "
            + (
                "--school the k12-formulas folder"
                if args.school
                else "--data the im2latex-val folder"
            )
            + " (training/formula/NOTES.md, 'Data', says what it holds)"
        )
    renderers = args.renderers.split(",") if args.renderers else None
    if renderers and not set(renderers) <= {s.renderer for s in SCHOOL_STYLES}:
        parser.error(f"--renderers: one of latex, katex, mathtext, not {args.renderers!r}")
    if args.beams > 1 and not args.served:
        parser.error("--beams needs --served")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.school:
        recognizer, run = served_runner(
            args.model, args.device, args.dtype, args.batch_size, args.bucket_width
        )
        table = school_evaluation(
            recognizer,
            run,
            recognizer.preprocessor,
            args.school,
            args.batch_size,
            args.limit or SCHOOL_LIMIT,
            [s for s in SCHOOL_STYLES if renderers is None or s.renderer in renderers],
            seed=args.seed,
        )
        print(table)
        return

    samples = read_formulas(args.data)
    train, dev = split_samples(samples)
    chosen = {"dev": dev, "train": train, "all": samples}[args.split]
    if args.limit:
        chosen = chosen[: args.limit]
    images_dir = Path(args.data) / "images"
    if args.variants:
        recognizer, run = served_runner(
            args.model, args.device, args.dtype, args.batch_size, args.bucket_width
        )
        preprocessor = recognizer.preprocessor
        changes = {"stroke_width": None, "glyph_height": None} if args.keep_scale else {}
        changes.update({"max_skew": 0.0} if args.no_deskew else {})
        if changes:
            spec = dataclasses.replace(preprocessor.spec, **changes)
            preprocessor = dataclasses.replace(preprocessor, spec=spec)
        originals = [Image.open(images_dir / s.name).convert("RGB") for s in chosen]
        references = [s.formula for s in chosen]
        print(
            variants_table(
                recognizer, run, preprocessor, originals, references, args.batch_size, args.variant
            )
        )
        return
    model, tokenizer, spec = load_model(args.model, args.device, args.dtype)
    if args.served:  # the server's adapter decodes the image files itself, in the timing
        images = [(images_dir / s.name).read_bytes() for s in chosen]
        start = time.perf_counter()
        hypotheses = recognize_served(
            args.model,
            args.device,
            args.dtype,
            images,
            args.batch_size,
            args.bucket_width,
            args.beams,
        )
    else:
        strips = load_strips(args.data, chosen, spec)
        start = time.perf_counter()
        hypotheses = recognize(model, tokenizer, spec, strips, args.batch_size, args.bucket_width)
    elapsed = time.perf_counter() - start
    references = [s.formula for s in chosen]
    result = score(references, hypotheses)
    extra = {
        "split": args.split,
        "decode time": f"{elapsed:.1f} s on {args.device}, {model.dtype}".replace("torch.", ""),
    }
    if args.beams > 1:
        extra["beams"] = str(args.beams)
    drawn = rendered_identically(references, hypotheses)
    extra["renders identically"] = (
        "not measured: LaTeX is not installed"
        if drawn is None
        else f"{drawn[0] / max(drawn[1], 1):.2%} (of the {drawn[1]} references LaTeX draws)"
    )
    if args.latency:
        torch.set_num_threads(2)
        cpu = torch.device("cpu")
        model = model.to(cpu, resolve_dtype(args.dtype, cpu, torch.bfloat16, torch.bfloat16))
        lengths = [len(r.split()) for r in references]
        typical = int(np.argsort(lengths)[len(lengths) // 2])
        strip = load_strip(images_dir / chosen[typical].name, spec)
        if args.served:
            image = (images_dir / chosen[typical].name).read_bytes()
            times = served_latency_ms(args.model, args.dtype, image, args.bucket_width)
        else:
            times = single_latency_ms(model, spec, strip)
        extra["CPU latency p50, 2 threads"] = (
            f"{statistics.median(times):.0f} ms "
            f"({lengths[typical]} tokens, {strip.shape[1]} px wide)"
        )
    print(markdown_table(result, extra))
    if args.by_length:
        print("\n" + by_length(references, hypotheses))
    if args.errors:
        shown = 0
        for sample, hyp in zip(chosen, hypotheses, strict=True):
            if latex_tokens(hyp) != latex_tokens(sample.formula) and shown < args.errors:
                print(f"\n{sample.name}\n  ref: {sample.formula}\n  hyp: {hyp}")
                shown += 1


if __name__ == "__main__":
    main()
