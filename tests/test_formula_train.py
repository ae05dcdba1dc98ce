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


def test_a_vocabulary_extended_for_school_maths_keeps_every_saved_id() -> None:
    from training.formula.train import extended_vocabulary, school_tokens

    saved = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "x": 4, "\\frac": 5, "{": 6, "}": 7}
    school = ["x \\geqslant 1", "\\geqslant x", "\\LambdaBEF x"]  # a glued typo, used once
    tokens = school_tokens(school)

    vocabulary = extended_vocabulary(saved, tokens | {"x", "{"})

    assert vocabulary[: len(saved)] == sorted(saved, key=saved.__getitem__)
    # "1" and the typo are each used by one formula only.
    assert vocabulary[len(saved) :] == ["\\geqslant"]


def test_a_resized_vocabulary_keeps_the_trained_rows_and_ties_the_output(tmp_path) -> None:
    from transformers import VisionEncoderDecoderModel

    from training.formula.train import resize_vocabulary
    from training.tiny import build_tiny_formula_model

    model = VisionEncoderDecoderModel.from_pretrained(build_tiny_formula_model(tmp_path / "m"))
    size = model.config.decoder.vocab_size
    before = model.decoder.get_input_embeddings().weight.detach().clone()

    grown = resize_vocabulary(model, size + 5)

    embeddings = grown.decoder.get_input_embeddings().weight
    assert grown.config.decoder.vocab_size == size + 5 and embeddings.shape[0] == size + 5
    assert torch.equal(embeddings[:size], before)
    assert grown.decoder.get_output_embeddings().weight.shape[0] == size + 5
    grown.save_pretrained(tmp_path / "grown")
    again = VisionEncoderDecoderModel.from_pretrained(tmp_path / "grown")
    assert again.decoder.get_input_embeddings().weight.shape[0] == size + 5


def test_school_formulas_take_the_im2latex_style() -> None:
    from training.formula.school import is_dev, normalize

    assert normalize(r"\frac{3}{2^{10}}") == r"\frac { 3 } { 2 ^ { 1 0 } }"
    assert normalize(r"\left(x\right)+\left\{a\right.") == r"\left( x \right) + \left\{ a \right."
    assert normalize(r"\left\langle a,b \right\rangle") == r"\left\langle a , b \right\rangle"
    assert normalize(r"\text { A. } x") == r"\text { A . } x"
    assert normalize("  ") == ""
    # The split is fixed by the normalized text, so typing style does not move a formula.
    assert is_dev(normalize(r"\frac{1}{2}")) == is_dev(r"\frac { 1 } { 2 }")


def test_smaller_copies_shrink_a_share_of_the_pictures_and_keep_their_labels() -> None:
    import numpy as np
    from PIL import Image, ImageDraw

    from models.formula.preprocess import prepare_strip
    from training.formula.train import default_spec, smaller_copies

    spec = default_spec()
    grays = []
    for i in range(10):
        picture = Image.new("L", (300, 48), 255)
        ImageDraw.Draw(picture).text((6, 10), f"x_{i} + y = {i * 7}", fill=0, font_size=26)
        grays.append(np.asarray(picture))
    items = [(prepare_strip(Image.fromarray(g), spec), [5, i, 2]) for i, g in enumerate(grays)]
    copies = smaller_copies(items, grays, 0.5, spec, np.random.default_rng(0), workers=1)
    assert len(copies) == 5
    labels = [ids for _, ids in items]
    for strip, ids in copies:
        assert ids in labels
        original = items[labels.index(ids)][0]
        assert strip.shape[0] == spec.height
        assert strip.dtype == np.uint8 and strip.min() < 128  # ink survives the shrink
        assert strip.shape != original.shape or not np.array_equal(strip, original)


def test_merged_tokens_shorten_a_formula_and_the_server_answers_the_same_latex(tmp_path) -> None:
    import torch

    from models.formula.adapter import FormulaRecognizer, FormulaTokens
    from training.formula.tokenizer import (
        build_tokenizer,
        build_vocabulary,
        encode_formula,
        learn_merges,
        model_tokens,
    )
    from training.tiny import build_tiny_formula_model

    formulas = ["x _ { 2 } ^ { 2 }", "a _ { 1 } + b _ { 2 }", r"\frac { 1 } { 2 } _ { 2 }"]
    merges = learn_merges(formulas, 3)
    # The most frequent pair first; of `{ 2` and `2 }` (5 times each), the one seen first.
    assert merges[0] == "{ 2"
    assert learn_merges(formulas, 3) == merges  # the same formulas, the same merges
    assert learn_merges(["a b", "c d"], 5) == []  # no pair seen twice: nothing to merge
    tokenizer = build_tokenizer([*build_vocabulary(formulas), "_ {", "_ { 2 }", "{ 2"])
    # The longest merged token first: `_ { 2 }` over `_ {`, and `{ 2` elsewhere.
    assert model_tokens(tokenizer, r"\frac { 1 } { 2 } _ { 2 }") == [
        r"\frac",
        "{",
        "1",
        "}",
        "{ 2",
        "}",
        "_ { 2 }",
    ]
    assert model_tokens(tokenizer, "b _ { 1 }") == ["b", "_ {", "1", "}"]
    # A model directory whose tokenizer has merged tokens, as train.py --merges saves it:
    # the server's answer is the same spaced LaTeX as without them.
    model_dir = build_tiny_formula_model(tmp_path / "m")
    tokenizer.save_pretrained(model_dir)
    recognizer = FormulaRecognizer(str(model_dir), [torch.device("cpu")])
    recognizer.open()
    for formula in formulas:
        ids = encode_formula(recognizer.tokenizer, formula, 100)
        assert len(ids) - 1 < len(formula.split())
        recognized = recognizer.detokenize(FormulaTokens(ids, 0.0))
        assert recognized.latex == formula
        assert recognized.tokens == len(ids)


def test_a_merged_token_starts_at_the_mean_of_its_parts(tmp_path) -> None:
    from transformers import VisionEncoderDecoderModel

    from training.formula.train import init_merged_rows, resize_vocabulary
    from training.tiny import FORMULA_TOKENS, build_tiny_formula_model

    model = VisionEncoderDecoderModel.from_pretrained(build_tiny_formula_model(tmp_path / "m"))
    size = model.config.decoder.vocab_size
    before = model.decoder.get_input_embeddings().weight.detach().clone()
    vocabulary = [*FORMULA_TOKENS[:size], "1 2", "1 2 3"]
    ids = {token: i for i, token in enumerate(vocabulary)}

    model = init_merged_rows(resize_vocabulary(model, len(vocabulary)), vocabulary, size)

    rows = model.decoder.get_input_embeddings().weight
    assert torch.equal(rows[:size], before)
    for merged in ("1 2", "1 2 3"):
        parts = [ids[part] for part in merged.split()]
        assert torch.allclose(rows[ids[merged]], before[parts].mean(dim=0))
    assert torch.equal(model.decoder.get_output_embeddings().weight, rows)  # tied


def test_averaged_checkpoints_are_the_mean_in_the_saved_dtype_and_load(tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import VisionEncoderDecoderModel

    from training.formula.average import main as average
    from training.tiny import build_tiny_formula_model

    first = build_tiny_formula_model(tmp_path / "a")
    model = VisionEncoderDecoderModel.from_pretrained(first)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    model.half().save_pretrained(tmp_path / "b")
    VisionEncoderDecoderModel.from_pretrained(first).half().save_pretrained(tmp_path / "a16")
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (tmp_path / "b" / name).write_bytes((first / name).read_bytes())
        (tmp_path / "a16" / name).write_bytes((first / name).read_bytes())

    average(["--out", str(tmp_path / "mean"), str(tmp_path / "a16"), str(tmp_path / "b")])

    a = load_file(tmp_path / "a16" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    mean = load_file(tmp_path / "mean" / "model.safetensors")
    assert mean.keys() == a.keys()
    for key, value in mean.items():
        assert value.dtype == a[key].dtype == torch.float16
        expected = ((a[key].float() + b[key].float()) / 2).half()
        assert torch.equal(value, expected), key
    assert any(not torch.equal(mean[k], a[k]) for k in a), "nothing was averaged"
    VisionEncoderDecoderModel.from_pretrained(tmp_path / "mean")  # a complete model


def test_checkpoints_of_other_vocabularies_are_not_averaged(tmp_path) -> None:
    import pytest

    from training.formula.average import main as average
    from training.tiny import build_tiny_formula_model

    first = build_tiny_formula_model(tmp_path / "a")
    other = tmp_path / "b"
    other.mkdir()
    for path in first.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    tokenizer = (other / "tokenizer.json").read_text()
    (other / "tokenizer.json").write_text(tokenizer.replace('"\\\\frac"', '"\\\\dfrac"', 1))
    assert (other / "tokenizer.json").read_text() != tokenizer

    with pytest.raises(SystemExit, match="differs"):
        average(["--out", str(tmp_path / "mean"), str(first), str(other)])
    assert not (tmp_path / "mean").exists()


def test_checkpoints_saved_by_another_transformers_release_are_averaged(tmp_path) -> None:
    """A continuation trained elsewhere writes its config with another release's defaults
    spelled out; it is the same model, so it averages. A real difference is refused."""
    import json

    import pytest

    from training.formula.average import main as average
    from training.tiny import build_tiny_formula_model

    first = build_tiny_formula_model(tmp_path / "a")
    other = tmp_path / "b"
    other.mkdir()
    for path in first.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    config = json.loads((other / "config.json").read_text())
    config["transformers_version"] = "5.17.0"
    config["decoder"]["_name_or_path"] = ""
    config["decoder"]["output_attentions"] = False  # a default, written out
    (other / "config.json").write_text(json.dumps(config, indent=2))

    average(["--out", str(tmp_path / "mean"), str(first), str(other)])
    assert (tmp_path / "mean" / "model.safetensors").exists()

    config["decoder"]["dropout"] = 0.25  # not what the first model trains with
    (other / "config.json").write_text(json.dumps(config, indent=2))
    with pytest.raises(SystemExit, match="config.json differs"):
        average(["--out", str(tmp_path / "mean2"), str(first), str(other)])


def test_cycles_restart_the_cosine_decay_at_the_peak() -> None:
    from training.formula.train import lr_at

    peak, warmup = 1e-4, 10
    one = [lr_at(100, p, warmup, peak) for p in (0.0, 0.5, 0.999, 1.0)]
    assert one[0] == peak and one[1] < peak and one[2] < 0.03 * peak and one[3] == 0.02 * peak
    three = [lr_at(100, p, warmup, peak, cycles=3) for p in (0.0, 0.333, 1 / 3 + 1e-6, 0.999)]
    assert three[0] == peak and three[1] < 0.03 * peak  # annealed at each cycle's end
    assert abs(three[2] - peak) < 1e-9  # and restarted
    assert three[3] < 0.03 * peak
    assert lr_at(4, 0.0, warmup, peak, cycles=3) == peak * 5 / warmup  # warm-up once
