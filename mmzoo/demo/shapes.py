"""Synthetic shapes scenes with questions and one-word answers: the embedded demo model's data.

A scene is one to three non-overlapping flat shapes (:data:`SHAPES`) in :data:`COLORS` on a light
background, at one of :data:`SIZES` x :data:`SIZES` pixels (side ratios from 2:5 to 5:2). Every
size is a multiple of 28 (patch 14 x merge 2) within the demo processor's pixel bounds, so the
Qwen2-VL processor feeds the pixels to the ViT without resampling; ``side_range`` draws any width
and height instead (the embedded model trained on 32-224 px, with ``shape_sides`` 18-52 px, and the
processor rounding each side to whole 28-px cells). Questions are asked only where
the answer is unique: "What shape is this?" only of a single shape, "What color is the square?"
only when there is exactly one square. Everything is drawn from one ``numpy.random.Generator``,
so a seed fixes the data; the training recipe and the tests use different seeds.

Typical use::

    from mmzoo.demo.shapes import make_examples
    for ex in make_examples(8, seed=0):
        ex.image, ex.question, ex.answer, ex.category
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["SHAPES", "COLORS", "SIZES", "CATEGORIES", "COUNT_WORDS", "TRAIN_SEED", "VISION_SEED", "VALIDATION_SEED", "HELD_OUT_SEED",
           "Shape", "Scene", "Example", "random_scene", "render", "cell_targets", "questions", "iter_questions", "iter_conversations", "iter_examples",
           "make_examples", "tokenizer_corpus"]

SHAPES = ("circle", "square", "triangle", "star", "cross")
COLORS = {  # name -> RGB; each drawn shape jitters every channel by up to +-_JITTER
    "red": (215, 35, 35),
    "green": (40, 160, 55),
    "blue": (35, 75, 215),
    "yellow": (235, 205, 30),
    "purple": (135, 50, 175),
    "orange": (245, 130, 25),
}
SIZES = (56, 84, 112, 140)  # image sides in pixels
CATEGORIES = ("shape", "color", "count")
COUNT_WORDS = ("one", "two", "three")
TRAIN_SEED = 0  # recipes/train_demo.py trains on iter_conversations(TRAIN_SEED + its seed) (0 by default)
VISION_SEED = 250_007  # and pretrains its vision tower on the scenes of iter_conversations(VISION_SEED + its seed)
VALIDATION_SEED = 500_009  # the recipe's own accuracy report at the end
HELD_OUT_SEED = 1_000_003  # tests/test_demo.py evaluates on this one

_JITTER = 12
_MIN_SIDE, _MAX_SIDE = 20, 44  # a shape's bounding-box side in pixels
_GAP = 4  # pixels between shapes' bounding boxes, and from the image border
_SUPERSAMPLE = 4  # shapes are drawn this much larger, then box-filtered down: anti-aliased edges


@dataclass(frozen=True)
class Shape:
    """One shape: its kind, color name, exact RGB, bounding-box center and side in pixels."""

    kind: str
    color: str
    rgb: tuple[int, int, int]
    cx: int
    cy: int
    side: int


@dataclass(frozen=True)
class Scene:
    """An image's content: size, background RGB and the shapes (never overlapping)."""

    width: int
    height: int
    background: tuple[int, int, int]
    shapes: tuple[Shape, ...]


@dataclass(frozen=True)
class Example:
    """A rendered scene with one question about it."""

    image: Image.Image
    question: str
    answer: str
    category: str
    scene: Scene


def random_scene(rng: np.random.Generator, *, num_shapes: int | None = None,
                 side_range: tuple[int, int] | None = None, shape_sides: tuple[int, int] | None = None) -> Scene:
    """Draws a scene: size, background, then shapes placed one by one without overlap.

    Args:
        rng: the generator every choice is drawn from.
        num_shapes: 1, 2 or 3; None draws it uniformly.
        side_range: draw the width and the height uniformly from ``[lo, hi]`` pixels (any integer:
            sizes off the training grid, other aspect ratios); None: from :data:`SIZES`, as the
            first demo model was trained.
        shape_sides: each shape's bounding-box side is drawn from ``[lo, hi]`` pixels (capped by
            the image); None: ``(20, 44)``.

    Returns:
        A :class:`Scene`. When the shapes do not fit (small image, large shapes), the whole scene
        is drawn again from the same generator, so the result stays a function of its state.
    """
    if num_shapes is not None and not 1 <= num_shapes <= len(COUNT_WORDS):
        raise ValueError(f"num_shapes={num_shapes}: scenes hold 1 to {len(COUNT_WORDS)} shapes")
    n = int(rng.integers(1, len(COUNT_WORDS) + 1)) if num_shapes is None else num_shapes
    lo_side, hi_side = (_MIN_SIDE, _MAX_SIDE) if shape_sides is None else (int(v) for v in shape_sides)
    if side_range is not None and min(side_range) < lo_side + 2 * _GAP:
        raise ValueError(f"side_range={tuple(side_range)}: an image side must hold a shape of {lo_side} px "
                         f"and {_GAP} px borders, at least {lo_side + 2 * _GAP} px")
    while True:
        if side_range is None:
            width, height = (int(v) for v in rng.choice(SIZES, size=2))
        else:
            width, height = (int(v) for v in rng.integers(side_range[0], side_range[1] + 1, size=2))
        level = int(rng.integers(222, 256))
        background = tuple(int(np.clip(level + rng.integers(-8, 9), 0, 255)) for _ in range(3))
        shapes: list[Shape] = []
        for _ in range(30 * n):  # placement attempts
            limit = min(hi_side, width - 2 * _GAP, height - 2 * _GAP)
            side = int(rng.integers(lo_side, limit + 1))
            cx = int(rng.integers(_GAP + side // 2, width - _GAP - (side - side // 2) + 1))
            cy = int(rng.integers(_GAP + side // 2, height - _GAP - (side - side // 2) + 1))
            if all(abs(cx - s.cx) * 2 >= side + s.side + 2 * _GAP or abs(cy - s.cy) * 2 >= side + s.side + 2 * _GAP
                   for s in shapes):
                kind = SHAPES[int(rng.integers(len(SHAPES)))]
                color = list(COLORS)[int(rng.integers(len(COLORS)))]
                rgb = tuple(int(np.clip(c + rng.integers(-_JITTER, _JITTER + 1), 0, 255)) for c in COLORS[color])
                shapes.append(Shape(kind, color, rgb, cx, cy, side))
                if len(shapes) == n:
                    return Scene(width, height, background, tuple(shapes))


def _outline(kind: str, cx: float, cy: float, side: float) -> list[tuple[float, float]]:
    """Polygon vertices of a non-circle shape filling a ``side`` x ``side`` box centered at (cx, cy)."""
    h = side / 2
    if kind == "square":
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if kind == "triangle":  # pointing up, base and height both ``side``
        return [(cx, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if kind == "cross":  # a plus sign with arms a third of the side wide
        t = side / 6
        return [(cx - t, cy - h), (cx + t, cy - h), (cx + t, cy - t), (cx + h, cy - t), (cx + h, cy + t),
                (cx + t, cy + t), (cx + t, cy + h), (cx - t, cy + h), (cx - t, cy + t), (cx - h, cy + t),
                (cx - h, cy - t), (cx - t, cy - t)]
    if kind == "star":  # five points, the inner radius 0.45 of the outer; centered in the box vertically
        outer, inner = h, 0.45 * h
        shift = h * (1 - math.cos(math.pi / 5)) / 2  # the lowest points sit above the box's bottom
        return [(cx + (outer if i % 2 == 0 else inner) * math.sin(i * math.pi / 5),
                 cy + shift - (outer if i % 2 == 0 else inner) * math.cos(i * math.pi / 5)) for i in range(10)]
    raise ValueError(f"unknown shape {kind!r}; known: {SHAPES}")


def _draw(draw: ImageDraw.ImageDraw, s: Shape, scale: int, fill) -> None:
    cx, cy, side = s.cx * scale, s.cy * scale, s.side * scale
    if s.kind == "circle":
        draw.ellipse([cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2], fill=fill)
    else:
        draw.polygon(_outline(s.kind, cx, cy, side), fill=fill)


def render(scene: Scene) -> Image.Image:
    """The scene as an RGB image of ``scene.width`` x ``scene.height`` pixels (anti-aliased edges)."""
    big = Image.new("RGB", (scene.width * _SUPERSAMPLE, scene.height * _SUPERSAMPLE), scene.background)
    draw = ImageDraw.Draw(big)
    for s in scene.shapes:
        _draw(draw, s, _SUPERSAMPLE, s.rgb)
    return big.resize((scene.width, scene.height), Image.Resampling.BOX)


def cell_targets(scene: Scene, cell: int, *, mode: str = "cover", min_pixels: int = 8,
                 grid: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-cell labels of the image-token grid (row-major, as the Qwen2-VL merger emits its tokens
    when ``cell`` is patch x merge): the shape kind and color in each cell.

    Args:
        scene: the scene.
        cell: the cell side in pixels of the image the vision tower sees.
        mode: "cover": a cell is labeled with the shape that covers most of its pixels (at least
            ``min_pixels``); "center": only the cell holding a shape's bounding-box center is.
        min_pixels: see ``mode``.
        grid: ``(rows, cols)`` of cells the processor made of the image (its ``image_grid_thw``
            height and width divided by the merge size), when it resized the image to
            ``rows * cell`` x ``cols * cell`` px; the shapes are mapped onto that grid. None: the
            image is not resized, so its sides must be multiples of ``cell``.

    Returns:
        ``(kinds, colors)``, int64 arrays of ``[rows, cols]``: 0 for no shape, else 1 + the index
        in :data:`SHAPES` / :data:`COLORS`; -100 (ignored by cross entropy) where two shapes'
        centers share a cell in "center" mode.
    """
    if grid is None:
        if scene.width % cell or scene.height % cell:
            raise ValueError(f"scene {scene.width}x{scene.height} px is not a whole number of {cell}-px cells; "
                             "pass the processor's grid")
        grid = (scene.height // cell, scene.width // cell)
    rows, cols = (int(v) for v in grid)
    kinds, colors = np.zeros((rows, cols), np.int64), np.zeros((rows, cols), np.int64)
    kind_ids = [1 + SHAPES.index(s.kind) for s in scene.shapes]
    color_ids = [1 + list(COLORS).index(s.color) for s in scene.shapes]
    if mode == "center":
        for s, k, c in zip(scene.shapes, kind_ids, color_ids):
            r, q = s.cy * rows // scene.height, s.cx * cols // scene.width
            taken = kinds[r, q] != 0
            kinds[r, q], colors[r, q] = (-100, -100) if taken else (k, c)
        return kinds, colors
    if mode != "cover":
        raise ValueError(f"mode={mode!r}; known: 'cover', 'center'")
    mask = Image.new("L", (scene.width, scene.height), 0)
    draw = ImageDraw.Draw(mask)
    for i, s in enumerate(scene.shapes):
        _draw(draw, s, 1, i + 1)
    if mask.size != (cols * cell, rows * cell):  # as the processor resized the image
        mask = mask.resize((cols * cell, rows * cell), Image.Resampling.NEAREST)
    ids = np.asarray(mask).reshape(rows, cell, cols, cell).transpose(0, 2, 1, 3).reshape(rows, cols, -1)
    counts = np.stack([(ids == i + 1).sum(-1) for i in range(len(scene.shapes))], -1)  # [rows, cols, shapes]
    best = counts.argmax(-1)
    hit = counts.max(-1) >= min_pixels
    kinds[hit] = np.asarray(kind_ids)[best[hit]]
    colors[hit] = np.asarray(color_ids)[best[hit]]
    return kinds, colors


def questions(scene: Scene) -> dict[str, list[tuple[str, str]]]:
    """Every unambiguous (question, answer) pair about the scene, by category.

    * shape: "What shape is this?" (one shape); "What shape is the red one?" (exactly one red shape).
    * color: "What color is this shape?" (one shape); "What color is the square?" (exactly one square).
    * count: "How many shapes are there?" -> "one", "two" or "three".
    """
    kinds = [s.kind for s in scene.shapes]
    colors = [s.color for s in scene.shapes]
    out: dict[str, list[tuple[str, str]]] = {c: [] for c in CATEGORIES}
    if len(scene.shapes) == 1:
        out["shape"].append(("What shape is this?", kinds[0]))
        out["color"].append(("What color is this shape?", colors[0]))
    for s in scene.shapes:
        if colors.count(s.color) == 1:
            out["shape"].append((f"What shape is the {s.color} one?", s.kind))
        if kinds.count(s.kind) == 1:
            out["color"].append((f"What color is the {s.kind}?", s.color))
    out["count"].append(("How many shapes are there?", COUNT_WORDS[len(scene.shapes) - 1]))
    return out


def iter_questions(seed: int, *, category: str | None = None, side_range: tuple[int, int] | None = None,
                   shape_sides: tuple[int, int] | None = None) -> Iterator[tuple[Scene, str, str, str]]:
    """An endless stream of ``(scene, category, question, answer)``, deterministic from ``seed``.

    Args:
        seed: seeds the ``numpy.random.Generator`` that draws scenes, categories and questions.
        category: ask only this category (scenes without such a question are skipped); None draws
            the category uniformly among those the scene can answer.
        side_range, shape_sides: the scenes' and the shapes' sizes (:func:`random_scene`).

    Yields:
        One question about each fresh scene (not rendered: :func:`iter_examples` renders).
    """
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"category={category!r}; known: {CATEGORIES}")
    rng = np.random.default_rng(seed)
    while True:
        scene = random_scene(rng, side_range=side_range, shape_sides=shape_sides)
        qs = questions(scene)
        if category is None:
            cat = [c for c in CATEGORIES if qs[c]][int(rng.integers(sum(1 for c in CATEGORIES if qs[c])))]
        elif qs[category]:
            cat = category
        else:
            continue
        question, answer = qs[cat][int(rng.integers(len(qs[cat])))]
        yield scene, cat, question, answer


def iter_conversations(seed: int, *, side_range: tuple[int, int] | None = None,
                       shape_sides: tuple[int, int] | None = None) -> Iterator[tuple[Scene, list[tuple[str, str]]]]:
    """An endless stream of ``(scene, qas)``: every unambiguous question about each fresh scene,
    in a random order (the training recipe asks them all in one multi-turn conversation, so one
    pass through the vision tower teaches several answers). Deterministic from ``seed``;
    ``side_range`` and ``shape_sides`` as in :func:`random_scene`."""
    rng = np.random.default_rng(seed)
    while True:
        scene = random_scene(rng, side_range=side_range, shape_sides=shape_sides)
        qas = [qa for cat in CATEGORIES for qa in questions(scene)[cat]]
        yield scene, [qas[i] for i in rng.permutation(len(qas))]


def iter_examples(seed: int, *, category: str | None = None, side_range: tuple[int, int] | None = None,
                  shape_sides: tuple[int, int] | None = None) -> Iterator[Example]:
    """:func:`iter_questions` with the images rendered: an endless stream of :class:`Example`."""
    for scene, cat, question, answer in iter_questions(seed, category=category, side_range=side_range,
                                                       shape_sides=shape_sides):
        yield Example(render(scene), question, answer, cat, scene)


def tokenizer_corpus() -> list[str]:
    """Lines that teach a BPE tokenizer this data's words: every question, and every answer alone
    on its line (as it follows ``assistant\\n`` in a reply), a few times each, so that each answer
    becomes one token (with no leading space: the pre-tokenizer splits at the newline)."""
    lines = ["What shape is this?", "What color is this shape?", "How many shapes are there?"]
    lines += [f"What color is the {kind}?" for kind in SHAPES] + [f"What shape is the {c} one?" for c in COLORS]
    answers = list(SHAPES) + list(COLORS) + list(COUNT_WORDS)
    return lines * 2 + answers * 4


def make_examples(n: int, seed: int, *, category: str | None = None, side_range: tuple[int, int] | None = None,
                  shape_sides: tuple[int, int] | None = None) -> list[Example]:
    """The first ``n`` examples of :func:`iter_examples` ``(seed, category=..., side_range=..., shape_sides=...)``."""
    return list(itertools.islice(iter_examples(seed, category=category, side_range=side_range,
                                               shape_sides=shape_sides), n))
