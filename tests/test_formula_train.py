"""Training helpers of the formula model that run on the CPU in seconds."""

from __future__ import annotations

import torch

from training.formula.train import grow_decoder


def test_a_grown_decoder_keeps_the_weights_and_dtype_and_trains(tmp_path) -> None:
    from transformers import VisionEncoderDecoderModel

    from training.tiny import build_tiny_formula_model

    # Saved in fp16 like the shipped model, then loaded in fp32 for training.
    saved = VisionEncoderDecoderModel.from_pretrained(build_tiny_formula_model(tmp_path / "m"))
    saved.half().save_pretrained(tmp_path / "fp16")
    model = VisionEncoderDecoderModel.from_pretrained(tmp_path / "fp16").float()
    layers = len(model.decoder.model.decoder.layers)

    grown = grow_decoder(model, layers + 2)

    assert grown.config.decoder.decoder_layers == layers + 2
    assert {p.dtype for p in grown.parameters()} == {torch.float32}
    old, new = model.state_dict(), grown.state_dict()
    assert all(torch.equal(old[name], new[name]) for name in old)
    top = grown.decoder.model.decoder.layers[-1]
    assert not top.fc2.weight.any() and not top.encoder_attn.out_proj.weight.any()

    torch.manual_seed(0)
    pixels = torch.randn(2, model.config.encoder.num_channels, 32, 64)
    labels = torch.randint(4, model.config.decoder.vocab_size, (2, 6))
    optimizer = torch.optim.AdamW(grown.parameters(), lr=3e-4)
    for _ in range(3):
        loss = grown(pixel_values=pixels, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert torch.isfinite(loss)
    assert top.fc2.weight.any(), "the new layer did not learn"
    assert grow_decoder(grown, layers) is grown  # never shrinks
