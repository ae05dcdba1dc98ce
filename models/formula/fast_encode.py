"""The formula encoder in fewer kernels, for the CUDA graphs of a stream's joins.

Why: a join encodes each width group of its arrivals alone, a few rows at a time, and at
that size an encoding is bound by how many kernels it runs, not by their arithmetic.
transformers' AIMv2 vision model runs about 27 kernels a layer: each RMSNorm is five
(a cast, a square, a mean, a reciprocal square root, two products), Q, K and V are three
products, the gate and up projections two, every residual sum one more, and the 2-D
sine/cosine positions are rebuilt in float64 on every call. The encodings run on their
own streams beside the decoding steps, so what they launch slows the steps
(bench/RESULTS.md).

How: the same arithmetic with fewer launches. RMSNorm is `F.rms_norm` (one fused kernel
on CUDA), Q, K and V are one product and the gate and up projections another (their
weights stacked once), each residual sum rides in its product (`addmm` with the hidden
state as the term added), the positions are built once per patch grid and kept, and the
cross-attention K and V of every decoder layer come from one product whose output is
already laid out as the decoder's cache. About a dozen kernels a layer.

The results equal the model's own encoder up to rounding: in float32 within 1e-4 (tested);
in bf16 an RMSNorm or a residual sum rounds once where transformers rounds twice.
`FusedEncoder.supports()` says which models it reproduces (AIMv2 vision models with
native 2-D positions, no pooling head, no biases, SiLU), and `agrees()` checks it against
the model's own encoder once, as loaded; any other encoder runs as the model defines it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F


class FusedEncoder:
    """Pixels [rows, C, H, W] to every decoder layer's cross-attention K and V."""

    @staticmethod
    def supports(model) -> bool:
        encoder = model.encoder
        config = encoder.config
        return (
            type(encoder).__name__ == "Aimv2VisionModel"
            and getattr(config, "is_native", False)
            and not getattr(config, "use_head", True)
            and config.hidden_act == "silu"
            and not config.qkv_bias
            and not config.mlp_bias
        )

    @torch.no_grad()  # the stacked weights are constants, not autograd's
    def __init__(self, model, decoder_layers: nn.ModuleList, num_heads: int) -> None:
        encoder = model.encoder
        config = encoder.config
        self.patch_size = config.patch_size
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.scale = (self.hidden // self.heads) ** -0.5
        embeddings = encoder.embeddings
        self.patch_embed = embeddings.patch_embed
        self.norm_in = embeddings.rms_norm.weight
        self.norm_out = encoder.rms_norm.weight
        self.layers = [
            _Layer(
                layer.rms_norm1.weight,
                torch.cat(
                    [
                        layer.attention.q_proj.weight,
                        layer.attention.k_proj.weight,
                        layer.attention.v_proj.weight,
                    ]
                ),
                layer.attention.out_proj.weight.detach().t(),
                layer.rms_norm2.weight,
                torch.cat([layer.ffn.gate_proj.weight, layer.ffn.up_proj.weight]),
                layer.ffn.down_proj.weight.detach().t(),
            )
            for layer in encoder.encoder.layers
        ]
        self.projection = getattr(model, "enc_to_dec_proj", None)
        # Every decoder layer's cross-attention K, then V, projections as one product.
        keys = [layer.encoder_attn.k_proj for layer in decoder_layers]
        values = [layer.encoder_attn.v_proj for layer in decoder_layers]
        self.kv_weight = torch.cat([p.weight for p in keys + values])
        biases = [p.bias for p in keys + values]
        self.kv_bias = None if biases[0] is None else torch.cat(biases)
        self.decoder_layers = len(decoder_layers)
        self.decoder_heads = num_heads
        self._positions: dict[tuple, torch.Tensor] = {}

    @torch.inference_mode()
    def agrees(self, model, reference: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """Whether this reproduces `reference` (the model's own encoder and K/V projections)
        on two rows of ink-like strokes over a grid of 4 x 16 patches: within rounding
        (float32's is about 1e-6 of the mean magnitude, bf16's about 1%), not as a
        transformers version that lays out AIMv2's positions otherwise would (nearly 90%
        off)."""
        config = model.encoder.config
        generator = torch.Generator().manual_seed(0)
        shape = (2, config.num_channels, 4 * self.patch_size, 16 * self.patch_size)
        strokes = torch.where(torch.rand(shape, generator=generator) < 0.1, -1.0, 1.0)
        pixels = strokes.to(model.device, model.dtype)
        got, expected = self(pixels).float(), reference(pixels).float()
        tolerance = 1e-3 if model.dtype == torch.float32 else 3e-2
        return bool((got - expected).abs().mean() < tolerance * expected.abs().mean())

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[2, decoder layers, rows, heads, S, D], as `StaticGreedyDecoder._encode`."""
        hidden = self.encode(pixel_values)
        if self.projection is not None:
            hidden = self.projection(hidden)
        rows, length, _ = hidden.shape
        kv = F.linear(hidden, self.kv_weight, self.kv_bias)
        kv = kv.view(rows, length, 2, self.decoder_layers, self.decoder_heads, -1)
        return kv.permute(2, 3, 0, 4, 1, 5)

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden state [rows, S, E]."""
        _, _, height, width = pixel_values.shape
        hidden = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        hidden = self._norm(hidden, self.norm_in) + self._grid(height, width, hidden)
        rows, length, size = hidden.shape
        flat = hidden.reshape(rows * length, size)
        for layer in self.layers:
            flat = self._layer(layer, flat, rows, length)
        return self._norm(flat, self.norm_out).view(rows, length, size)

    def _layer(self, layer: _Layer, flat: torch.Tensor, rows: int, length: int) -> torch.Tensor:
        size = self.hidden
        qkv = F.linear(self._norm(flat, layer.norm1), layer.qkv)
        q, k, v = qkv.view(rows, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        attended = attended.transpose(1, 2).reshape(rows * length, size)
        flat = torch.addmm(flat, attended, layer.out)
        gate, up = F.linear(self._norm(flat, layer.norm2), layer.gate_up).chunk(2, dim=-1)
        return torch.addmm(flat, F.silu(gate) * up, layer.down)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden,), weight, self.eps)

    def _grid(self, height: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """The 2-D sine/cosine positions of a (height, width) picture's patches, built
        once (as transformers builds them on every call). The first encoding of a width
        runs eagerly before any capture of it (`StaticGreedyDecoder._capture_encoder`), so
        a graph only ever reads a cached table."""
        key = (height, width, like.dtype, like.device)
        if key not in self._positions:
            from transformers.models.aimv2.modeling_aimv2 import (
                build_2d_sinusoidal_position_embedding,
            )

            grid = build_2d_sinusoidal_position_embedding(
                height // self.patch_size,
                width // self.patch_size,
                embed_dim=self.hidden,
                device=like.device,
                dtype=like.dtype,
            )
            half = grid.shape[-1] // 2  # AIMv2's [w | h] layout, as its embeddings do
            self._positions[key] = torch.cat([grid[..., half:], grid[..., :half]], dim=-1)
        return self._positions[key]


class _Layer(NamedTuple):
    """One encoder layer's weights, stacked and transposed as `FusedEncoder` uses them."""

    norm1: torch.Tensor
    qkv: torch.Tensor
    out: torch.Tensor
    norm2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
