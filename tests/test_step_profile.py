"""bench.step_profile on a CPU with a tiny model: admission and step timing."""

from __future__ import annotations

import numpy as np
import torch

from bench.step_profile import admit, step_ms
from models.formula.adapter import FormulaInput, FormulaRecognizer


def test_admitted_rows_are_timed_per_step_and_report_their_longest_source(tiny_models):
    cpu = torch.device("cpu")
    recognizer = FormulaRecognizer(str(tiny_models["formula"]), [cpu], decoder="static")
    recognizer.load()
    recognizer.warmup(cpu, max_batch_size=3)
    decoder = recognizer._decoders["cpu"]
    rng = np.random.default_rng(5)
    height = recognizer.spec.height
    items = [
        FormulaInput(rng.integers(0, 256, (height, width), dtype=np.uint8), width)
        for width in (64, 192, 128)
    ]
    longest = admit(recognizer, decoder, items)
    assert decoder.running == 3
    widest = decoder._encode(recognizer._upload(decoder, items[1:2])[0][0]).shape[-2]
    assert longest == widest, "the widest image has the longest source"
    assert step_ms(decoder, repeats=1) > 0
