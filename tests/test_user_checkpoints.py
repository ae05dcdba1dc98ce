"""A user's own VisionEncoderDecoderModel checkpoints load, warm up and read as
transformers reads them: tiny random ones built from configs, with the layouts and
settings real ones have (TrOCR's fixed-size ViT encoder, DeiT's centre crop, a processor
saved by transformers 5, a decoder with few positions, ImageNet normalization)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    DeiTConfig,
    DeiTImageProcessor,
    GenerationConfig,
    PreTrainedTokenizerFast,
    TrOCRConfig,
    TrOCRProcessor,
    VisionEncoderDecoderConfig,
    VisionEncoderDecoderModel,
    ViTConfig,
    ViTImageProcessor,
)

from app.settings import Settings
from models.formula.adapter import FormulaRecognizer
from models.formula.preprocess import FormulaImageSpec, normalize_pixels, pad_and_normalize
from tests.conftest import ROOT, formula_png
from training.tiny import FORMULA_TOKENS

CPU = torch.device("cpu")
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
PICTURES = [formula_png(), formula_png("x_1 + x_2 + x_3 + y^2 = z", size=(900, 50))]


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(FORMULA_TOKENS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def build_checkpoint(
    directory: Path,
    *,
    encoder: str = "vit",
    image_size: tuple[int, int] = (32, 96),
    positions: int = 64,
    generation: dict | None = None,
    image_processor=None,
    saved_by_processor: bool = False,
) -> Path:
    """A TrOCR-style checkpoint (ViT or DeiT encoder, TrOCR decoder with learned
    positions) saved as `save_pretrained` saves one. Its weights are drawn large, so its
    tokens depend on the picture, and its end token's logit is held at 0, so that it
    reads on. `generation` is its generation config's settings
    (default: 12 new tokens); `saved_by_processor` saves a TrOCRProcessor, not the image
    processor and tokenizer apart."""
    tokenizer = _tokenizer()
    vocab = tokenizer.get_vocab()
    ids = {"pad_token_id": vocab["<pad>"], "eos_token_id": vocab["</s>"]}
    ids["decoder_start_token_id"] = vocab["</s>"]  # as TrOCR's checkpoints start
    encoder_config = {"vit": ViTConfig, "deit": DeiTConfig}[encoder](
        image_size=list(image_size),
        patch_size=8,
        num_channels=3,
        hidden_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=48,
    )
    decoder_config = TrOCRConfig(
        vocab_size=len(vocab),
        d_model=32,
        decoder_layers=1,
        decoder_attention_heads=2,
        decoder_ffn_dim=64,
        max_position_embeddings=positions,
        use_learned_position_embeddings=True,
        bos_token_id=vocab["<s>"],
        **ids,
    )
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder_config, decoder_config)
    for name, value in ids.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = VisionEncoderDecoderModel(config=config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
        model.decoder.output_projection.weight[ids["eos_token_id"]] = 0.0  # seldom ends early
    generation = {"max_new_tokens": 12} if generation is None else generation
    model.generation_config = GenerationConfig(**ids, **generation)
    model.save_pretrained(directory)
    if image_processor is None:
        size = {"height": image_size[0], "width": image_size[1]}
        image_processor = ViTImageProcessor(size=size, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    if saved_by_processor:
        TrOCRProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(
            directory
        )
    else:
        image_processor.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory


def served(directory: Path, **settings) -> FormulaRecognizer:
    """The checkpoint opened, loaded and warmed up by Texel's adapter on the CPU, float32."""
    recognizer = FormulaRecognizer(str(directory), [CPU], dtype="float32", **settings)
    recognizer.open()
    recognizer.load(CPU)
    recognizer.warmup(CPU, max_batch_size=2)
    return recognizer


def assert_reads_as_generate(recognizer: FormulaRecognizer, directory: Path) -> None:
    """Each picture's tokens from Texel are transformers' greedy `generate()` tokens on
    the same pixels, with the same model in float32."""
    model = VisionEncoderDecoderModel.from_pretrained(directory, dtype=torch.float32).eval()
    special = set(recognizer.tokenizer.all_special_ids)
    run = recognizer.runner(CPU)
    for picture in PICTURES:
        item = recognizer.preprocess(picture)
        got = run([item], lambda: False)[0].token_ids
        pixels = torch.from_numpy(pad_and_normalize([item.strip], item.bucket, recognizer.spec))
        with torch.inference_mode():
            sequence = model.generate(
                pixel_values=pixels,
                max_new_tokens=recognizer.max_new_tokens,
                num_beams=1,
                do_sample=False,
            )[0].tolist()
        assert got, "the picture must be read"
        assert got == [t for t in sequence if t not in special]


def test_a_vit_encoder_wider_than_a_bucket_warms_up_at_its_one_size_and_reads_as_generate(
    tmp_path,
):
    directory = build_checkpoint(tmp_path, image_size=(32, 96))
    recognizer = served(directory, bucket_step=64)
    assert recognizer.uses_static_decoder(CPU)
    assert {recognizer.preprocess(p).bucket for p in PICTURES} == {96}
    assert_reads_as_generate(recognizer, directory)


def test_a_fixed_size_encoder_takes_its_size_from_its_config_over_its_processor(tmp_path, caplog):
    processor = ViTImageProcessor(size={"height": 64, "width": 1024})
    directory = build_checkpoint(tmp_path, image_size=(32, 96), image_processor=processor)
    with caplog.at_level("WARNING"):
        recognizer = served(directory, decoder="generate")
    assert (recognizer.spec.height, recognizer.spec.max_width) == (32, 96)
    assert "64x1024" in caplog.text and "32x96" in caplog.text
    assert_reads_as_generate(recognizer, directory)


def test_a_square_encoder_whose_processor_names_a_shortest_edge_reads_at_its_size(tmp_path):
    processor = ViTImageProcessor(size={"shortest_edge": 32})
    directory = build_checkpoint(tmp_path, image_size=(32, 32), image_processor=processor)
    recognizer = served(directory, decoder="generate")
    assert (recognizer.spec.height, recognizer.spec.max_width) == (32, 32)
    assert_reads_as_generate(recognizer, directory)


def test_a_deit_encoder_whose_processor_crops_the_centre_reads_at_the_crop_without_warning(
    tmp_path, caplog
):
    processor = DeiTImageProcessor(
        size={"height": 40, "width": 72},
        crop_size={"height": 32, "width": 64},
        do_center_crop=True,
    )
    directory = build_checkpoint(
        tmp_path, encoder="deit", image_size=(32, 64), image_processor=processor
    )
    with caplog.at_level("WARNING"):
        recognizer = served(directory, decoder="generate")
    assert (recognizer.spec.height, recognizer.spec.max_width) == (32, 64)
    assert "input size" not in caplog.text
    assert_reads_as_generate(recognizer, directory)


def test_a_processor_that_crops_sets_the_size_of_a_variable_width_model(tmp_path):
    DeiTImageProcessor(
        size={"height": 40, "width": 300}, crop_size={"height": 32, "width": 256}
    ).save_pretrained(tmp_path)
    spec = FormulaImageSpec.from_pretrained(tmp_path)
    assert (spec.height, spec.max_width) == (32, 256)


def test_a_folder_saved_by_a_transformers_5_processor_is_accepted_and_served(tmp_path):
    directory = build_checkpoint(tmp_path, saved_by_processor=True)
    assert (directory / "processor_config.json").is_file()
    assert not (directory / "preprocessor_config.json").exists()
    settings = Settings(
        device="cpu",
        formula={"model": str(directory)},
        image={"enabled": False, "model": str(ROOT / "models" / "image" / "default")},
    )
    assert settings.serving_problems() == []
    recognizer = served(directory, decoder="generate")
    assert (recognizer.spec.height, recognizer.spec.max_width) == (32, 96)
    assert_reads_as_generate(recognizer, directory)


def test_a_folder_with_neither_processor_file_is_refused_naming_both(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    settings = Settings(
        device="cpu",
        formula={"model": str(tmp_path)},
        image={"enabled": False, "model": str(ROOT / "models" / "image" / "default")},
    )
    assert settings.serving_problems() == [
        f"TEXEL_FORMULA__MODEL={tmp_path}: not a VisionEncoderDecoderModel folder, it has no "
        "preprocessor_config.json or processor_config.json"
    ]


def test_a_decoder_with_fewer_positions_than_the_default_limit_gets_a_limit_that_fits(tmp_path):
    directory = build_checkpoint(tmp_path, positions=16, generation={})
    recognizer = served(directory)
    assert recognizer.uses_static_decoder(CPU)
    assert recognizer.max_new_tokens == 16
    assert_reads_as_generate(recognizer, directory)


def test_a_generation_config_max_length_limits_the_output_less_its_start_token(tmp_path):
    directory = build_checkpoint(tmp_path, positions=64, generation={"max_length": 10})
    recognizer = FormulaRecognizer(str(directory), [CPU])
    recognizer.open()
    assert recognizer.max_new_tokens == 9


def test_a_max_new_tokens_setting_beyond_the_decoders_positions_is_refused_naming_it(tmp_path):
    directory = build_checkpoint(tmp_path, positions=16)
    recognizer = FormulaRecognizer(str(directory), [CPU], max_new_tokens=300)
    with pytest.raises(ValueError, match="TEXEL_FORMULA__ADVANCED__MAX_NEW_TOKENS.*16 positions"):
        recognizer.open()


def test_an_rgb_model_is_normalized_per_channel_as_its_image_processor_does(tmp_path):
    processor = ViTImageProcessor(
        size={"height": 32, "width": 64}, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD
    )
    directory = build_checkpoint(tmp_path, image_size=(32, 64), image_processor=processor)
    recognizer = served(directory, decoder="generate")
    item = recognizer.preprocess(PICTURES[0])
    rgb = np.repeat(item.strip[:, :, None], 3, axis=2)
    expected = processor(rgb, do_resize=False, return_tensors="pt").pixel_values
    on_host = torch.from_numpy(pad_and_normalize([item.strip], item.bucket, recognizer.spec))
    on_device = normalize_pixels(torch.tensor(item.strip[None]), recognizer.spec)
    torch.testing.assert_close(on_host, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(on_device, expected, rtol=0, atol=1e-6)
    assert_reads_as_generate(recognizer, directory)


def test_a_processor_that_does_not_normalize_leaves_the_pixels_rescaled(tmp_path):
    ViTImageProcessor(do_normalize=False, image_mean=IMAGENET_MEAN).save_pretrained(tmp_path)
    spec = FormulaImageSpec.from_pretrained(tmp_path, channels=3)
    strip = np.array([[0, 51, 255]], dtype=np.uint8)
    expected = np.repeat((strip / 255.0).astype(np.float32)[None, None], 3, axis=1)
    np.testing.assert_array_equal(pad_and_normalize([strip], 3, spec), expected)
