"""The embedded demo checkpoint (mmzoo/assets/qwen2_vl_shapes) and the data it was trained on.

Held-out accuracy through executor=xla with the Pallas and the SDPA backend; the same answers from
precomputed embeddings (encode, then infer) and from transformers on the same checkpoint; the
default CLI run on the bundled sample image; the generator's determinism and the separation of
the training stream from the held-out set.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

import mmzoo
from mmzoo import config
from mmzoo.demo import shapes
from mmzoo.paths import ASSETS

PER_CATEGORY = 100
MIN_ACCURACY = {"shape": 0.95, "color": 0.95, "count": 0.90}
GEN = {"max_new_tokens": 4}  # a one-word answer and <|im_end|>
# buckets that fit every mmzoo.shapes prompt: at most 100 patches (140 x 140 px), 25 image tokens,
# about 45 tokens in all; precomputed embeddings are written 32 rows at a time
XLA_SMALL = dict(max_model_len=64, max_batch=8, progress=False, warmup="needed", compile={"on_recompile": "error"},
                 buckets={"prefill": [64], "encoder": {"vision": [100]}, "min_encoder_rows": 32, "max_encoder_rows": 32})


@pytest.fixture(scope="module")
def held_out() -> list[shapes.Example]:
    """PER_CATEGORY fresh examples of each category, from seeds the training recipe never uses."""
    return [ex for i, cat in enumerate(shapes.CATEGORIES)
            for ex in shapes.make_examples(PER_CATEGORY, shapes.HELD_OUT_SEED + i, category=cat)]


@pytest.fixture(scope="module", params=["pallas", "sdpa"])
def answers(request, held_out):
    """(backend, engine, the answer text to every held-out question) through executor=xla."""
    engine = mmzoo.load(model="qwen2_vl", executor="xla", attention=request.param, **XLA_SMALL)
    results = engine.generate([{"prompt": ex.question, "images": [ex.image], **GEN} for ex in held_out])
    assert all(r.error is None for r in results)
    assert {r.graphs_compiled_after_warmup for r in results} == {0}
    return request.param, engine, [r.text for r in results]


@pytest.fixture(scope="module")
def transformers_answers(held_out) -> dict[int, str]:
    """transformers' greedy answers to every 8th held-out question, on the same checkpoint."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    ckpt = str(ASSETS / "qwen2_vl_shapes")
    processor = AutoProcessor.from_pretrained(ckpt)
    model = Qwen2VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = {}
    for i in range(0, len(held_out), 8):
        ex = held_out[i]
        content = [{"type": "image"}, {"type": "text", "text": ex.question}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        inputs = processor(text=[text], images=[ex.image], return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=GEN["max_new_tokens"], do_sample=False)
        out[i] = processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def test_default_checkpoint_is_the_trained_demo():
    path = Path(mmzoo.compose(["model=qwen2_vl"]).checkpoint)
    assert path == ASSETS / "qwen2_vl_shapes"
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 20e6, f"the embedded checkpoint is {size / 1e6:.1f} MB"


def _accuracy(texts, held_out) -> dict[str, float]:
    return {cat: float(np.mean([t == ex.answer for t, ex in zip(texts, held_out) if ex.category == cat]))
            for cat in shapes.CATEGORIES}


def test_held_out_accuracy(answers, held_out):
    """Issue #7's floors: shape and color >= 95%, counting >= 90%, on fresh held-out scenes."""
    backend, _, texts = answers
    acc = _accuracy(texts, held_out)
    print(f"\nheld-out accuracy, executor=xla attention={backend}: {acc}")
    for cat, floor in MIN_ACCURACY.items():
        assert acc[cat] >= floor, (backend, cat, acc)


def test_held_out_accuracy_at_any_size():
    """The same floors on scenes of any size and aspect ratio in the trained range (sides 32-224
    px, shapes 18-52 px; the processor rounds each side to whole 28-px cells), through the eager
    executor (exact shapes: no buckets to size)."""
    held = [ex for i, cat in enumerate(shapes.CATEGORIES)
            for ex in shapes.make_examples(50, shapes.HELD_OUT_SEED + 10 + i, category=cat, side_range=(32, 224),
                                           shape_sides=(18, 52))]
    assert len({ex.image.size for ex in held}) > 100
    engine = mmzoo.load(model="qwen2_vl", executor="eager", max_model_len=128, max_batch=8)
    results = engine.generate([{"prompt": ex.question, "images": [ex.image], **GEN} for ex in held])
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    acc = _accuracy([r.text for r in results], held)
    print(f"\nheld-out accuracy at sides 32-224 px, executor=eager: {acc}")
    for cat, floor in MIN_ACCURACY.items():
        assert acc[cat] >= floor, (cat, acc)


def test_embeds_mode_gives_the_same_answers(answers, held_out):
    """Encode each image first, then answer from image_embeds + image_grid_thw: the same text."""
    _, engine, texts = answers
    subset = range(0, len(held_out), 6)
    reqs = []
    for i in subset:
        emb = engine.encode(images=[held_out[i].image])
        reqs.append(mmzoo.Request(prompt=held_out[i].question, image_embeds=emb["image_embeds"],
                                  image_grid_thw=emb["image_grid_thw"], **GEN))
    assert [r.text for r in engine.generate(reqs)] == [texts[i] for i in subset]


def test_transformers_gives_the_same_answers(answers, transformers_answers):
    _, _, texts = answers
    assert transformers_answers == {i: texts[i] for i in transformers_answers}


def test_default_cli_run_answers_on_the_sample_image(capsys):
    """`python -m mmzoo.infer model=qwen2_vl` with no checkpoint, image or prompt: the demo answers with a
    shape word: the sample is a green triangle."""
    from mmzoo.infer import run

    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base=None):
        cfg = compose(config_name="infer", overrides=["model=qwen2_vl", "executor=eager"])
    (row,) = run(cfg)
    assert row["text"] == "triangle" and row["images"] == [str(ASSETS / "sample.png")]
    assert capsys.readouterr().out.strip() == row["text"]


def test_generator_is_deterministic_from_its_seed():
    a, b = shapes.make_examples(12, seed=5), shapes.make_examples(12, seed=5)
    assert [(x.scene, x.question, x.answer) for x in a] == [(x.scene, x.question, x.answer) for x in b]
    assert all(np.array_equal(np.asarray(x.image), np.asarray(y.image)) for x, y in zip(a, b))
    c = shapes.make_examples(12, seed=6)
    assert [x.scene for x in a] != [x.scene for x in c]


def test_generator_covers_the_vocabulary_and_asks_only_answerable_questions():
    examples = shapes.make_examples(600, seed=3)
    assert {ex.image.size for ex in examples} == set(itertools.product(shapes.SIZES, shapes.SIZES))
    assert {ex.answer for ex in examples} == set(shapes.SHAPES) | set(shapes.COLORS) | set(shapes.COUNT_WORDS)
    for ex in examples:
        kinds = [s.kind for s in ex.scene.shapes]
        colors = [s.color for s in ex.scene.shapes]
        if ex.question in ("What shape is this?", "What color is this shape?"):
            assert len(ex.scene.shapes) == 1
        elif ex.question.startswith("What color is the "):
            assert kinds.count(ex.question[len("What color is the "):-1]) == 1
        elif ex.question.startswith("What shape is the "):
            assert colors.count(ex.question.split()[4]) == 1
        else:
            assert ex.answer == shapes.COUNT_WORDS[len(kinds) - 1]
        boxes = [(s.cx - s.side / 2, s.cy - s.side / 2, s.cx + s.side / 2, s.cy + s.side / 2) for s in ex.scene.shapes]
        for (a0, a1, a2, a3), (b0, b1, b2, b3) in itertools.combinations(boxes, 2):
            assert a2 <= b0 or b2 <= a0 or a3 <= b1 or b3 <= a1  # bounding boxes never overlap
        assert all(0 <= x0 and 0 <= y0 and x1 <= ex.image.width and y1 <= ex.image.height
                   for x0, y0, x1, y1 in boxes)


def test_training_stream_and_held_out_set_do_not_overlap():
    """The recipe's two streams (vision pretraining, then conversations), its validation scenes and
    the held-out set come from distinct seeds and share no scene (checked on each stream's first
    5000 scenes: a shared seed would repeat at once)."""
    from omegaconf import OmegaConf

    recipe = OmegaConf.load(Path(__file__).resolve().parent.parent / "recipes" / "train_demo.yaml")
    train_seeds = [shapes.TRAIN_SEED + int(recipe.seed), shapes.VISION_SEED + int(recipe.seed)]
    held_seeds = [shapes.HELD_OUT_SEED + i for i in range(len(shapes.CATEGORIES))]
    assert len({*train_seeds, shapes.VALIDATION_SEED, *held_seeds}) == 3 + len(held_seeds)
    train = {scene for seed in train_seeds for scene, _ in itertools.islice(shapes.iter_conversations(seed), 5000)}
    held = {scene for seed, cat in zip(held_seeds, shapes.CATEGORIES)
            for scene, *_ in itertools.islice(shapes.iter_questions(seed, category=cat), PER_CATEGORY)}
    val = {scene for scene, *_ in itertools.islice(shapes.iter_questions(shapes.VALIDATION_SEED), 300)}
    assert len(held) == len(shapes.CATEGORIES) * PER_CATEGORY
    assert not train & held and not train & val and not val & held


def test_training_conversations_label_only_the_answers(tmp_path):
    """recipes/train_demo.py's training rows: every answer (and its <|im_end|>) labelled, nothing else."""
    import importlib.util

    from mmzoo.fixtures import qwen2_vl_config, save_processor, train_tokenizer

    spec = importlib.util.spec_from_file_location(
        "train_demo", Path(__file__).resolve().parent.parent / "recipes" / "train_demo.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    tok = train_tokenizer(768, corpus=shapes.tokenizer_corpus())
    processor = save_processor(tmp_path, tok, qwen2_vl_config(tok), min_pixels=3136, max_pixels=19600,
                               default_system=None)
    convs = list(itertools.islice(shapes.iter_conversations(11), 3))
    batch = recipe.encode_conversations(processor, convs)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    for row, (scene, qas) in zip(batch["labels"], convs):
        assert len(qas) >= 2 and {q for q, _ in qas} == {q for c in shapes.CATEGORIES for q, _ in shapes.questions(scene)[c]}
        labelled = tok.decode([int(t) for t in row if t != -100])
        assert labelled == "".join(a + "<|im_end|>" for _, a in qas)


@pytest.mark.parametrize("mode", ["center", "cover"])
def test_cell_targets_label_the_cells_of_each_shape(mode):
    """The training-only vision probe's labels (row-major 28-px cells, as the merger emits tokens):
    every shape's center cell carries its kind and color; "cover" labels every cell a shape covers
    most, "center" nothing else; cells without a shape are 0."""
    for scene, _ in itertools.islice(shapes.iter_conversations(21), 50):
        kinds, colors = shapes.cell_targets(scene, 28, mode=mode)
        assert kinds.shape == colors.shape == (scene.height // 28, scene.width // 28)
        centers = {(s.cy // 28, s.cx // 28): s for s in scene.shapes}
        for (r, c), s in centers.items():
            if mode == "cover" or len(centers) == len(scene.shapes):  # "center" marks a shared cell -100
                assert kinds[r, c] == 1 + shapes.SHAPES.index(s.kind) and colors[r, c] == 1 + list(shapes.COLORS).index(s.color)
        if mode == "center":
            assert {(r, c) for r, c in zip(*np.nonzero(kinds))} == set(centers)
        else:
            assert (kinds > 0).sum() >= len(scene.shapes) and ((kinds > 0) == (colors > 0)).all()
    with pytest.raises(ValueError, match="28-px cells"):
        shapes.cell_targets(shapes.Scene(60, 56, (255, 255, 255), ()), 28)


def test_cell_targets_follow_the_processors_resize(tmp_path):
    """Off the grid the processor resizes each image to whole 28-px cells (up to its pixel
    bounds); the probe's labels are on that grid: each shape's center lands in the cell where
    the resized image has it, and "cover" labels the cells its resized pixels fill."""
    from mmzoo.fixtures import qwen2_vl_config, save_processor, train_tokenizer

    tok = train_tokenizer(768, corpus=shapes.tokenizer_corpus())
    processor = save_processor(tmp_path, tok, qwen2_vl_config(tok), min_pixels=3136, max_pixels=19600,
                               default_system=None)
    scenes = [scene for scene, _ in itertools.islice(shapes.iter_conversations(31, side_range=(32, 224)), 40)]
    grids = processor.image_processor(images=[shapes.render(s) for s in scenes])["image_grid_thw"]
    resized = 0
    for scene, (_, h, w) in zip(scenes, np.asarray(grids).tolist()):
        rows, cols = h // 2, w // 2
        resized += (rows * 28, cols * 28) != (scene.height, scene.width)
        kinds, _ = shapes.cell_targets(scene, 28, mode="center", grid=(rows, cols))
        centers = {(int(s.cy * rows * 28 / scene.height) // 28, int(s.cx * cols * 28 / scene.width) // 28): s
                   for s in scene.shapes}
        assert kinds.shape == (rows, cols)
        if len(centers) == len(scene.shapes):
            assert {(r, c): kinds[r, c] for r, c in centers} == {rc: 1 + shapes.SHAPES.index(s.kind)
                                                                for rc, s in centers.items()}
        cover, _ = shapes.cell_targets(scene, 28, mode="cover", grid=(rows, cols))
        assert cover.shape == (rows, cols) and (cover > 0).sum() >= 1
    assert resized > 30  # most sizes are off the 28-px grid, or past the area bounds


def test_eval_recipe_reports_accuracy_per_category_and_aspect(tmp_path):
    """recipes/eval_demo.py on 24 scenes of any size in its range: sizes drawn in the range, every
    figure reported, the wrong answers listed (no accuracy asserted: that is the recipe's output)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "eval.json"
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, str(root / "recipes" / "eval_demo.py"), "examples=24", f"output={out}"],
                       cwd=tmp_path, env={**os.environ, "PJRT_DEVICE": "CPU"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["counts"]["all"][1] == 24 and res["side_range"] == [32, 224] and res["shape_sides"] == [18, 52]
    assert {k for k in res["accuracy"] if k.startswith("category")} <= {f"category {c}" for c in shapes.CATEGORIES}
    assert sum(n for k, (_, n) in res["counts"].items() if k.startswith("aspect")) == 24
    assert len(res["wrong"]) == 24 - res["counts"]["all"][0]
    sized = shapes.make_examples(50, seed=9, side_range=(32, 224), shape_sides=(18, 52))
    assert all(32 <= s <= 224 for ex in sized for s in ex.image.size)
    assert len({ex.image.size for ex in sized}) > 20  # off the 4 x 4 grid of the first demo's sizes
    assert all(18 <= s.side <= 52 for ex in sized for s in ex.scene.shapes)
    assert min(s.side for ex in sized for s in ex.scene.shapes) < 20 < 44 < max(s.side for ex in sized for s in ex.scene.shapes)
