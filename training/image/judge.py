"""Prompt adherence judged from pixels alone.

The judge finds the background as the palette colour most pixels are nearest
to, splits everything that differs from it into connected components and names
each component's colour by its nearest palette entry. For the shape it traces
the component's outline (where it is half covered) along rays from its centre
and takes the 3rd and 4th angular harmonics of that radius: a triangle has a
strong 3rd, a square a strong 4th, a circle neither. The measure does not
depend on rotation and survives the blur and rounded corners of generated
images.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np
from PIL import Image

from training.image.shapes import COLOURS, PALETTE, SceneSpec, parse_prompt

CRITERIA: tuple[str, ...] = ("background", "colour", "shape", "count")

_PALETTE = np.array([PALETTE[name] for name in COLOURS], dtype=np.float32)
# An image is only judged to have a background if that colour covers this much of it.
MIN_BACKGROUND_SHARE = 0.4
# A pixel belongs to an object when it is this far (RGB distance) from the background.
FOREGROUND_DISTANCE = 60.0
# Components smaller than this (pixels) are specks, not objects.
MIN_OBJECT_AREA = 24
# Harmonic strengths of ideal shapes (outline radius relative to its mean):
# an equilateral triangle's 3rd and a square's 4th.
TRIANGLE_HARMONIC = 0.135
SQUARE_HARMONIC = 0.068
# Below this share of the ideal strength, an outline is round.
MIN_CORNER_STRENGTH = 0.25
_RAY_ANGLES = np.linspace(0.0, 2.0 * np.pi, 64, endpoint=False)
_RAY_STEP = 0.25
_RAY_RADII = np.arange(0.0, 20.0, _RAY_STEP)


@dataclass(frozen=True)
class DetectedObject:
    colour: str
    shape: str
    area: int
    triangularity: float
    squareness: float


@dataclass(frozen=True)
class Detection:
    background: str | None
    objects: tuple[DetectedObject, ...]


def _nearest_colour(rgb: np.ndarray) -> np.ndarray:
    """Index into COLOURS of the nearest palette entry for each RGB row."""
    distances = ((rgb[..., None, :] - _PALETTE) ** 2).sum(-1)
    return distances.argmin(-1)


def _components(mask: np.ndarray) -> list[list[tuple[int, int]]]:
    """8-connected components of a boolean mask as lists of (row, col)."""
    seen = np.zeros_like(mask)
    height, width = mask.shape
    found = []
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        seen[start] = True
        queue, pixels = deque([start]), []
        while queue:
            r, c = queue.popleft()
            pixels.append((r, c))
            for dr, dc in itertools.product((-1, 0, 1), repeat=2):
                nr, nc = r + dr, c + dc
                if 0 <= nr < height and 0 <= nc < width and mask[nr, nc] and not seen[nr, nc]:
                    seen[nr, nc] = True
                    queue.append((nr, nc))
        found.append(pixels)
    return found


def _outline_radii(coverage: np.ndarray, cy: float, cx: float) -> np.ndarray:
    """Distance from (cy, cx) to where coverage falls below one half, along each ray."""
    height, width = coverage.shape
    ys = cy + np.sin(_RAY_ANGLES)[:, None] * _RAY_RADII
    xs = cx + np.cos(_RAY_ANGLES)[:, None] * _RAY_RADII
    y0 = np.clip(np.floor(ys).astype(int), 0, height - 2)
    x0 = np.clip(np.floor(xs).astype(int), 0, width - 2)
    fy, fx = np.clip(ys - y0, 0.0, 1.0), np.clip(xs - x0, 0.0, 1.0)
    samples = (
        coverage[y0, x0] * (1 - fy) * (1 - fx)
        + coverage[y0 + 1, x0] * fy * (1 - fx)
        + coverage[y0, x0 + 1] * (1 - fy) * fx
        + coverage[y0 + 1, x0 + 1] * fy * fx
    )
    below = samples < 0.5
    below[:, 0] = False
    crossing = np.where(below.any(1), below.argmax(1), len(_RAY_RADII) - 1)
    rays = np.arange(len(_RAY_ANGLES))
    inner, outer = samples[rays, crossing - 1], samples[rays, crossing]
    # Linear interpolation of the half-coverage crossing between two samples.
    fraction = np.clip((inner - 0.5) / np.maximum(inner - outer, 1e-3), 0.0, 1.0)
    return _RAY_RADII[crossing - 1] + _RAY_STEP * fraction


def _harmonic(radii: np.ndarray, order: int) -> float:
    return float(abs((radii * np.exp(-1j * order * _RAY_ANGLES)).sum()) / max(radii.sum(), 1e-6))


def _shape_of(triangularity: float, squareness: float) -> str:
    if max(triangularity, squareness) < MIN_CORNER_STRENGTH:
        return "circle"
    return "triangle" if triangularity > squareness else "square"


def detect(image: Image.Image | np.ndarray) -> Detection:
    """Background and objects seen in an RGB image."""
    if isinstance(image, Image.Image):
        image = image.convert("RGB")
    rgb = np.asarray(image, dtype=np.float32)
    nearest = _nearest_colour(rgb)
    votes = np.bincount(nearest.ravel(), minlength=len(COLOURS))
    if votes.max() < MIN_BACKGROUND_SHARE * nearest.size:
        return Detection(None, ())
    background_index = int(votes.argmax())
    background_rgb = np.median(rgb[nearest == background_index], axis=0)
    distance = np.sqrt(((rgb - background_rgb) ** 2).sum(-1))
    objects = []
    for pixels in _components(distance > FOREGROUND_DISTANCE):
        if len(pixels) < MIN_OBJECT_AREA:
            continue
        rows, cols = (np.array(axis, dtype=np.float32) for axis in zip(*pixels, strict=True))
        colours = rgb[rows.astype(int), cols.astype(int)]
        # Edge pixels are blends with the background, so name the colour from the
        # half of the component that is farthest from it.
        far = distance[rows.astype(int), cols.astype(int)]
        core = colours[far >= np.median(far)]
        colour_index = int(np.bincount(_nearest_colour(core), minlength=len(COLOURS)).argmax())
        # Anti-aliased coverage: the share of the way from background to object colour.
        span = max(float(np.sqrt(((_PALETTE[colour_index] - background_rgb) ** 2).sum())), 1.0)
        weights = np.clip(far / span, 0.0, 1.0)
        cy, cx = (rows * weights).sum() / weights.sum(), (cols * weights).sum() / weights.sum()
        # Only this component's pixels count, so a neighbour does not bend the outline.
        coverage = np.zeros_like(distance)
        coverage[rows.astype(int), cols.astype(int)] = weights
        radii = _outline_radii(coverage, float(cy), float(cx))
        triangularity = _harmonic(radii, 3) / TRIANGLE_HARMONIC
        squareness = _harmonic(radii, 4) / SQUARE_HARMONIC
        shape = _shape_of(triangularity, squareness)
        objects.append(
            DetectedObject(COLOURS[colour_index], shape, len(pixels), triangularity, squareness)
        )
    return Detection(COLOURS[background_index], tuple(objects))


def _shapes_right(wanted: tuple[tuple[str, str], ...], found: tuple[DetectedObject, ...]) -> bool:
    """Each wanted (colour, shape) is present, and nothing of a wanted colour has another shape."""
    shape_of = dict(wanted)
    present = {(obj.colour, obj.shape) for obj in found}
    return set(wanted) <= present and all(
        obj.shape == shape_of[obj.colour] for obj in found if obj.colour in shape_of
    )


def score(image: Image.Image | np.ndarray, prompt: str | SceneSpec) -> dict[str, bool]:
    """Which of background, colour, shape and count the image gets right for the prompt."""
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    seen = detect(image)
    # Criteria are separable: multiplicity is judged by count alone.
    return {
        "background": seen.background == spec.background,
        "colour": {colour for colour, _ in spec.objects} <= {obj.colour for obj in seen.objects},
        "shape": _shapes_right(spec.objects, seen.objects),
        "count": len(seen.objects) == len(spec.objects),
    }
