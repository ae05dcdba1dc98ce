"""Would ONNX Runtime decode formulas faster on a CPU? One formula at a time, both ways.

    python -m bench.cpu_onnx --data ../shared/data --count 120

Texel's CPU path decodes with its static decoder in PyTorch (`models/formula/fast_decode.py`,
eager on a CPU). Here the same model is exported to ONNX as two graphs, the encoder
(pixels to every decoder layer's cross-attention K and V) and one greedy decoding step (a
token and its position, the K/V cache so far, the cross-attention K/V: the next token,
its log-probability and the cache one position longer), and run by ONNX Runtime's CPU
provider with the same threads. Each picture (the benchmark's, preprocessed as the server
does) is decoded by both in turn, so the machine's drift falls on both alike. Prints the
share of identical answers, each side's median and mean time a formula, the encoder
alone both ways, and the export's cost, and appends a record to `--out` if given.

A measurement, not a backend: the exported step handles one row, where the server's CPU
stream batches rows that join and leave at any step.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bench.common import append_records, commit, formula_images, machine
from bench.server import ROOT
from models.formula.adapter import FormulaRecognizer
from models.formula.fast_decode import token_ids


class Encoder(nn.Module):
    """Pixels [1, C, H, W] to every decoder layer's cross-attention K and V [L, heads, S, D]."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.layers = model.decoder.model.decoder.layers

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.encoder(pixel_values=pixels).last_hidden_state[0]  # [S, E]
        projection = getattr(self.model, "enc_to_dec_proj", None)
        if projection is not None:
            hidden = projection(hidden)
        heads = self.layers[0].encoder_attn.num_heads
        keys = [_heads(layer.encoder_attn.k_proj(hidden), heads) for layer in self.layers]
        values = [_heads(layer.encoder_attn.v_proj(hidden), heads) for layer in self.layers]
        return torch.stack(keys), torch.stack(values)


class Step(nn.Module):
    """One greedy step of one row of a TrOCR decoder (post-LN, learned positions)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.decoder = model.decoder.model.decoder
        self.projection = model.decoder.output_projection

    def forward(self, token, position, past_k, past_v, cross_k, cross_v):
        decoder = self.decoder
        table = decoder.embed_positions
        hidden = decoder.embed_tokens(token)[None] + table.weight[position + table.offset][None]
        if decoder.layernorm_embedding is not None:
            hidden = decoder.layernorm_embedding(hidden)
        keys, values = [], []
        for i, layer in enumerate(decoder.layers):
            attention = layer.self_attn
            heads = attention.num_heads
            query = _heads(attention.q_proj(hidden)[0] * attention.scaling, heads)  # [h, 1, d]
            k = torch.cat([past_k[i], _heads(attention.k_proj(hidden)[0], heads)], dim=1)
            v = torch.cat([past_v[i], _heads(attention.v_proj(hidden)[0], heads)], dim=1)
            keys.append(k)
            values.append(v)
            out = torch.softmax(query @ k.transpose(1, 2), dim=-1) @ v
            hidden = layer.self_attn_layer_norm(hidden + attention.out_proj(_merge(out)))
            cross = layer.encoder_attn
            query = _heads(cross.q_proj(hidden)[0] * cross.scaling, heads)
            out = torch.softmax(query @ cross_k[i].transpose(1, 2), dim=-1) @ cross_v[i]
            hidden = layer.encoder_attn_layer_norm(hidden + cross.out_proj(_merge(out)))
            feed_forward = layer.fc2(layer.activation_fn(layer.fc1(hidden)))
            hidden = layer.final_layer_norm(hidden + feed_forward)
        logits = self.projection(hidden[0, 0])
        best = logits.argmax(-1, keepdim=True)
        return (
            best,
            torch.log_softmax(logits, -1).gather(0, best),
            torch.stack(keys),
            torch.stack(values),
        )


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[L, E] -> [heads, L, E / heads]."""
    return x.view(x.shape[0], heads, -1).transpose(0, 1)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """[heads, 1, d] -> [1, 1, heads * d]."""
    return x.transpose(0, 1).reshape(1, 1, -1)


def export(model, pixels: torch.Tensor) -> tuple[bytes, bytes]:
    """The encoder's and the step's ONNX graphs, widths and lengths left dynamic."""
    encoder, step = Encoder(model).eval(), Step(model).eval()
    with torch.no_grad():
        cross_k, cross_v = encoder(pixels)
        layers, heads, _, dim = cross_k.shape
        cache = torch.zeros(layers, heads, 1, dim)
        graphs = []
        for module, inputs, names, axes in [
            (
                encoder,
                (pixels,),
                (["pixels"], ["cross_k", "cross_v"]),
                {"pixels": {3: "width"}, "cross_k": {2: "source"}, "cross_v": {2: "source"}},
            ),
            (
                step,
                (torch.tensor([1]), torch.tensor([0]), cache, cache, cross_k, cross_v),
                (
                    ["token", "position", "past_k", "past_v", "cross_k", "cross_v"],
                    ["best", "logprob", "keys", "values"],
                ),
                {
                    "past_k": {2: "length"},
                    "past_v": {2: "length"},
                    "cross_k": {2: "source"},
                    "cross_v": {2: "source"},
                    "keys": {2: "longer"},
                    "values": {2: "longer"},
                },
            ),
        ]:
            buffer = io.BytesIO()
            torch.onnx.export(
                module,
                inputs,
                buffer,
                input_names=names[0],
                output_names=names[1],
                dynamic_axes=axes,
                opset_version=18,
                dynamo=False,
            )
            graphs.append(buffer.getvalue())
    return graphs[0], graphs[1]


class OnnxDecoder:
    """Greedy decoding of one picture with ONNX Runtime."""

    def __init__(
        self, encoder: bytes, step: bytes, threads: int, start: int, eos: list[int]
    ) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        providers = ["CPUExecutionProvider"]
        self.encoder = ort.InferenceSession(encoder, options, providers=providers)
        self.step = ort.InferenceSession(step, options, providers=providers)
        self.start, self.eos = start, set(eos)

    def encode(self, pixels: np.ndarray) -> list[np.ndarray]:
        return self.encoder.run(None, {"pixels": pixels})

    def __call__(self, pixels: np.ndarray, max_new_tokens: int) -> list[int]:
        cross_k, cross_v = self.encode(pixels)
        layers, heads, _, dim = cross_k.shape
        keys = values = np.zeros((layers, heads, 0, dim), np.float32)
        token, tokens = np.array([self.start]), []
        for position in range(max_new_tokens):
            token, _, keys, values = self.step.run(
                None,
                {
                    "token": token,
                    "position": np.array([position]),
                    "past_k": keys,
                    "past_v": values,
                    "cross_k": cross_k,
                    "cross_v": cross_v,
                },
            )
            tokens.append(int(token[0]))
            if tokens[-1] in self.eos:
                break
        return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--count", type=int, default=120, help="benchmark images, by name")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON-lines file to append to")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    recognizer = FormulaRecognizer(args.model, [cpu], dtype="float32")
    recognizer.open()
    recognizer.load(cpu)
    recognizer.warmup(cpu, max_batch_size=1)
    model = recognizer._models["cpu"]
    items = [recognizer.preprocess(image) for image in formula_images(args.data, args.count)]
    pixels = [recognizer._pixels([item], "cpu").float() for item in items]

    started = time.perf_counter()
    graphs = export(model, pixels[0])
    export_s = time.perf_counter() - started
    generation = model.generation_config
    onnx = OnnxDecoder(
        *graphs, args.threads, generation.decoder_start_token_id, token_ids(generation.eos_token_id)
    )
    special = set(recognizer.tokenizer.all_special_ids)
    run = recognizer.runner(cpu)
    limit = recognizer.max_new_tokens

    same, torch_s, onnx_s, torch_enc, onnx_enc = 0, [], [], [], []
    encoder = Encoder(model).eval()
    for item, picture in zip(items, pixels, strict=True):
        started = time.perf_counter()
        expected = run([item], lambda: False)[0].token_ids
        torch_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        got = onnx(picture.numpy(), limit)
        onnx_s.append(time.perf_counter() - started)
        same += [t for t in got if t not in special] == list(expected)
        with torch.inference_mode():
            started = time.perf_counter()
            encoder(picture)
            torch_enc.append(time.perf_counter() - started)
        started = time.perf_counter()
        onnx.encode(picture.numpy())
        onnx_enc.append(time.perf_counter() - started)

    def ms(values: list[float], how) -> float:
        return round(1000 * how(values), 1)

    result = {
        "scenario": "formula-cpu-onnx",
        "machine": machine(),
        "commit": commit(),
        "command": "python -m bench.cpu_onnx " + " ".join(sys.argv[1:]),
        "images": len(items),
        "same_answers": same,
        "torch_median_ms": ms(torch_s, statistics.median),
        "torch_mean_ms": ms(torch_s, statistics.fmean),
        "onnx_median_ms": ms(onnx_s, statistics.median),
        "onnx_mean_ms": ms(onnx_s, statistics.fmean),
        "torch_encoder_median_ms": ms(torch_enc, statistics.median),
        "onnx_encoder_median_ms": ms(onnx_enc, statistics.median),
        "export_s": round(export_s, 1),
    }
    print(f"{machine()}; commit {commit()}; {len(items)} pictures, one at a time\n")
    print("| decoder | same answers | median ms | mean ms | encoder alone, median ms |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| Texel (PyTorch, static decoder) | - | {result['torch_median_ms']} | "
        f"{result['torch_mean_ms']} | {result['torch_encoder_median_ms']} |"
    )
    print(
        f"| ONNX Runtime | {same} / {len(items)} | {result['onnx_median_ms']} | "
        f"{result['onnx_mean_ms']} | {result['onnx_encoder_median_ms']} |"
    )
    print(f"\nexport to ONNX: {export_s:.1f} s")
    if args.out:
        append_records([result], args.out)


if __name__ == "__main__":
    main()
