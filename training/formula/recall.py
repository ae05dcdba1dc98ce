"""How much better the formula model reads formulas it was trained on than new ones.

    python -m training.formula.recall --data ../shared/data/im2latex-val --font utopia

The first `--count` formulas of the train split and of the dev split are drawn by LaTeX
the way im2markup drew im2latex (10pt, 200 dpi, halved), in one font setup, and read
through the server's preprocessing. In a font that training never renders (`utopia`,
`kp`, `sans`) no picture is one the model has seen, so a model that had only learned to
read would score both alike. The gap between the two rows is what it remembers of its
training formulas' text: the part of dev's exact-match gap that more of the same
pictures cannot close.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from training.formula.data import BUCKET_STEP, read_formulas, split_samples
from training.formula.evaluate import Scores, score, served_runner, transcribe
from training.formula.latex_render import BASE_DPI, FONTS, IM2MARKUP_PAD, RenderJob, render_job


def drawn(formulas: Sequence[str], font: str) -> list[tuple[str, bytes]]:
    """Each formula with its picture as im2markup drew im2latex, in font setup `font`;
    formulas that LaTeX cannot draw are left out."""
    n = len(formulas)
    job = RenderJob(tuple(formulas), (BASE_DPI,) * n, (IM2MARKUP_PAD,) * n, (1,) * n, font)
    pngs = render_job(job)
    return [(f, png) for f, png in zip(formulas, pngs, strict=True) if png is not None]


def read_drawn(recognizer, runner, pictures: list[tuple[str, bytes]], batch_size: int) -> Scores:
    result = transcribe(
        recognizer, runner, recognizer.preprocessor, [png for _, png in pictures], batch_size
    )
    return score([formula for formula, _ in pictures], result.latex)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/im2latex-val", help="im2latex-val folder")
    parser.add_argument("--model", default="models/formula/default")
    parser.add_argument("--font", choices=sorted(FONTS), default="utopia")
    parser.add_argument("--count", type=int, default=300, help="formulas of each split")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="as TEXEL_DTYPE")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    train, dev = split_samples(read_formulas(Path(args.data)))
    recognizer, runner = served_runner(
        args.model, args.device, args.dtype, args.batch_size, BUCKET_STEP
    )
    print(f"| formulas ({args.font}) | drawn | BLEU-4 | edit distance | exact | time |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, samples in (("train split", train), ("dev split", dev)):
        started = time.perf_counter()
        pictures = drawn([s.formula for s in samples[: args.count]], args.font)
        scores = read_drawn(recognizer, runner, pictures, args.batch_size)
        print(
            f"| {label} | {scores.count} of {min(args.count, len(samples))} "
            f"| {scores.bleu4:.4f} | {scores.edit_distance:.4f} | {scores.exact_match:.2%} "
            f"| {time.perf_counter() - started:.0f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
