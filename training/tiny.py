"""Tiny randomly initialized models built from configs, for tests and development.

They have the exact layout of real ones (`save_pretrained` directories that load
through `from_pretrained`), so the whole serving path runs against them on a
CPU in milliseconds. Their outputs are noise: they exercise the plumbing, they
do not recognize formulas or draw anything meaningful.

    python -m training.tiny formula DIR
    python -m training.tiny image DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from models.formula.preprocess import FormulaImageSpec

FORMULA_TOKENS = [
    "<pad>",
    "<s>",
    "</s>",
    "<unk>",
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "8",
    "9",
    "a",
    "b",
    "c",
    "d",
    "x",
    "y",
    "z",
    "+",
    "-",
    "=",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "^",
    "_",
    ",",
    ".",
    "\\frac",
    "\\sqrt",
    "\\alpha",
    "\\beta",
    "\\pi",
    "\\sum",
    "\\int",
    "\\infty",
    "\\left",
    "\\right",
]


def build_tiny_formula_model(directory: str | Path, seed: int = 0) -> Path:
    """A ~0.3 M-parameter Swin + TrOCR-decoder VisionEncoderDecoderModel with a LaTeX vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        SwinConfig,
        SwinModel,
        TrOCRConfig,
        TrOCRForCausalLM,
        VisionEncoderDecoderModel,
    )

    directory = Path(directory)
    torch.manual_seed(seed)
    vocab = {token: i for i, token in enumerate(FORMULA_TOKENS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    spec = FormulaImageSpec(height=32, max_width=256, width_multiple=32, channels=1)
    encoder = SwinModel(
        SwinConfig(
            image_size=(spec.height, spec.max_width),
            num_channels=1,
            patch_size=4,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
            use_absolute_embeddings=False,
        )
    )
    decoder = TrOCRForCausalLM(
        TrOCRConfig(
            vocab_size=len(vocab),
            d_model=32,
            decoder_layers=1,
            decoder_attention_heads=2,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            cross_attention_hidden_size=encoder.config.hidden_size,
            pad_token_id=vocab["<pad>"],
            bos_token_id=vocab["<s>"],
            eos_token_id=vocab["</s>"],
            decoder_start_token_id=vocab["<s>"],
            use_learned_position_embeddings=True,
        )
    )
    model = VisionEncoderDecoderModel(encoder=encoder, decoder=decoder)
    model.config.decoder_start_token_id = vocab["<s>"]
    model.config.pad_token_id = vocab["<pad>"]
    model.config.eos_token_id = vocab["</s>"]
    model.generation_config.decoder_start_token_id = vocab["<s>"]
    model.generation_config.pad_token_id = vocab["<pad>"]
    model.generation_config.eos_token_id = vocab["</s>"]
    model.generation_config.max_new_tokens = 24
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(
        json.dumps(spec.to_preprocessor_config(), indent=2)
    )
    return directory


def byte_level_vocab() -> dict[str, int]:
    """A character-level vocabulary in CLIP's byte-to-unicode alphabet (no merges)."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return {token: i for i, token in enumerate(tokens)}


def build_tiny_image_pipeline(directory: str | Path, seed: int = 0) -> Path:
    """A StableDiffusionPipeline of a few hundred thousand parameters, 32x32 by default."""
    from diffusers import (
        AutoencoderKL,
        DPMSolverMultistepScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    directory = Path(directory)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=8,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=32,
    )
    vocab = byte_level_vocab()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(vocab),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
            bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=vocab["<|endoftext|>"],
            pad_token_id=vocab["<|endoftext|>"],
        )
    )
    token_dir = directory / "tokenizer"
    token_dir.mkdir(parents=True, exist_ok=True)
    (token_dir / "vocab.json").write_text(json.dumps(vocab))
    (token_dir / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(
        str(token_dir / "vocab.json"), str(token_dir / "merges.txt"), model_max_length=32
    )
    scheduler = DPMSolverMultistepScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(directory)
    (directory / "texel.json").write_text(
        json.dumps({"num_inference_steps": 4, "guidance_scale": 3.0})
    )
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["formula", "image"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build = build_tiny_formula_model if args.kind == "formula" else build_tiny_image_pipeline
    print(build(args.directory, args.seed))


if __name__ == "__main__":
    main()
