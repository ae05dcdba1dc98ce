"""Experiment: mask the right padding of formula strips, so an answer cannot depend on
the width its batch was padded to.

    python -m training.formula.padding_mask --data ../shared/data/im2latex-val [--width 1024]

The served model attends to the white padding of its bucket (the encoder has no mask,
and the decoder's cross-attention reads every position of the padded strip), so the
same image can decode differently padded to 128 or to 1024 px. That is why a stream
encodes each width group of joining rows with its own encoder call (about 0.6 ms of
device time each on an H200, whatever their rows; since concurrent admission they run
side by side and beside the decoding steps, README, Benchmarks). With the padding
masked (the encoder's attention and the decoder's cross-attention both skip every
patch column past a row's content), all rows of a join could share one encoder call at
the widest width.

This decodes the dev split with Texel's static decoder on the CPU in width-sorted
batches of 32, each padded to its 64 px bucket (or to `--width`), with the padding
masked (or not, `--no-mask`), and prints the scores; `--out` keeps the transcriptions.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from models.formula.fast_decode import StaticGreedyDecoder
from models.formula.preprocess import bucket_width, pad_and_normalize
from training.formula.data import load_strips, read_formulas, split_samples, width_batches
from training.formula.evaluate import load_model, score
from training.formula.tokenizer import normalize_spacing


def padding_mask(content_widths: list[int], height: int, width: int, patch: int, neg: float):
    """Additive mask [rows, height/patch * width/patch] over the encoder's patches (row
    major): 0 for a patch column holding any of the row's content, `neg` past it."""
    count, rows, columns = len(content_widths), height // patch, width // patch
    content = torch.tensor([math.ceil(w / patch) for w in content_widths])
    keep = torch.arange(columns)[None, :] < content[:, None]  # [count, columns]
    keep = keep[:, None, :].expand(count, rows, columns).reshape(count, -1)
    return torch.zeros(keep.shape).masked_fill(~keep, neg)


class PaddingMaskedDecoder(StaticGreedyDecoder):
    """The static decoder, run eagerly, with each row's padding masked: set
    `content_widths` (pixels of content per row) before `decode()`."""

    content_widths: list[int] | None = None
    mask_padding: bool = True

    def _load_source(self, pixel_values: torch.Tensor, slots: list[int]) -> None:
        if not self.mask_padding:
            super()._load_source(pixel_values, slots)
            return
        _, _, height, width = pixel_values.shape
        patch = self.model.config.encoder.patch_size
        mask = padding_mask(self.content_widths, height, width, patch, self.neg).to(self.dtype)
        hidden = self.model.encoder(
            pixel_values=pixel_values, attention_mask=mask[:, None, None, :]
        ).last_hidden_state
        self._store_source(self._cross_kv(hidden), slots, mask)


def transcribe(model, tokenizer, spec, strips, width: int = 0, mask: bool = True) -> list[str]:
    """Greedy transcriptions in input order, batches of 32 padded to `width` (0: each
    batch to its 64 px bucket), padding masked or not."""
    patch = model.config.encoder.patch_size
    decoder = PaddingMaskedDecoder(
        model,
        max_batch_size=32,
        max_new_tokens=model.generation_config.max_new_tokens or 256,
        max_source_len=(spec.height // patch) * (spec.max_width // patch),
        use_cuda_graphs=False,
    )
    decoder.mask_padding = mask
    out = [""] * len(strips)
    with torch.inference_mode():
        for indices in width_batches([s.shape[1] for s in strips], 32):
            group = [strips[i] for i in indices]
            padded = width or bucket_width(max(s.shape[1] for s in group), spec, 64)
            pixels = torch.from_numpy(pad_and_normalize(group, padded, spec)).to(model.dtype)
            decoder.content_widths = [s.shape[1] for s in group]
            ids = decoder.decode(pixels).tokens
            texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
            for i, text in zip(indices, texts, strict=True):
                out[i] = normalize_spacing(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/im2latex-val")
    parser.add_argument("--model", default="models/formula/default")
    parser.add_argument("--width", type=int, default=0, help="pad every batch to this (px)")
    parser.add_argument("--no-mask", action="store_true", help="attend to the padding")
    parser.add_argument("--limit", type=int, default=0, help="first N dev images (0 = all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the transcriptions here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, spec = load_model(args.model)
    _, dev = split_samples(read_formulas(args.data))
    dev = dev[: args.limit] if args.limit else dev
    strips = load_strips(args.data, dev, spec)
    started = time.perf_counter()
    hypotheses = transcribe(model, tokenizer, spec, strips, args.width, not args.no_mask)
    scores = score([s.formula for s in dev], hypotheses)
    print(
        json.dumps(
            {
                "width": args.width or "64 px bucket",
                "mask": not args.no_mask,
                "images": len(dev),
                "bleu4": round(scores.bleu4, 4),
                "edit_distance": round(scores.edit_distance, 4),
                "exact_match": round(scores.exact_match, 4),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )
    if args.out:
        args.out.write_text(json.dumps(hypotheses))


if __name__ == "__main__":
    main()
