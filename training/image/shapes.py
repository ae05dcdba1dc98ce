"""The synthetic shapes world that Texel's demonstration image model is trained on.

Scenes are flat circles, squares and triangles on a plain background, drawn
with PIL (supersampled, so edges are anti-aliased) at random positions, sizes
and slight rotations, never overlapping. Every scene has exactly one prompt in
the grammar below, and every prompt parses back into a `SceneSpec`, which is
what the judge checks generated pixels against.

    a {colour} {shape} on a {background} background
    {two|three} {colour} {shape}s on a {background} background
    a {colour} {shape} and a {colour} {shape} on a {background} background

A fixed set of (colour, shape, background) combinations never appears in
training data, so adherence on them measures composition rather than memory.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 64
SUPERSAMPLE = 4

# Saturated hues plus white, black and a mid gray, far enough apart in RGB
# that each reads unambiguously as its name.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 30),
    "green": (20, 170, 40),
    "blue": (30, 60, 235),
    "yellow": (250, 225, 10),
    "orange": (255, 125, 0),
    "purple": (140, 30, 190),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
}
COLOURS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COUNT_WORDS: dict[int, str] = {2: "two", 3: "three"}

# (colour, shape, background) triples never shown in training. Every colour,
# shape and background still appears in training in other combinations.
HELD_OUT: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("red", "circle", "blue"),
        ("green", "circle", "white"),
        ("yellow", "circle", "purple"),
        ("gray", "circle", "orange"),
        ("black", "circle", "yellow"),
        ("purple", "circle", "green"),
        ("blue", "square", "yellow"),
        ("orange", "square", "black"),
        ("white", "square", "red"),
        ("purple", "square", "gray"),
        ("green", "square", "orange"),
        ("red", "square", "green"),
        ("yellow", "triangle", "black"),
        ("white", "triangle", "blue"),
        ("black", "triangle", "white"),
        ("orange", "triangle", "purple"),
        ("gray", "triangle", "red"),
        ("blue", "triangle", "green"),
    }
)

# Object size is its circumradius in output pixels; the margin keeps shapes
# apart from each other and from the image border.
MIN_RADIUS = 7.0
MAX_RADIUS = 11.0
MAX_ROTATION_DEGREES = 20.0
MARGIN = 2.0


@dataclass(frozen=True)
class SceneSpec:
    """What a prompt asks for: a background and a list of (colour, shape) objects."""

    background: str
    objects: tuple[tuple[str, str], ...]

    @property
    def triples(self) -> tuple[tuple[str, str, str], ...]:
        return tuple((colour, shape, self.background) for colour, shape in self.objects)

    @property
    def is_held_out(self) -> bool:
        return any(triple in HELD_OUT for triple in self.triples)


@dataclass(frozen=True)
class PlacedShape:
    colour: str
    shape: str
    x: float
    y: float
    radius: float
    rotation: float


def prompt_for(spec: SceneSpec) -> str:
    """The one prompt in the grammar that describes `spec`."""
    objects = spec.objects
    tail = f"on a {spec.background} background"
    if len(objects) == 1:
        colour, shape = objects[0]
        return f"a {colour} {shape} {tail}"
    if len(set(objects)) == 1:
        colour, shape = objects[0]
        return f"{COUNT_WORDS[len(objects)]} {colour} {shape}s {tail}"
    (c1, s1), (c2, s2) = objects
    return f"a {c1} {s1} and a {c2} {s2} {tail}"


_COLOUR = "|".join(COLOURS)
_SHAPE = "|".join(SHAPES)
_SINGLE = re.compile(rf"a ({_COLOUR}) ({_SHAPE}) on a ({_COLOUR}) background")
_COUNTED = re.compile(rf"(two|three) ({_COLOUR}) ({_SHAPE})s on a ({_COLOUR}) background")
_PAIR = re.compile(
    rf"a ({_COLOUR}) ({_SHAPE}) and a ({_COLOUR}) ({_SHAPE}) on a ({_COLOUR}) background"
)


def parse_prompt(prompt: str) -> SceneSpec:
    """Parse a prompt of the grammar; raises ValueError for anything else."""
    text = prompt.strip()
    if m := _SINGLE.fullmatch(text):
        spec = SceneSpec(m[3], ((m[1], m[2]),))
    elif m := _COUNTED.fullmatch(text):
        count = 2 if m[1] == "two" else 3
        spec = SceneSpec(m[4], ((m[2], m[3]),) * count)
    elif m := _PAIR.fullmatch(text):
        if m[1] == m[3]:
            raise ValueError(f"the two objects must have different colours: {prompt!r}")
        spec = SceneSpec(m[5], ((m[1], m[2]), (m[3], m[4])))
    else:
        raise ValueError(f"not a prompt of the shapes grammar: {prompt!r}")
    if any(colour == spec.background for colour, _ in spec.objects):
        raise ValueError(f"an object's colour must differ from the background: {prompt!r}")
    return spec


def random_spec(rng: random.Random, *, held_out: bool | None = False) -> SceneSpec:
    """A uniformly drawn template and contents.

    `held_out=False` never returns a spec containing a held-out triple (training
    data), `True` always contains one, `None` draws without regard to them.
    """
    while True:
        background = rng.choice(COLOURS)
        others = [c for c in COLOURS if c != background]
        template = rng.randrange(3)
        if template == 0:
            objects = ((rng.choice(others), rng.choice(SHAPES)),)
        elif template == 1:
            objects = ((rng.choice(others), rng.choice(SHAPES)),) * rng.choice((2, 3))
        else:
            c1, c2 = rng.sample(others, 2)
            objects = ((c1, rng.choice(SHAPES)), (c2, rng.choice(SHAPES)))
        spec = SceneSpec(background, objects)
        if held_out is None or spec.is_held_out == held_out:
            return spec


def place(spec: SceneSpec, rng: random.Random) -> list[PlacedShape]:
    """Random non-overlapping positions, sizes and rotations for the spec's objects."""
    while True:
        placed: list[PlacedShape] = []
        for colour, shape in spec.objects:
            for _ in range(100):
                radius = rng.uniform(MIN_RADIUS, MAX_RADIUS)
                low, high = radius + MARGIN, IMAGE_SIZE - radius - MARGIN
                x, y = rng.uniform(low, high), rng.uniform(low, high)
                if all(math.hypot(x - p.x, y - p.y) > radius + p.radius + MARGIN for p in placed):
                    rotation = rng.uniform(-MAX_ROTATION_DEGREES, MAX_ROTATION_DEGREES)
                    placed.append(PlacedShape(colour, shape, x, y, radius, rotation))
                    break
            else:
                break
        if len(placed) == len(spec.objects):
            return placed


def _outline(item: PlacedShape, scale: float) -> list[tuple[float, float]]:
    corners = 4 if item.shape == "square" else 3
    # Squares sit on a side and triangles point up before rotation.
    start = -90.0 + (45.0 if corners == 4 else 0.0) + item.rotation
    return [
        (
            item.x * scale
            + item.radius * scale * math.cos(math.radians(start + k * 360.0 / corners)),
            item.y * scale
            + item.radius * scale * math.sin(math.radians(start + k * 360.0 / corners)),
        )
        for k in range(corners)
    ]


def render(spec: SceneSpec, shapes: list[PlacedShape]) -> Image.Image:
    """Draw the scene at IMAGE_SIZE, anti-aliased by supersampling."""
    scale = SUPERSAMPLE
    big = Image.new("RGB", (IMAGE_SIZE * scale, IMAGE_SIZE * scale), PALETTE[spec.background])
    draw = ImageDraw.Draw(big)
    for item in shapes:
        fill = PALETTE[item.colour]
        if item.shape == "circle":
            r = item.radius * scale
            cx, cy = item.x * scale, item.y * scale
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        else:
            draw.polygon(_outline(item, scale), fill=fill)
    return big.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)


def sample_scene(rng: random.Random, *, held_out: bool | None = False) -> tuple[str, Image.Image]:
    """A random (prompt, image) pair of the world."""
    spec = random_spec(rng, held_out=held_out)
    return prompt_for(spec), render(spec, place(spec, rng))


def render_batch(
    count: int, seed: int, *, held_out: bool | None = False
) -> tuple[list[str], np.ndarray]:
    """`count` scenes as prompts and a uint8 array of shape (count, H, W, 3)."""
    rng = random.Random(seed)
    prompts: list[str] = []
    pixels = np.empty((count, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for i in range(count):
        prompt, image = sample_scene(rng, held_out=held_out)
        prompts.append(prompt)
        pixels[i] = np.asarray(image)
    return prompts, pixels


def vocabulary() -> list[str]:
    """Every word the grammar can produce."""
    words = ["a", "and", "on", "background", *COUNT_WORDS.values(), *COLOURS]
    words += [*SHAPES, *(f"{shape}s" for shape in SHAPES)]
    return words
