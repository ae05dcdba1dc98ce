"""The padding-mask experiment: with right padding masked, the padded width cannot
change an answer (a tiny AIMv2-encoded model built from a config, CPU)."""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import AutoTokenizer

from models.formula.preprocess import FormulaImageSpec
from tests.conftest import ROOT
from training.formula.padding_mask import padding_mask, transcribe
from training.formula.train import build_model


def test_the_mask_keeps_each_rows_content_columns_in_every_patch_row():
    mask = padding_mask([10, 24], height=16, width=32, patch=8, neg=-1.0)
    assert mask.shape == (2, 8)  # 2 patch rows x 4 patch columns, row major
    assert mask[0].tolist() == [0, 0, -1, -1] * 2, "10 px of content: 2 columns"
    assert mask[1].tolist() == [0, 0, 0, -1] * 2


def test_masked_answers_do_not_depend_on_the_padded_width():
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "formula" / "default")
    spec = FormulaImageSpec(height=16, max_width=256, width_multiple=32)
    sizes = argparse.Namespace(enc_dim=32, enc_layers=2, dec_dim=32, dec_layers=1)
    model = build_model(len(tokenizer), spec, sizes).eval()
    with torch.no_grad():  # large random weights: answers that depend on the image
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    model.generation_config.max_new_tokens = 12
    rng = np.random.default_rng(0)
    strips = [rng.integers(0, 256, (spec.height, w), dtype=np.uint8) for w in (40, 72, 100)]
    narrow = transcribe(model, tokenizer, spec, strips)
    wide = transcribe(model, tokenizer, spec, strips, width=spec.max_width)
    assert narrow == wide and any(narrow)
    unmasked_wide = transcribe(model, tokenizer, spec, strips, width=spec.max_width, mask=False)
    assert unmasked_wide != wide, "without the mask the padding is attended to"
