"""The CPU's static decoder with its math in ONNX Runtime answers as the PyTorch one."""

from __future__ import annotations

import copy

import pytest
import torch

from models.formula.fast_decode import StaticGreedyDecoder
from models.formula.onnx_decode import OnnxStaticDecoder

pytest.importorskip("onnxruntime")

SOURCE_LEN = 64
SHAPES = [(1, 32, 64), (1, 32, 128)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import VisionEncoderDecoderModel

    from training.tiny import build_tiny_formula_model

    folder = build_tiny_formula_model(tmp_path_factory.mktemp("tiny-formula"))
    return VisionEncoderDecoderModel.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def attentive_model(tiny_model):
    """The tiny model with large cross-attention weights: its tokens depend on the image."""
    model = copy.deepcopy(tiny_model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.decoder.model.decoder.layers:
            cross = layer.encoder_attn
            for linear in (cross.q_proj, cross.k_proj, cross.v_proj, cross.out_proj):
                linear.weight.normal_(0.0, 1.0, generator=generator)
    return model


def _pixels(batch: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, 32, width, generator=generator)


def _decoders(model, int8: bool = False):
    sizes = {"max_batch_size": 4, "max_new_tokens": 24, "max_source_len": SOURCE_LEN}
    onnx = OnnxStaticDecoder(model, example=_pixels(1, 64, seed=0), int8=int8, **sizes)
    plain = StaticGreedyDecoder(model, **sizes)
    return onnx, plain


def test_answers_as_the_pytorch_decoder_at_every_width(tiny_model) -> None:
    assert OnnxStaticDecoder.supports(tiny_model)
    onnx, plain = _decoders(tiny_model)
    onnx.warmup(SHAPES)
    plain.warmup(SHAPES)
    assert onnx.onnx, "warm-up found the graphs wrong for the tiny model"
    for batch, width, seed in [(1, 64, 1), (3, 64, 2), (2, 128, 3), (4, 128, 4)]:
        pixels = _pixels(batch, width, seed)
        got, expected = onnx.decode(pixels), plain.decode(pixels)
        assert torch.equal(got.tokens, expected.tokens)
        for ours, theirs in zip(got.rows, expected.rows, strict=True):
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)


def test_rows_joining_a_running_stream_answer_as_alone(tiny_model) -> None:
    """Continuous batching through the graphs: a row admitted while others run decodes
    the tokens it decodes alone."""
    onnx, _ = _decoders(tiny_model)
    onnx.warmup(SHAPES)
    first, later = _pixels(2, 64, seed=5), _pixels(1, 128, seed=6)
    alone = [onnx.decode(first[i : i + 1]).rows[0].tokens for i in range(2)]
    alone.append(onnx.decode(later).rows[0].tokens)
    slots = onnx.admit(first)
    onnx.run()
    onnx.run()
    slots += onnx.admit(later)
    answers = {}
    while onnx.running:
        onnx.run()
        answers.update({slot: row.tokens for slot, row in onnx.harvest().items()})
    assert [answers[slot] for slot in slots] == alone


def test_graphs_that_disagree_at_warmup_fall_back_to_pytorch(tiny_model, caplog) -> None:
    """An export can bake in its example's width; warm-up compares and, where the graphs
    differ, decodes with PyTorch from then on (here the encoder graph is made wrong)."""
    onnx, plain = _decoders(tiny_model)
    graph = onnx._encoder

    class Off:
        def run(self, names, feeds):
            (kv,) = graph.run(names, feeds)
            return [kv + 1.0]

    onnx._encoder = Off()
    onnx.warmup(SHAPES)
    assert not onnx.onnx and "disagree" in caplog.text
    plain.warmup(SHAPES)
    pixels = _pixels(2, 128, seed=7)
    assert torch.equal(onnx.decode(pixels).tokens, plain.decode(pixels).tokens)


def test_int8_steps_answer_each_row_as_alone(attentive_model) -> None:
    """With int8 weights each row's activations are quantized in blocks of its own, so a
    batch, and a row joining a running stream, answer as each row decodes alone."""
    int8, _ = _decoders(attentive_model, int8=True)
    int8.warmup(SHAPES)
    assert int8.onnx and int8._stepper is int8._int8_step
    pixels = _pixels(4, 64, seed=8)
    alone = [int8.decode(pixels[i : i + 1]).rows[0].tokens for i in range(4)]
    assert len({tuple(tokens) for tokens in alone}) > 1, "rows must depend on their image"
    assert [row.tokens for row in int8.decode(pixels).rows] == alone
    slots = int8.admit(pixels[:3])
    int8.run()
    int8.run()
    slots += int8.admit(pixels[3:])
    answers = {}
    while int8.running:
        int8.run()
        answers.update({slot: row.tokens for slot, row in int8.harvest().items()})
    assert [answers[slot] for slot in slots] == alone


def test_int8_steps_that_stray_fall_back_to_float32(tiny_model, caplog) -> None:
    """Warm-up compares the int8 step with the float32 one; a model whose int8 logits
    stray (here made to) decodes with the float32 graph, as `float32` would."""
    int8, plain = _decoders(tiny_model, int8=True)
    graph = int8._int8_step

    class Off:
        def run(self, feeds):
            logits, *kv = graph.run(feeds)
            return [-logits, *kv]

    int8._int8_step = Off()
    int8.warmup(SHAPES)
    assert int8.onnx and int8._stepper is int8._float_step and "int8" in caplog.text
    plain.warmup(SHAPES)
    pixels = _pixels(2, 128, seed=9)
    assert torch.equal(int8.decode(pixels).tokens, plain.decode(pixels).tokens)


def _lone_row_decoder(float_model):
    from models.formula.onnx_decode import LoneRowInt8Decoder

    model = copy.deepcopy(float_model).to(torch.bfloat16)
    assert LoneRowInt8Decoder.supports(model) and not LoneRowInt8Decoder.supports(float_model)
    sizes = {"max_batch_size": 4, "max_new_tokens": 24, "max_source_len": SOURCE_LEN}
    decoder = LoneRowInt8Decoder(
        model, float_model=float_model, example=_pixels(1, 64, seed=0), **sizes
    )
    decoder.warmup(SHAPES)
    return decoder, StaticGreedyDecoder(model, **sizes)


class _Counting:
    def __init__(self, steps) -> None:
        self.steps, self.calls = steps, 0

    def run(self, feeds):
        self.calls += 1
        assert len(feeds["tokens"]) == 1
        return self.steps.run(feeds)


def test_a_bf16_model_steps_a_lone_row_with_the_int8_graph(attentive_model) -> None:
    """On a CPU with bf16 matrix instructions: a step of one row runs the int8 graph, a
    step of a batch runs bf16 PyTorch, on one cache, so a row joining a running decode
    and the rows around it all finish."""
    decoder, plain = _lone_row_decoder(attentive_model)
    assert decoder.lone_row_int8
    counting = decoder._lone = _Counting(decoder._lone)
    alone = decoder.decode(_pixels(1, 64, seed=9))
    assert counting.calls >= alone.rows[0].generated > 0
    batch = _pixels(3, 128, seed=10)
    calls = counting.calls
    got = decoder.decode(batch)
    assert counting.calls == calls, "a batch's steps ran the lone row's graph"
    assert torch.equal(got.tokens, plain.decode(batch).tokens)  # bf16 PyTorch, as before
    slots = decoder.admit(_pixels(1, 64, seed=11))
    decoder.run()
    assert counting.calls > calls
    slots += decoder.admit(_pixels(1, 128, seed=12))
    answers = {}
    while decoder.running:
        decoder.run()
        answers.update(decoder.harvest())
    assert sorted(answers) == sorted(slots)


def test_without_the_int8_graph_every_step_runs_bf16(attentive_model, monkeypatch, caplog):
    """Where the graph cannot be made (an exporter or quantizer failing), the decoder is
    the bf16 one it was before, with a warning."""
    from models.formula import onnx_decode

    def broken(*args, **kwargs):
        raise RuntimeError("no exporter here")

    monkeypatch.setattr(onnx_decode, "_graphs", broken)
    decoder, plain = _lone_row_decoder(attentive_model)
    assert not decoder.lone_row_int8 and "bf16" in caplog.text
    for batch, seed in [(1, 13), (3, 14)]:
        pixels = _pixels(batch, 64, seed)
        assert torch.equal(decoder.decode(pixels).tokens, plain.decode(pixels).tokens)
