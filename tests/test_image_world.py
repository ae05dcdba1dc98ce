"""The shapes world, its judge and the shipped demonstration image pipeline."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from training.image import judge, shapes
from training.image.train import build_tokenizer

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "image" / "default"


def _scenes(count: int, seed: int) -> list[tuple[str, np.ndarray]]:
    rng = random.Random(seed)
    return [
        (prompt, np.asarray(image))
        for prompt, image in (shapes.sample_scene(rng, held_out=None) for _ in range(count))
    ]


# ---------------------------------------------------------------- grammar


def test_prompts_of_each_template_read_exactly_as_the_grammar_states():
    assert (
        shapes.prompt_for(shapes.SceneSpec("blue", (("red", "circle"),)))
        == "a red circle on a blue background"
    )
    assert (
        shapes.prompt_for(shapes.SceneSpec("white", (("gray", "square"),) * 3))
        == "three gray squares on a white background"
    )
    pair = shapes.SceneSpec("black", (("yellow", "triangle"), ("green", "circle")))
    assert shapes.prompt_for(pair) == "a yellow triangle and a green circle on a black background"


def test_every_random_prompt_parses_back_to_its_scene():
    rng = random.Random(0)
    for _ in range(500):
        spec = shapes.random_spec(rng, held_out=None)
        assert shapes.parse_prompt(shapes.prompt_for(spec)) == spec


@pytest.mark.parametrize(
    "prompt",
    [
        "a red circle on a red background",
        "a red circle and a red square on a blue background",
        "four red circles on a blue background",
        "a pink circle on a blue background",
        "a red hexagon on a blue background",
    ],
)
def test_prompts_outside_the_grammar_are_rejected(prompt):
    with pytest.raises(ValueError):
        shapes.parse_prompt(prompt)


def test_training_prompts_never_contain_a_held_out_combination():
    rng = random.Random(1)
    assert not any(shapes.random_spec(rng).is_held_out for _ in range(2000))


def test_every_colour_shape_and_background_is_still_seen_in_training():
    seen = {
        (c, s, b)
        for c in shapes.COLOURS
        for s in shapes.SHAPES
        for b in shapes.COLOURS
        if c != b and (c, s, b) not in shapes.HELD_OUT
    }
    assert {c for c, _, _ in seen} == set(shapes.COLOURS)
    assert {s for _, s, _ in seen} == set(shapes.SHAPES)
    assert {b for _, _, b in seen} == set(shapes.COLOURS)
    assert all(c != b for c, _, b in shapes.HELD_OUT)


def test_tokenizer_keeps_every_grammar_word_whole(tmp_path):
    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    prompt = "three purple triangles on a orange background"
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(prompt).input_ids)
    assert tokens[1:-1] == [word + "</w>" for word in prompt.split()]
    assert tokenizer.model_max_length == 16


# ---------------------------------------------------------------- renderer


def test_renderer_draws_the_background_colour_at_the_native_size():
    spec = shapes.SceneSpec("green", (("white", "square"),))
    image = shapes.render(spec, shapes.place(spec, random.Random(0)))
    assert image.size == (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE)
    assert image.getpixel((0, 0)) == shapes.PALETTE["green"]


def test_rendered_edges_are_anti_aliased():
    spec = shapes.SceneSpec("black", (("white", "circle"),))
    pixels = np.asarray(shapes.render(spec, shapes.place(spec, random.Random(0))))
    grey_levels = set(np.unique(pixels[..., 0]).tolist())
    assert len(grey_levels - {0, 255}) > 5


def test_placed_shapes_never_overlap_and_stay_inside_the_image():
    rng = random.Random(2)
    for _ in range(300):
        spec = shapes.SceneSpec("white", (("red", "triangle"),) * 3)
        placed = shapes.place(spec, rng)
        for i, a in enumerate(placed):
            assert a.radius <= a.x <= shapes.IMAGE_SIZE - a.radius
            assert a.radius <= a.y <= shapes.IMAGE_SIZE - a.radius
            assert abs(a.rotation) <= shapes.MAX_ROTATION_DEGREES
            for b in placed[i + 1 :]:
                assert math.hypot(a.x - b.x, a.y - b.y) > a.radius + b.radius


def test_same_seed_renders_the_same_scenes():
    first, second = shapes.render_batch(8, seed=3), shapes.render_batch(8, seed=3)
    assert first[0] == second[0]
    assert np.array_equal(first[1], second[1])


# ---------------------------------------------------------------- judge


def test_judge_scores_rendered_ground_truth_near_perfectly():
    scenes = _scenes(300, seed=4)
    scores = [judge.score(pixels, prompt) for prompt, pixels in scenes]
    for criterion in judge.CRITERIA:
        assert sum(s[criterion] for s in scores) / len(scores) >= 0.98, criterion


def test_judge_scores_random_noise_near_zero():
    rng = np.random.default_rng(5)
    prompts = [prompt for prompt, _ in _scenes(100, seed=6)]
    scores = [
        judge.score(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), prompt) for prompt in prompts
    ]
    for criterion in judge.CRITERIA:
        assert sum(s[criterion] for s in scores) / len(scores) <= 0.05, criterion


def test_judge_counts_a_missing_object_against_count_alone():
    spec = shapes.SceneSpec("blue", (("yellow", "circle"),) * 2)
    placed = shapes.place(spec, random.Random(7))
    one_drawn = shapes.render(spec, placed[:1])
    assert judge.score(one_drawn, spec) == {
        "background": True,
        "colour": True,
        "shape": True,
        "count": False,
    }


def test_judge_counts_a_wrong_shape_in_a_group_as_wrong():
    spec = shapes.SceneSpec("white", (("red", "circle"),) * 2)
    drawn = shapes.SceneSpec("white", (("red", "circle"), ("red", "square")))
    image = shapes.render(drawn, shapes.place(drawn, random.Random(9)))
    assert judge.score(image, spec)["shape"] is False


def test_judge_counts_a_missing_colour_as_wrong():
    spec = shapes.SceneSpec("black", (("orange", "square"), ("blue", "circle")))
    drawn = shapes.SceneSpec("black", (("orange", "square"), ("purple", "circle")))
    image = shapes.render(drawn, shapes.place(drawn, random.Random(10)))
    assert judge.score(image, spec)["colour"] is False


def test_judge_names_each_shape_it_sees():
    for shape in shapes.SHAPES:
        spec = shapes.SceneSpec("gray", (("orange", shape),))
        image = shapes.render(spec, shapes.place(spec, random.Random(8)))
        assert [o.shape for o in judge.detect(image).objects] == [shape]


# ---------------------------------------------------------------- shipped pipeline


@pytest.fixture(scope="module")
def pipe():
    diffusers = pytest.importorskip("diffusers")
    if not (SHIPPED / "model_index.json").exists():
        pytest.skip("no shipped image pipeline")
    loaded = diffusers.DiffusionPipeline.from_pretrained(str(SHIPPED))
    loaded.set_progress_bar_config(disable=True)
    return loaded


def _generate(pipe, prompts, seeds, steps=None, guidance=None):
    """The call the service makes: fresh scheduler, one generator per image, a step callback."""
    defaults = json.loads((SHIPPED / "texel.json").read_text())
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    steps_seen = []

    def on_step_end(_pipe, step, _timestep, tensors):
        steps_seen.append(step)
        return tensors

    steps = steps or defaults["num_inference_steps"]
    images = pipe(
        prompt=prompts,
        negative_prompt=None,
        num_inference_steps=steps,
        guidance_scale=guidance or defaults["guidance_scale"],
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        output_type="pil",
        callback_on_step_end=on_step_end,
    ).images
    assert steps_seen == list(range(steps))
    return images


def test_shipped_pipeline_is_small_and_declares_its_defaults(pipe):
    total = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert total <= 50_000_000
    defaults = json.loads((SHIPPED / "texel.json").read_text())
    assert set(defaults) == {"num_inference_steps", "guidance_scale"}
    native = pipe.unet.config.sample_size * pipe.vae_scale_factor
    assert native == shapes.IMAGE_SIZE


def test_shipped_pipeline_gives_the_same_image_for_the_same_seed(pipe):
    prompt = ["a red circle on a blue background"]
    first = np.asarray(_generate(pipe, prompt, [11], steps=4)[0])
    second = np.asarray(_generate(pipe, prompt, [11], steps=4)[0])
    assert first.shape == (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE, 3)
    assert np.array_equal(first, second)


FIXED_PROMPTS = [
    "a red circle on a blue background",
    "two white squares on a black background",
    "a yellow triangle and a green circle on a gray background",
]


def test_shipped_pipeline_paints_the_asked_background(pipe):
    images = _generate(pipe, FIXED_PROMPTS, [0, 1, 2])
    for image, prompt in zip(images, FIXED_PROMPTS, strict=True):
        assert judge.score(image, prompt)["background"], prompt


def test_the_evaluation_can_judge_a_running_service(server):
    """`evaluate --url`: the same cases through POST /generate, as RGB arrays to judge."""
    from training.image.evaluate import Case, served_images

    # short prompts: the tiny test model's text encoder reads only a few tokens
    some = [Case("red", 1, True), Case("blue", 2, False), Case("red", 3, False)]
    images = served_images(server.url, concurrency=3)(some)
    assert len(images) == 3
    for image in images:
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    again = served_images(server.url, concurrency=1)(some[:1])  # same seed, same image
    assert np.array_equal(again[0], images[0])
