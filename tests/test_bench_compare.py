"""bench.compare's model-only ceiling: every image decoded once, in width-sorted batches."""

from __future__ import annotations

import numpy as np

from bench.compare import model_only, model_only_batches
from models.formula.preprocess import FormulaInput
from tests.conftest import formula_png


def strip(width: int) -> FormulaInput:
    return FormulaInput(np.zeros((8, width), np.uint8), width)


def test_model_only_batches_decode_every_image_once_sorted_by_width():
    items = [strip(w) for w in (300, 40, 520, 40, 96, 700, 64)]
    batches = model_only_batches(items, 3)
    assert [len(b) for b in batches] == [3, 3, 1]
    flat = [item for batch in batches for item in batch]
    assert sorted(map(id, flat)) == sorted(map(id, items)), "each image exactly once"
    assert [item.width for item in flat] == [40, 40, 64, 96, 300, 520, 700]


def test_a_lone_image_of_a_bucket_is_not_repeated_to_fill_a_batch():
    items = [strip(40)] * 5 + [strip(900)]
    batches = model_only_batches(items, 4)
    assert [len(b) for b in batches] == [4, 2]
    assert [item.width for item in batches[1]] == [40, 900]


def test_model_only_runs_the_tiny_model_on_a_cpu(tiny_models):
    images = [formula_png(text, size=(60 + 40 * i, 40)) for i, text in enumerate("abcde")]
    results = model_only(str(tiny_models["formula"]), images, [1, 4], budget_s=30)
    assert [r["batch_size"] for r in results] == [1, 4]
    assert all(r["throughput_rps"] > 0 for r in results)
