"""bench.step_profile on a CPU with a tiny model: admission, step and encoding timing."""

from __future__ import annotations

import torch

from bench.step_profile import admit, encoding_ms, step_ms


def test_admitted_rows_are_timed_per_step_and_report_their_longest_source(tiny_recognizer):
    recognizer, items = tiny_recognizer(max_batch_size=3, widths=(64, 192, 128), seed=5)
    decoder = recognizer.static_decoder(torch.device("cpu"))
    longest = admit(recognizer, decoder, items)
    assert decoder.running == 3
    widest = decoder._encode(recognizer.upload(decoder, items[1:2])[0][0]).shape[-2]
    assert longest == widest, "the widest image has the longest source"
    assert step_ms(decoder, repeats=1) > 0


def test_encodings_are_timed_per_width_bucket_and_row_count(tiny_recognizer):
    recognizer, items = tiny_recognizer(max_batch_size=4, widths=(64, 192, 64), seed=7)
    decoder = recognizer.static_decoder(torch.device("cpu"))
    timings = encoding_ms(recognizer, torch.device("cpu"), items, [1, 3], repeats=2)
    assert [width for width, _ in timings] == sorted({item.bucket for item in items})
    assert len(timings) == 2, "two distinct width buckets"
    for _, ms in timings:
        assert set(ms) == {1, 3} and all(value > 0 for value in ms.values())
    assert decoder.running == 0, "encoding fills slots' sources, it starts no rows"
