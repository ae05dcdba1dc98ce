"""StaticGreedyDecoder must produce exactly the tokens of greedy `generate()` (CPU, fp32)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from models.formula.fast_decode import CHECK_EVERY, SHARED_CHECK_EVERY, StaticGreedyDecoder
from tests.conftest import ROOT, SHARED_DATA

MAX_NEW_TOKENS = 24
TINY_SOURCE_LEN = 128  # Swin on 32 x 256: 4 x 32 positions after one patch merge
DEFAULT_MODEL = ROOT / "models" / "formula" / "default"
VAL_IMAGES = SHARED_DATA / "im2latex-val" / "images"


def _generate(model, pixels: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(
            pixel_values=pixels, num_beams=1, do_sample=False, max_new_tokens=max_new_tokens
        )


def _tokens(finished: dict) -> dict[int, list[int]]:
    """`harvest()`'s rows as {slot: tokens}."""
    return {slot: row.tokens for slot, row in finished.items()}


def _pixels(batch: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, 32, width, generator=generator)


def _assert_same(
    model,
    pixels: torch.Tensor,
    max_new_tokens: int = MAX_NEW_TOKENS,
    steps_per_run: int = 1,
    buffer_tokens: int = MAX_NEW_TOKENS,
) -> None:
    decoder = StaticGreedyDecoder(
        model,
        max_batch_size=6,
        max_new_tokens=buffer_tokens,
        max_source_len=TINY_SOURCE_LEN,
        steps_per_run=steps_per_run,
    )
    decoder.warmup()
    expected = _generate(model, pixels, max_new_tokens)
    got = decoder.decode(pixels, max_new_tokens=max_new_tokens).tokens
    assert got.dtype == torch.long and got.device.type == "cpu"
    assert torch.equal(got, expected), f"\nstatic:   {got.tolist()}\ngenerate: {expected.tolist()}"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from training.tiny import build_tiny_formula_model

    return build_tiny_formula_model(tmp_path_factory.mktemp("tiny-formula"))


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import VisionEncoderDecoderModel

    return VisionEncoderDecoderModel.from_pretrained(tiny_model_dir).eval()


def _variant_model():
    """Sinusoidal positions, scaled embeddings, no embedding LayerNorm, enc_to_dec_proj."""
    from transformers import (
        SwinConfig,
        SwinModel,
        TrOCRConfig,
        TrOCRForCausalLM,
        VisionEncoderDecoderModel,
    )

    torch.manual_seed(1)
    encoder = SwinModel(
        SwinConfig(
            image_size=(32, 256),
            num_channels=1,
            patch_size=4,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
        )
    )
    decoder = TrOCRForCausalLM(
        TrOCRConfig(
            vocab_size=40,
            d_model=24,
            decoder_layers=2,
            decoder_attention_heads=3,
            decoder_ffn_dim=48,
            max_position_embeddings=64,
            activation_function="relu",
            use_learned_position_embeddings=False,
            scale_embedding=True,
            layernorm_embedding=False,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
        )
    )
    model = VisionEncoderDecoderModel(encoder=encoder, decoder=decoder).eval()
    assert model.enc_to_dec_proj is not None
    for config in (model.config, model.generation_config):
        config.decoder_start_token_id = 2
        config.pad_token_id = 1
        config.eos_token_id = 2
    return model


def _force_eos(model, pixels: torch.Tensor) -> None:
    """Make EOS win whenever one hidden feature is in its top quartile, so rows end at varied steps.

    Random weights rarely emit EOS, and tiny random decoders ignore the image, so the
    cross-attention is first re-drawn large. The feature and threshold come from an unbiased
    run on `pixels`; the output projection becomes an untied copy with a strong
    EOS row reading that feature.
    """
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # small random cross-attention makes every row decode alike
        for layer in model.decoder.model.decoder.layers:
            cross = layer.encoder_attn
            for linear in (cross.q_proj, cross.k_proj, cross.v_proj, cross.out_proj):
                linear.weight.normal_(0.0, 1.0, generator=generator)
    head = model.decoder.output_projection
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].reshape(-1, head.in_features))
    )
    _generate(model, pixels, MAX_NEW_TOKENS)
    hook.remove()
    hidden = torch.stack(seen[1:])  # [steps, rows, features]; step 0 is identical for all rows
    feature = int(hidden.std(dim=1).mean(dim=0).argmax())  # the most row-dependent feature
    threshold = float(hidden[:, :, feature].quantile(0.75))
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    biased.weight.data.copy_(head.weight.data)
    biased.bias.data.zero_()
    eos = model.generation_config.eos_token_id
    biased.weight.data[eos] = 0.0
    biased.weight.data[eos, feature] = 1000.0
    biased.bias.data[eos] = -1000.0 * threshold
    model.decoder.output_projection = biased


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a busy 2-core machine OpenMP spinning slows tiny ops 100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("batch", "width"), [(1, 64), (3, 128), (5, 256), (5, 96)])
def test_tiny_model_matches_generate(tiny_model, batch: int, width: int) -> None:
    _assert_same(tiny_model, _pixels(batch, width, seed=batch * width))


@pytest.mark.parametrize(("batch", "width"), [(1, 128), (3, 64), (5, 256)])
def test_variant_model_matches_generate(batch: int, width: int) -> None:
    _assert_same(_variant_model(), _pixels(batch, width, seed=batch + width))


@pytest.mark.parametrize("variant", [False, True])
def test_early_eos_pads_and_trims_like_generate(tiny_model, variant: bool) -> None:
    import copy

    model = _variant_model() if variant else copy.deepcopy(tiny_model)
    _force_eos(model, _pixels(5, 256, seed=7))
    eos, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id
    tokens = _generate(model, _pixels(5, 256, seed=7), MAX_NEW_TOKENS)[:, 1:]
    ends = {int((row == eos).nonzero()[0]) for row in tokens if (row == eos).any()}
    assert len(ends) >= 2, f"rows should end at different steps: {tokens.tolist()}"
    assert (tokens == pad).any(), "some row should be padded after its EOS"
    for batch, width in [(1, 128), (3, 64), (5, 256), (5, 160)]:
        _assert_same(model, _pixels(batch, width, seed=7 if batch == 5 else batch))
    _assert_same(model, _pixels(5, 256, seed=7), max_new_tokens=5)


@pytest.mark.parametrize("variant", [False, True])
@pytest.mark.parametrize("max_new_tokens", [5, 13, MAX_NEW_TOKENS])
def test_several_steps_per_run_match_generate(tiny_model, variant: bool, max_new_tokens) -> None:
    """As CUDA graphs of CHECK_EVERY steps run: a last run past the limit is cut off, rows
    that end early are padded, learned and sinusoidal positions past the limit stay in
    range."""
    import copy

    model = _variant_model() if variant else copy.deepcopy(tiny_model)
    _force_eos(model, _pixels(5, 256, seed=7))
    for batch, width in [(1, 128), (5, 256)]:
        pixels = _pixels(batch, width, seed=7 if batch == 5 else batch)
        _assert_same(model, pixels, max_new_tokens=max_new_tokens, steps_per_run=CHECK_EVERY)
        # the decoder's own limit not a multiple of the run length either
        _assert_same(
            model, pixels, max_new_tokens, steps_per_run=CHECK_EVERY, buffer_tokens=max_new_tokens
        )
    _assert_same(model, _pixels(3, 64, seed=3), max_new_tokens=max_new_tokens, steps_per_run=2)


def test_steps_per_run_must_divide_the_check_interval(tiny_model) -> None:
    with pytest.raises(ValueError, match="steps_per_run"):
        StaticGreedyDecoder(
            tiny_model, max_batch_size=2, max_new_tokens=8, max_source_len=32, steps_per_run=3
        )


def test_should_stop_ends_early_with_a_prefix_of_generate(tiny_model) -> None:
    pixels = _pixels(3, 128, seed=3)
    decoder = StaticGreedyDecoder(
        tiny_model, max_batch_size=4, max_new_tokens=MAX_NEW_TOKENS, max_source_len=128
    )
    got = decoder.decode(pixels, should_stop=lambda: True).tokens
    expected = _generate(tiny_model, pixels, MAX_NEW_TOKENS)
    assert got.shape[1] <= 9
    assert torch.equal(got, expected[:, : got.shape[1]])


def test_rejects_batches_and_sources_beyond_its_buffers(tiny_model) -> None:
    decoder = StaticGreedyDecoder(tiny_model, max_batch_size=2, max_new_tokens=8, max_source_len=32)
    with pytest.raises(ValueError, match="max_batch_size"):
        decoder.decode(_pixels(3, 64, seed=0))
    with pytest.raises(ValueError, match="source length"):
        decoder.decode(_pixels(1, 256, seed=0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.decode(_pixels(1, 64, seed=0), max_new_tokens=9)


def test_supports_only_trocr_decoders(tiny_model) -> None:
    from transformers import (
        BertConfig,
        BertLMHeadModel,
        SwinConfig,
        SwinModel,
        VisionEncoderDecoderModel,
    )

    assert StaticGreedyDecoder.supports(tiny_model)
    assert not StaticGreedyDecoder.supports(object())
    bert = BertLMHeadModel(
        BertConfig(
            vocab_size=30,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            is_decoder=True,
            add_cross_attention=True,
        )
    )
    swin = SwinModel(
        SwinConfig(image_size=32, num_channels=1, embed_dim=8, depths=[1], num_heads=[2])
    )
    assert not StaticGreedyDecoder.supports(VisionEncoderDecoderModel(encoder=swin, decoder=bert))


def _real_batch(model_dir: Path, count: int) -> torch.Tensor:
    from models.formula.preprocess import (
        FormulaImageSpec,
        bucket_width,
        decode_image,
        pad_and_normalize,
        prepare_strip,
    )

    spec = FormulaImageSpec.from_pretrained(model_dir, channels=1, fixed_size=False)
    paths = sorted(VAL_IMAGES.glob("*.png"), key=lambda p: p.name)[:count]
    strips = [prepare_strip(decode_image(p.read_bytes(), 16_000_000), spec) for p in paths]
    width = max(bucket_width(s.shape[1], spec, 64) for s in strips)
    return torch.from_numpy(pad_and_normalize(strips, width, spec))


@pytest.mark.skipif(
    not VAL_IMAGES.is_dir(), reason=f"real validation images not found at {VAL_IMAGES}"
)
def test_default_model_matches_generate_on_real_images() -> None:
    from transformers import VisionEncoderDecoderModel

    from models.formula.preprocess import FormulaImageSpec

    model = VisionEncoderDecoderModel.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    pixels = _real_batch(DEFAULT_MODEL, 8)
    spec = FormulaImageSpec.from_pretrained(DEFAULT_MODEL)
    patch = model.config.encoder.patch_size
    max_new_tokens = model.generation_config.max_new_tokens
    decoder = StaticGreedyDecoder(
        model,
        max_batch_size=8,
        max_new_tokens=max_new_tokens,
        max_source_len=(spec.height // patch) * (spec.max_width // patch),
    )
    decoder.warmup()

    started = time.perf_counter()
    expected = _generate(model, pixels, max_new_tokens)
    generate_s = time.perf_counter() - started
    started = time.perf_counter()
    got = decoder.decode(pixels).tokens
    static_s = time.perf_counter() - started
    print(
        f"\n8 real images, width {pixels.shape[-1]}, {expected.shape[1]} tokens: "
        f"generate {generate_s:.3f} s, StaticGreedyDecoder {static_s:.3f} s (CPU)"
    )
    for row, (a, b) in enumerate(zip(got.tolist(), expected.tolist(), strict=True)):
        assert a == b, f"row {row}:\nstatic:   {a}\ngenerate: {b}"
    assert got.shape == expected.shape


def test_the_fused_encoder_gives_the_models_keys_values_and_tokens() -> None:
    """`FusedEncoder` (CUDA's encoder) on a CPU in float32, the shipped model on pictures
    of two widths: the cross-attention K/V of the model's own encoder within rounding,
    and the tokens of `generate()`."""
    from transformers import VisionEncoderDecoderModel

    from models.formula.fast_encode import FusedEncoder

    model = VisionEncoderDecoderModel.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    assert FusedEncoder.supports(model)
    sizes = {"max_batch_size": 4, "max_new_tokens": 40, "max_source_len": 8 * 128}
    fused = StaticGreedyDecoder(model, fused_encoder=True, **sizes)
    plain = StaticGreedyDecoder(model, fused_encoder=False, **sizes)
    assert fused._fused_encoder is not None and plain._fused_encoder is None
    generator = torch.Generator().manual_seed(3)
    for width in (128, 448):
        # Ink-like strokes on white, as preprocessing hands the encoder (normalized).
        pixels = torch.where(torch.rand(3, 1, 64, width, generator=generator) < 0.1, -1.0, 1.0)
        with torch.inference_mode():
            got, expected = fused._encode(pixels), plain._encode(pixels)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()
        tokens = fused.decode(pixels, max_new_tokens=40).tokens.tolist()
        assert tokens == _generate(model, pixels, 40).tolist()


def test_a_fused_encoder_that_disagrees_or_fails_is_not_used(monkeypatch, caplog) -> None:
    """As a transformers version that lays out AIMv2's positions otherwise, or lacks the
    helper that builds them, would make it."""
    from transformers import VisionEncoderDecoderModel

    from models.formula.fast_encode import FusedEncoder

    model = VisionEncoderDecoderModel.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    grid = FusedEncoder._grid

    def swapped(self, height, width, like):
        positions = grid(self, height, width, like)
        half = positions.shape[-1] // 2
        return torch.cat([positions[..., half:], positions[..., :half]], dim=-1)

    sizes = {"max_batch_size": 2, "max_new_tokens": 8, "max_source_len": 8 * 128}
    assert StaticGreedyDecoder(model, fused_encoder=True, **sizes)._fused_encoder is not None
    monkeypatch.setattr(FusedEncoder, "_grid", swapped)
    with caplog.at_level("WARNING"):
        decoder = StaticGreedyDecoder(model, fused_encoder=True, **sizes)
    assert decoder._fused_encoder is None
    assert "the fused one differs" in caplog.text

    def missing(self, height, width, like):  # as without transformers' position helper
        raise ImportError("no build_2d_sinusoidal_position_embedding")

    monkeypatch.setattr(FusedEncoder, "_grid", missing)
    with caplog.at_level("WARNING"):
        decoder = StaticGreedyDecoder(model, fused_encoder=True, **sizes)
    assert decoder._fused_encoder is None
    assert "the fused one failed" in caplog.text
    pixels = torch.where(torch.rand(2, 1, 64, 128) < 0.1, -1.0, 1.0)
    assert (
        decoder.decode(pixels, max_new_tokens=8).tokens.tolist()
        == _generate(model, pixels, 8).tolist()
    )


def test_an_encoder_the_fused_one_does_not_reproduce_runs_as_the_model_defines(
    tiny_model,
) -> None:
    from models.formula.fast_encode import FusedEncoder

    assert not FusedEncoder.supports(tiny_model)  # a Swin encoder
    decoder = StaticGreedyDecoder(
        tiny_model,
        max_batch_size=6,
        max_new_tokens=MAX_NEW_TOKENS,
        max_source_len=TINY_SOURCE_LEN,
        fused_encoder=True,
    )
    assert decoder._fused_encoder is None
    pixels = _pixels(3, 256, seed=5)
    expected = _generate(tiny_model, pixels, MAX_NEW_TOKENS)
    assert torch.equal(decoder.decode(pixels, max_new_tokens=MAX_NEW_TOKENS).tokens, expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_widths_decode_as_each_row_would_alone(tiny_model_dir, dtype: str) -> None:
    """The served path: a batch mixing width buckets gives every row its solo tokens, in
    fp32 and in bf16 (whose KV cache and attention stay fp32 on a CPU)."""
    from models.formula.adapter import FormulaInput, FormulaRecognizer

    cpu = torch.device("cpu")
    recognizer = FormulaRecognizer(str(tiny_model_dir), [cpu], decoder="static", dtype=dtype)
    recognizer.open()
    recognizer.load(cpu)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # large cross-attention, so tokens depend on the image and its padding
        for layer in recognizer._models["cpu"].decoder.model.decoder.layers:
            cross = layer.encoder_attn
            for linear in (cross.q_proj, cross.k_proj, cross.v_proj, cross.out_proj):
                linear.weight.normal_(0.0, 1.0, generator=generator)
    recognizer.warmup(cpu, max_batch_size=4)
    assert recognizer.uses_static_decoder(cpu) and recognizer.merge_buckets
    decoder = recognizer._decoders["cpu"]
    assert decoder.dtype == getattr(torch, dtype)
    assert decoder.cross_k.dtype == decoder.self_k.dtype == torch.float32
    rng = np.random.default_rng(0)
    height = recognizer.spec.height
    batch = [
        FormulaInput(rng.integers(0, 256, (height, width), dtype=np.uint8), bucket)
        for width, bucket in ((40, 64), (120, 128), (60, 64), (250, 256))
    ]
    run = recognizer.runner(cpu)
    together = run(batch, lambda: False)
    alone = [run([item], lambda: False)[0] for item in batch]
    assert len({tuple(t.token_ids) for t in alone}) > 1, "rows must depend on their image"
    assert [t.token_ids for t in together] == [t.token_ids for t in alone]

    generate = FormulaRecognizer(str(tiny_model_dir), [cpu], decoder="generate")
    generate.open()
    generate.load(cpu)
    generate.warmup(cpu, max_batch_size=4)
    assert not generate.uses_static_decoder(cpu) and not generate.merge_buckets


def test_encoder_rows_padded_to_a_batch_bucket_decode_the_same(tiny_model_dir) -> None:
    """The CUDA path pads each encoder group up to a batch bucket (few shapes, one graph
    each); the padding rows must not change any real row's tokens."""
    from transformers import VisionEncoderDecoderModel

    model = VisionEncoderDecoderModel.from_pretrained(tiny_model_dir).eval()
    groups = [_pixels(3, 256, seed=1), _pixels(1, 128, seed=2)]  # padded to 4 and 1 rows
    decoders = [
        StaticGreedyDecoder(
            model,
            max_batch_size=6,
            max_new_tokens=MAX_NEW_TOKENS,
            max_source_len=TINY_SOURCE_LEN,
            pad_encoder_rows=pad,
        )
        for pad in (False, True)
    ]
    plain, padded = (decoder.decode(groups).tokens for decoder in decoders)
    assert decoders[1].pad_encoder_rows and not decoders[1].use_cuda_graphs
    assert torch.equal(plain, padded)
    solo = [
        decoders[0].decode(group[i : i + 1]).tokens for group in groups for i in range(len(group))
    ]
    width = max(row.shape[1] for row in solo)
    for i, row in enumerate(solo):
        assert torch.equal(padded[i, : row.shape[1]], row[0]), f"row {i}"
        assert width >= row.shape[1]


def test_batch_invariance_runs_one_step_shape_and_one_encoder_shape(tiny_model_dir) -> None:
    """With batch invariance every step runs all the slots and every encoding
    ENCODER_ROWS rows (a larger group in chunks, the last one padded), and the rows'
    tokens are those of the plain decoder."""
    from transformers import VisionEncoderDecoderModel

    from models.formula.fast_decode import ENCODER_ROWS

    model = VisionEncoderDecoderModel.from_pretrained(tiny_model_dir).eval()
    groups = [_pixels(ENCODER_ROWS + 3, 256, seed=3), _pixels(2, 128, seed=4)]
    plain, invariant = (
        StaticGreedyDecoder(
            model,
            max_batch_size=16,
            max_new_tokens=MAX_NEW_TOKENS,
            max_source_len=TINY_SOURCE_LEN,
            batch_invariant=flag,
        )
        for flag in (False, True)
    )
    encoded, stepped = [], []
    encode, step = invariant._encode, invariant._step
    invariant._encode = lambda pixels: encoded.append(pixels.shape[0]) or encode(pixels)
    invariant._step = lambda rows: stepped.append(rows) or step(rows)
    assert torch.equal(invariant.decode(groups).tokens, plain.decode(groups).tokens)
    assert encoded == [ENCODER_ROWS] * 3  # 8 + 3 (padded) rows of one width, 2 (padded)
    assert stepped and set(stepped) == {16}


def test_pixels_staged_in_an_upload_buffer_match_the_plain_path(tiny_model_dir) -> None:
    """On CUDA the strips of each width group are padded into consecutive slices of one
    pinned buffer and copied asynchronously; the values must be those of the plain path."""
    from models.formula.adapter import FormulaInput, FormulaRecognizer

    cpu = torch.device("cpu")
    recognizer = FormulaRecognizer(str(tiny_model_dir), [cpu])
    recognizer.open()
    recognizer.load(cpu)
    height = recognizer.spec.height
    rng = np.random.default_rng(1)
    groups = [
        [FormulaInput(rng.integers(0, 256, (height, w), dtype=np.uint8), b) for w, b in sizes]
        for sizes in (((40, 64), (60, 64)), ((120, 128),), ((200, 256), (250, 256)))
    ]
    staging = torch.full((6 * height * 256,), 7, dtype=torch.uint8)  # stale bytes
    used = 0
    for items in groups:
        staged = recognizer._pixels(items, "cpu", staging[used:])
        assert torch.equal(staged, recognizer._pixels(items, "cpu"))
        used += staged[:, 0].numel()
    assert used == height * (2 * 64 + 128 + 2 * 256)


@pytest.mark.parametrize("variant", [False, True])
def test_rows_joining_a_running_decode_get_their_solo_tokens(tiny_model, variant: bool) -> None:
    """Continuous batching: rows admitted at different steps, into slots freed by rows
    that finished, each decode exactly as they would alone."""
    import copy

    model = _variant_model() if variant else copy.deepcopy(tiny_model)
    _force_eos(model, _pixels(5, 256, seed=7))
    decoder = StaticGreedyDecoder(
        model, max_batch_size=4, max_new_tokens=MAX_NEW_TOKENS, max_source_len=TINY_SOURCE_LEN
    )
    arrivals = [_pixels(3, 256, seed=7), _pixels(2, 128, seed=8), _pixels(4, 64, seed=9)]
    rows = [group[i : i + 1] for group in arrivals for i in range(group.shape[0])]
    solo = [decoder.decode(row).tokens[0].tolist() for row in rows]
    pad = model.generation_config.pad_token_id
    solo = [row[: max(i for i, t in enumerate(row) if t != pad) + 1] for row in solo]
    assert len(set(map(tuple, solo))) > 1, "rows must differ"
    assert any(len(row) < MAX_NEW_TOKENS + 1 for row in solo), "some rows must end early"

    waiting = list(range(len(rows)))
    slot_of: dict[int, int] = {}
    got: dict[int, list[int]] = {}
    most, joined_running = 0, 0
    while waiting or decoder.running:
        join = waiting[: decoder.free_slots]
        if join:
            joined_running += decoder.running > 0
            slots = decoder.admit([rows[i] for i in join])
            slot_of.update({slot: i for slot, i in zip(slots, join, strict=True)})
            del waiting[: len(join)]
        most = max(most, decoder.running)
        decoder.run()
        for slot, row in decoder.harvest().items():
            got[slot_of.pop(slot)] = row.tokens
    assert most == 4 and joined_running >= 1, "rows joined a running decode"
    for i, expected in enumerate(solo):
        assert got[i] == expected, f"row {i}:\njoined: {got[i]}\nalone:  {expected}"


def test_a_snapshot_harvested_late_reports_each_row_once(tiny_model) -> None:
    """A stream keeps one run ahead of its harvest: an older snapshot gives the rows
    that had ended by then, never one harvested, released or refilled since."""
    decoder = StaticGreedyDecoder(
        tiny_model, max_batch_size=3, max_new_tokens=MAX_NEW_TOKENS, max_source_len=128
    )
    pixels = _pixels(3, 128, seed=5)
    alone = [decoder.decode(pixels[i : i + 1]).tokens[0].tolist() for i in range(3)]
    short = decoder.steps_per_check  # a row with this limit has ended after one run
    (a,) = decoder.admit(pixels[:1], max_new_tokens=short)
    (b,) = decoder.admit(pixels[1:2])
    decoder.run()
    first = decoder.snapshot()
    decoder.run()  # the run queued before the older snapshot is harvested
    second = decoder.snapshot()
    assert _tokens(decoder.harvest(first)) == {a: alone[0][: short + 1]}
    assert decoder.harvest(first) == {}, "a harvested row is reported once"
    (c,) = decoder.admit(pixels[2:3], max_new_tokens=short)
    assert c == a, "the freed slot is refilled"
    assert a not in decoder.harvest(second), "the refilled slot's old row is gone"
    decoder.run()
    third = decoder.snapshot()
    decoder.release([b])
    assert _tokens(decoder.harvest(third)) == {c: alone[2][: short + 1]}, "a released row is not"
    assert decoder.running == 0


def test_a_released_row_frees_its_slot_and_leaves_the_others_alone(tiny_model) -> None:
    decoder = StaticGreedyDecoder(
        tiny_model, max_batch_size=2, max_new_tokens=MAX_NEW_TOKENS, max_source_len=128
    )
    pixels = _pixels(2, 128, seed=3)
    alone = decoder.decode(pixels[1:]).tokens[0].tolist()
    first, second = decoder.admit(pixels)
    decoder.run()
    decoder.release([first])
    assert decoder.free_slots == 1
    (third,) = decoder.admit(pixels[1:])
    assert third == first
    got = {}
    while decoder.running:
        decoder.run()
        got.update(_tokens(decoder.harvest()))
    assert got[third] == alone[: len(got[third])] and got[second] == alone[: len(got[second])]
    with pytest.raises(ValueError, match="max_batch_size=2 with 2 rows running"):
        decoder.admit(pixels)
        decoder.admit(pixels[:1])


def test_a_failed_decode_leaves_every_slot_free(tiny_model) -> None:
    decoder = StaticGreedyDecoder(
        tiny_model, max_batch_size=2, max_new_tokens=MAX_NEW_TOKENS, max_source_len=128
    )
    pixels = _pixels(2, 128, seed=4)

    def fail():
        raise RuntimeError("out of memory, say")

    with pytest.raises(RuntimeError, match="out of memory"):
        decoder.decode(pixels, should_stop=fail)
    assert decoder.running == 0 and decoder.free_slots == 2
    assert torch.equal(decoder.decode(pixels).tokens, _generate(tiny_model, pixels, MAX_NEW_TOKENS))


def test_a_failed_stream_leaves_every_slot_free(tiny_model_dir) -> None:
    """The served stream: an error while rows run (here, from the feed) frees their rows."""
    from models.formula.adapter import FormulaInput, FormulaRecognizer

    cpu = torch.device("cpu")
    recognizer = FormulaRecognizer(str(tiny_model_dir), [cpu], decoder="static")
    recognizer.open()
    recognizer.load(cpu)
    recognizer.warmup(cpu, max_batch_size=2)
    decoder = recognizer._decoders["cpu"]
    blank = np.full((recognizer.spec.height, 64), 255, dtype=np.uint8)

    class FailingFeed:
        waiting = [(1, FormulaInput(blank, 64)), (2, FormulaInput(blank, 64))]

        def take(self, limit):
            taken, self.waiting = self.waiting[:limit], self.waiting[limit:]
            return taken

        def shares_device(self):
            return False

        def cancelled(self, keys):  # asked at every check, while the rows still run
            raise RuntimeError("the pipe broke")

        def done(self, results):
            pass

        def finish(self):
            return not self.waiting

    with pytest.raises(RuntimeError, match="the pipe broke"):
        recognizer.runner(cpu).stream(FailingFeed())
    assert decoder.running == 0


@pytest.mark.parametrize(("ahead", "shared"), [(False, False), (True, False), (True, True)])
def test_a_stream_answers_each_request_with_its_solo_tokens(
    tiny_model_dir, ahead: bool, shared: bool
) -> None:
    """The served stream, harvesting each run at once (CPU) or one run behind (CUDA's
    way, forced here), and on a device shared with another model (runs of
    SHARED_CHECK_EVERY steps): staggered arrivals, more than the rows, each answered once
    with the tokens it gets alone; each look counted in /metrics by its company."""
    from models.formula.adapter import FormulaInput, FormulaRecognizer
    from telemetry import metrics

    cpu = torch.device("cpu")
    recognizer = FormulaRecognizer(str(tiny_model_dir), [cpu], decoder="static")
    recognizer.open()
    recognizer.load(cpu)
    recognizer.warmup(cpu, max_batch_size=3)
    recognizer.stream_ahead = ahead
    rng = np.random.default_rng(11)
    height = recognizer.spec.height
    inputs = [
        FormulaInput(rng.integers(0, 256, (height, width), dtype=np.uint8), width)
        for width in (64, 128, 64, 192, 64, 128, 64)
    ]
    alone = [recognizer.runner(cpu)([item], lambda: False)[0].token_ids for item in inputs]

    class StaggeredFeed:
        def __init__(self):
            self.waiting = list(enumerate(inputs))
            self.checks = 0
            self.answers: dict[int, list[list[int]]] = {}

        def take(self, limit):  # two arrivals at every other check
            self.checks += 1
            if self.checks % 2:
                return []
            taken = self.waiting[: min(limit, 2)]
            self.waiting = self.waiting[len(taken) :]
            return taken

        def shares_device(self):
            return shared

        def cancelled(self, keys):
            return []

        def done(self, results):
            for key, tokens in results:
                self.answers.setdefault(key, []).append(tokens.token_ids)

        def finish(self):
            return not self.waiting

    company = {
        name: metrics.STREAM_CHECKS.labels(recognizer.name, name) for name in ("alone", "shared")
    }
    counted = {name: counter._value.get() for name, counter in company.items()}
    feed = StaggeredFeed()
    recognizer.runner(cpu).stream(feed)
    assert feed.answers == {i: [tokens] for i, tokens in enumerate(alone)}
    assert recognizer._decoders["cpu"].running == 0
    looks = {name: counter._value.get() - counted[name] for name, counter in company.items()}
    assert looks["shared" if shared else "alone"] > 0
    assert looks["alone" if shared else "shared"] == 0


def test_on_a_cpu_a_finished_row_is_seen_after_the_step_that_ends_it(tiny_model) -> None:
    """A CPU reads row state without waiting for a device, so every run is one check: a
    row leaves (and its slot is free for a new one) after its last token, not after the
    rest of a run of CHECK_EVERY steps."""
    decoder = StaticGreedyDecoder(
        tiny_model, max_batch_size=1, max_new_tokens=MAX_NEW_TOKENS, max_source_len=128
    )
    assert decoder.steps_per_check == 1
    (slot,) = decoder.admit(_pixels(1, 128, seed=7), max_new_tokens=3)
    runs = 0
    while decoder.running:
        decoder.run()
        runs += 1
        finished = decoder.harvest()
    assert runs == 3 and list(finished) == [slot]
    assert decoder.free_slots == 1


def test_a_run_on_a_shared_device_is_longer(tiny_model) -> None:
    """Told that another model shares the device, a run is SHARED_CHECK_EVERY
    steps: a row of 3 tokens ends within one such run, where a plain run (one step on a
    CPU) leaves it running; its tokens are the same either way."""
    tokens = {}
    for shared in (False, True):
        decoder = StaticGreedyDecoder(
            tiny_model, max_batch_size=1, max_new_tokens=MAX_NEW_TOKENS, max_source_len=128
        )
        (slot,) = decoder.admit(_pixels(1, 128, seed=7), max_new_tokens=3)
        decoder.run(shared=shared)
        finished = decoder.harvest()
        assert (slot in finished) is shared
        while slot not in finished:
            decoder.run()
            finished = decoder.harvest()
        tokens[shared] = finished[slot].tokens
    assert SHARED_CHECK_EVERY > 3 and tokens[True] == tokens[False]


def _generated_logprobs(model, pixels: torch.Tensor) -> list[float]:
    """Per row, the summed log-probability `generate()` gives its tokens, its end included."""
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        out = model.generate(
            pixel_values=pixels,
            num_beams=1,
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            output_scores=True,
            return_dict_in_generate=True,
        )
        scores = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    sums = []
    for tokens, row in zip(out.sequences[:, 1:].tolist(), scores, strict=True):
        count = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        sums.append(float(row[:count].sum()))
    return sums


def test_each_row_carries_the_log_probability_generate_gives_its_tokens(tiny_model) -> None:
    pixels = _pixels(3, 64, seed=11)
    decoder = StaticGreedyDecoder(
        tiny_model, max_batch_size=3, max_new_tokens=MAX_NEW_TOKENS, max_source_len=TINY_SOURCE_LEN
    )
    expected = _generated_logprobs(tiny_model, pixels)
    assert all(value < 0 for value in expected)
    rows = decoder.decode(pixels).rows
    assert [row.logprob for row in rows] == pytest.approx(expected, abs=1e-4)

    # A row that joins a running decode scores its own tokens only, as it would alone.
    (first,) = decoder.admit(pixels[:1])
    decoder.run()
    (second,) = decoder.admit(pixels[1:2])
    got: dict[int, float] = {}
    while decoder.running:
        decoder.run()
        got.update({slot: row.logprob for slot, row in decoder.harvest().items()})
    assert [got[first], got[second]] == pytest.approx(expected[:2], abs=1e-4)


def test_both_decoders_answer_with_the_same_confidence(tiny_model_dir) -> None:
    """The static decoder and `generate()` read the same tokens with the same
    probabilities, so they report the same confidence, between 0 and 1 (in float32:
    `auto` on a CPU gives the static decoder int8 steps, `generate()` none)."""
    from models.formula.adapter import FormulaInput, FormulaRecognizer

    cpu = torch.device("cpu")
    answers = {}
    for decoder in ("static", "generate"):
        recognizer = FormulaRecognizer(str(tiny_model_dir), [cpu], decoder=decoder, dtype="float32")
        recognizer.open()
        recognizer.load(cpu)
        recognizer.warmup(cpu, max_batch_size=2)
        assert recognizer.uses_static_decoder(cpu) == (decoder == "static")
        rng = np.random.default_rng(2)
        run = recognizer.runner(cpu)
        strips = [rng.integers(0, 256, (recognizer.spec.height, 64), dtype=np.uint8) for _ in "ab"]
        answers[decoder] = run([FormulaInput(strip, 64) for strip in strips], lambda: False)
    static, generate = answers["static"], answers["generate"]
    assert [t.token_ids for t in static] == [t.token_ids for t in generate]
    assert all(0 < t.confidence <= 1 for t in static)
    assert [t.confidence for t in static] == pytest.approx(
        [t.confidence for t in generate], rel=1e-4
    )
