"""bench.step_profile on a CPU with a tiny model: admission and step timing."""

from __future__ import annotations

import torch

from bench.step_profile import admit, step_ms


def test_admitted_rows_are_timed_per_step_and_report_their_longest_source(tiny_recognizer):
    recognizer, items = tiny_recognizer(max_batch_size=3, widths=(64, 192, 128), seed=5)
    decoder = recognizer.static_decoder(torch.device("cpu"))
    longest = admit(recognizer, decoder, items)
    assert decoder.running == 3
    widest = decoder._encode(recognizer.upload(decoder, items[1:2])[0][0]).shape[-2]
    assert longest == widest, "the widest image has the longest source"
    assert step_ms(decoder, repeats=1) > 0
