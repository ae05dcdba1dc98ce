"""bench.stream_probe: the stream alone in a closed loop, on a CPU with a tiny model."""

from __future__ import annotations

import torch

from bench.stream_probe import ClosedLoop, probe


def test_the_closed_loop_keeps_its_concurrency_and_stops_taking_at_the_deadline():
    loop = ClosedLoop(["a", "b", "c"], concurrency=2, deadline=float("inf"))
    assert loop.take(8) == [(0, "a"), (1, "b")]
    assert loop.take(8) == [], "two in flight already"
    loop.done([(0, None)])
    assert loop.take(8) == [(2, "c")]
    assert loop.take(8) == []
    loop.done([(1, None), (2, None)])
    assert loop.take(1) == [(3, "a")], "images are reused in turn, keys stay unique"
    loop.deadline = 0.0
    loop.done([(3, None)])
    assert loop.take(8) == [] and loop.finish()
    assert loop.answered == 4 and loop.outstanding == 0


def test_probe_answers_requests_and_reports_its_phases(tiny_recognizer):
    recognizer, items = tiny_recognizer(max_batch_size=4, widths=(64, 128, 64), seed=3)
    decoder = recognizer._decoders["cpu"]
    record = probe(recognizer, torch.device("cpu"), items, concurrency=4, duration=1.0)
    assert record["answered"] >= 4 and record["throughput_rps"] > 0
    assert 0 < record["mean_rows"] <= 4
    assert set(record["host_ms_per_check"]) == {"harvest", "join", "run", "snapshot"}
    assert record["joins"] >= 1 and 1 <= record["requests_per_join"] <= 4
    assert 1 <= record["width_groups_per_join"] <= 2, "two distinct widths among the images"
    # Every admitted row is encoded once; a CPU pads no encoder rows.
    assert record["encoded_rows"] >= record["answered"]
    assert record["encoded_rows_padded"] == record["encoded_rows"]
    assert "device_ms_per_check" not in record, "device times are CUDA events"
    assert decoder.running == 0, "every row answered and freed"
    assert "run" not in vars(decoder) and "_join" not in vars(recognizer), "timers removed"
    assert "_load_source" not in vars(decoder), "the encoder's counter removed"
