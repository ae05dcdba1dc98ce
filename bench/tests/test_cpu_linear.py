"""bench.cpu_linear with a tiny model: a decoding step's products, in each format."""

from __future__ import annotations

import pytest
import torch
from transformers import VisionEncoderDecoderModel

from bench.cpu_linear import formats, step_weights


# torch's eager int8 quantization warns that it is deprecated (torchao succeeds it).
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_steps_products_chain_and_each_format_stays_near_float32(tiny_models):
    model = VisionEncoderDecoderModel.from_pretrained(tiny_models["formula"]).eval()
    weights = step_weights(model)
    layers = model.decoder.model.decoder.layers
    assert len(weights) == 6 * len(layers) + 1  # six products a layer, then the output
    d_model = layers[0].fc1.in_features
    assert weights[0][0].shape == (3 * d_model, d_model)  # Q, K and V as one product
    assert weights[-1][0].shape[0] == model.decoder.config.vocab_size
    inputs = {width: torch.randn(4, width) for width in {w.shape[1] for w, _ in weights}}
    runs = formats(weights)
    exact = runs["float32"](inputs)
    for name in ("bfloat16", "int8 dynamic"):
        for got, want in zip(runs[name](inputs), exact, strict=True):
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert float((got - want).abs().max() / want.abs().max()) < 0.1, name
