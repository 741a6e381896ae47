"""Recipe: train the embedded demo checkpoint, a small Qwen2-VL that answers questions about shapes.

transformers' own ``Qwen2VLForConditionalGeneration`` (so the checkpoint is a plain Hugging Face
one, and the math is the one mmzoo matches) is trained from scratch with a plain torch loop on
endless streams of :mod:`mmzoo.demo.shapes` scenes of one to three shapes, in two phases:

1. **Vision** (:func:`pretrain_vision`): the vision tower alone, with a training-only linear head
   (:class:`VisionProbe`, not saved) that reads each merged image token and names the kind and
   color of the shape whose center lies in that token's 28 x 28 px cell (or none). Images only,
   a third of a full step's cost.
2. **Conversations**: the whole model. Each scene is one multi-turn conversation asking every
   unambiguous question about it ("What shape is this?", "What color is the square?", "How many
   shapes are there?", in a random order), each with a one-word answer; the loss is on the
   answers and their closing ``<|im_end|>`` only, plus the probe's loss.

Validation asks one question per image, as inference does. What mattered, measured on short runs
(validation accuracy):

* the probe: through the answers alone the tower got a weak, late signal and the model never told
  the shapes apart (shape 28% after 2000 steps, 17 minutes; chance 20%). With the probe phase, shape
  is 98% at 500 conversation steps.
* a vision tower 128 wide rather than 64 (vision-only runs, 400 steps: the probe named the shape
  in 72% against 59% of the cells a shape covers);
* several answers per image (5x the supervision for 1.5x the step time);
* an init std of 0.1 rather than transformers' 0.02 (at 0.02 the attention logits start so flat
  that the LM takes over a thousand steps to start looking at the image at all).

The tokenizer, chat template and processor are those of :mod:`mmzoo.fixtures`. Everything is
seeded: the same config gives the same data streams and initial weights.

Scenes are drawn at any width and height from 32 to 224 px (``data`` in the config); the
processor rounds each side to whole 28-px cells, and the probe's targets follow its grid. Trained
on the first demo's 16 grid sizes alone, the model got 596/600 held-out answers right at sides
of 48-168 px; trained on any size (and for 4500 rather than 1500 steps), 600/600
(``recipes/eval_demo.py``), but 598/600 on the first demo's grid; 1500 more conversation steps
from those weights (``init=``, a fresh stream, lr 5e-4, no probe) brought that to 600/600.

Run (about 48 minutes on 2 CPU cores; writes mmzoo/assets/qwen2_vl_shapes)::

    python recipes/train_demo.py
    python recipes/train_demo.py vision.steps=300 steps=200 output=/tmp/demo   # a quick, weaker one elsewhere

``init=DIR`` starts from the weights of a checkpoint this recipe wrote (same ``model`` sizes and
tokenizer), to train it further.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from mmzoo.demo import shapes
from mmzoo.files import atomic_path
from mmzoo.paths import ASSETS
from mmzoo.fixtures import generation_config, qwen2_vl_config, save_processor, synthetic_corpus, train_tokenizer

DEFAULT_OUTPUT = ASSETS / "qwen2_vl_shapes"


def prompt_text(processor, question: str) -> str:
    """The chat-template rendering of one user turn (the image, then ``question``) ready for the answer."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_batch(processor, examples: list[shapes.Example]) -> dict[str, torch.Tensor]:
    """Evaluation inputs, one question each, as mmzoo and transformers see it at inference: the
    prompt as the processor makes it, then the answer and ``<|im_end|>``.

    Rows are padded on the right; ``labels`` are -100 except on the answer tokens and the
    ``<|im_end|>`` that closes them, so the loss teaches only the reply.
    """
    tok = processor.tokenizer
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    enc = processor(text=[prompt_text(processor, ex.question) for ex in examples],
                    images=[ex.image for ex in examples])  # lists of ids; the image pads expanded
    answers = tok([ex.answer for ex in examples], add_special_tokens=False)["input_ids"]
    rows = [list(p) + a + [eos] for p, a in zip(enc["input_ids"], answers)]
    labels = [[-100] * len(p) + a + [eos] for p, a in zip(enc["input_ids"], answers)]
    return {"input_ids": _padded(rows, pad), "attention_mask": _padded([[1] * len(r) for r in rows], 0),
            "mm_token_type_ids": _padded([list(t) + [0] * (len(a) + 1) for t, a in zip(enc["mm_token_type_ids"], answers)],
                                         0),  # 1: image
            "pixel_values": torch.as_tensor(enc["pixel_values"]),  # [patches of all images, 3 * 2 * 14 * 14]
            "image_grid_thw": torch.as_tensor(enc["image_grid_thw"]),  # [b, 3]
            "labels": _padded(labels, -100)}


def _padded(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows])


def encode_conversations(processor, conversations: list[tuple[shapes.Scene, list[tuple[str, str]]]]):
    """Training inputs: each scene as one multi-turn conversation (the image in the first user
    turn, then every question about it, each followed by its answer), so one pass through the
    vision tower teaches several answers. ``labels`` are -100 except on each assistant reply
    (the answer tokens and the ``<|im_end|>`` that closes it); rows are padded on the right.
    """
    tok = processor.tokenizer
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    reply = tok("assistant\n", add_special_tokens=False)["input_ids"]  # after <|im_start|>: the reply follows
    texts = []
    for _, qas in conversations:
        messages = []
        for turn, (question, answer) in enumerate(qas):
            content = ([{"type": "image"}] if turn == 0 else []) + [{"type": "text", "text": question}]
            messages += [{"role": "user", "content": content},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        texts.append(processor.apply_chat_template(messages, tokenize=False))
    enc = processor(text=texts, images=[shapes.render(scene) for scene, _ in conversations])
    rows = [list(r) for r in enc["input_ids"]]
    labels = []
    for r in rows:
        lab, i = [-100] * len(r), 0
        while i < len(r):
            if r[i] == im_start and r[i + 1:i + 1 + len(reply)] == reply:
                i += 1 + len(reply)
                while r[i] != im_end:
                    lab[i] = r[i]
                    i += 1
                lab[i] = im_end
            i += 1
        labels.append(lab)
    return {"input_ids": _padded(rows, tok.pad_token_id), "attention_mask": _padded([[1] * len(r) for r in rows], 0),
            "mm_token_type_ids": _padded(enc["mm_token_type_ids"], 0),
            "pixel_values": torch.as_tensor(enc["pixel_values"]), "image_grid_thw": torch.as_tensor(enc["image_grid_thw"]),
            "labels": _padded(labels, -100)}


@torch.no_grad()
def accuracy(model, processor, examples: list[shapes.Example], batch_size: int = 64) -> dict[str, float]:
    """Greedy-answer accuracy per category (and ``all``), scored by teacher forcing.

    Greedy decoding produces the answer exactly when the argmax at every answer position (and at
    the closing ``<|im_end|>``) is the right token, so one forward pass scores a question.
    """
    model.eval()
    right: dict[str, list[bool]] = {c: [] for c in shapes.CATEGORIES}
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        batch = encode_batch(processor, chunk)
        labels = batch.pop("labels")[:, 1:]  # [b, s - 1]: the token each position predicts
        pred = model(**batch).logits[:, :-1].argmax(-1)  # [b, s - 1]
        ok = ((pred == labels) | (labels == -100)).all(dim=1)  # [b]
        for ex, good in zip(chunk, ok.tolist()):
            right[ex.category].append(good)
    out = {c: sum(v) / len(v) for c, v in right.items() if v}
    out["all"] = sum(sum(v) for v in right.values()) / len(examples)
    return out


def warmup_cosine(warmup: int, steps: int):
    """The LR factor per step: linear warmup, then cosine decay to 1/20 of the peak."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def pretrain_vision(model, processor, aux: "VisionProbe", cfg: DictConfig, stream) -> None:
    """Phase 1: the vision tower (and the probe head) alone on the probe loss, images only.

    A step costs about a third of a full one, and the dense per-token labels teach the tower to
    tell the shapes apart long before the LM's answers would (measured on vision-only runs: shape
    kind right on 95% of shape-center tokens after 800 steps at ViT width 128)."""
    vision = model.model.visual
    params = list(vision.parameters()) + list(aux.head.parameters())
    opt = torch.optim.AdamW(params, lr=float(cfg.lr), betas=(0.9, 0.98), weight_decay=0.0)
    steps = int(cfg.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(int(cfg.warmup_steps), steps))
    vision.train()
    t0, running = time.perf_counter(), 0.0
    for step in range(steps):
        scenes = [scene for scene, _ in itertools.islice(stream, int(cfg.batch_size))]
        enc = processor.image_processor(images=[shapes.render(s) for s in scenes])
        grid_thw = torch.as_tensor(enc["image_grid_thw"])
        vision(torch.as_tensor(enc["pixel_values"]), grid_thw=grid_thw)
        loss = aux.loss(scenes, grid_thw)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        running += float(loss.detach())
        if (step + 1) % 100 == 0 or step + 1 == steps:
            n = (step % 100) + 1
            print(f"train_demo: vision step {step + 1}/{steps} probe loss {running / n:.4f} "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            running = 0.0


class VisionProbe:
    """An auxiliary training loss on the vision tower's output (the merged image tokens the LM
    reads): a linear head, used only in training and not saved, predicts from each token the kind
    and the color of the shape in its cell of the image (:func:`mmzoo.demo.shapes.cell_targets`).

    Through the LM alone the vision tower gets a weak, late signal (the LM must first learn where to
    look); this dense one makes every image token say what it shows from the first step on.
    """

    def __init__(self, model, config, cfg: DictConfig):
        vision = model.model.visual
        self.merge = int(config.vision_config.spatial_merge_size)
        self.cell = int(config.vision_config.patch_size) * self.merge
        self.mode, self.min_pixels = str(cfg.targets), int(cfg.min_pixels)
        self.head = torch.nn.Linear(int(config.text_config.hidden_size), 1 + len(shapes.SHAPES) + 1 + len(shapes.COLORS))
        self._tokens: torch.Tensor | None = None
        vision.merger.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self._tokens = output  # [merged tokens of all images, hidden], images in order, each row-major

    def loss(self, scenes: list[shapes.Scene], grid_thw: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of the kind and color heads over every image token of the last forward;
        ``grid_thw`` ([images, 3] patches) is the processor's, which may have resized the images."""
        kinds, colors = zip(*(shapes.cell_targets(s, self.cell, mode=self.mode, min_pixels=self.min_pixels,
                                                  grid=(int(h) // self.merge, int(w) // self.merge))
                              for s, (_, h, w) in zip(scenes, grid_thw.tolist())))
        kinds = torch.from_numpy(np.concatenate([k.reshape(-1) for k in kinds]))
        colors = torch.from_numpy(np.concatenate([c.reshape(-1) for c in colors]))
        logits = self.head(self._tokens)
        n = 1 + len(shapes.SHAPES)
        ce = torch.nn.functional.cross_entropy
        return ce(logits[:, :n], kinds, ignore_index=-100) + ce(logits[:, n:], colors, ignore_index=-100)


def data_ranges(cfg: DictConfig) -> dict[str, tuple[int, int] | None]:
    """``side_range`` and ``shape_sides`` for :mod:`mmzoo.demo.shapes` from the recipe's ``data``
    (null: the generator's defaults, the first demo model's fixed grid of sizes)."""
    return {k: None if cfg.get(k) is None else (int(cfg[k][0]), int(cfg[k][1])) for k in ("side_range", "shape_sides")}


def _rounded(acc: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in acc.items()}


def train(cfg: DictConfig) -> Path:
    """Train per ``cfg`` (see ``recipes/train_demo.yaml``), save the checkpoint, return its directory."""
    from transformers import Qwen2VLForConditionalGeneration

    t_start = time.perf_counter()
    torch.set_num_threads(int(cfg.threads))
    out = Path(cfg.output) if cfg.output else DEFAULT_OUTPUT
    # mmzoo.fixtures tokenizer, with this data's words added so that each answer is one token
    tokenizer = train_tokenizer(int(cfg.tokenizer_vocab_size), corpus=synthetic_corpus() + shapes.tokenizer_corpus())
    config = qwen2_vl_config(tokenizer, **OmegaConf.to_container(cfg.model))
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out, directory=True) as tmp:  # a cut-off run leaves the shipped checkpoint in place
        processor = save_processor(tmp, tokenizer, config, min_pixels=int(cfg.processor.min_pixels),
                                   max_pixels=int(cfg.processor.max_pixels), default_system=None)

        torch.manual_seed(int(cfg.seed))
        model = Qwen2VLForConditionalGeneration(config)
        if cfg.get("init"):  # continue from a checkpoint of this recipe (its weights; tokenizer and config rebuilt)
            start = Qwen2VLForConditionalGeneration.from_pretrained(str(cfg.init), dtype=torch.float32,
                                                                    local_files_only=True)
            model.load_state_dict(start.state_dict(), strict=True)  # the same sizes as this config's
            print(f"train_demo: weights from {cfg.init}", file=sys.stderr)
        model.generation_config = generation_config(tokenizer)
        params = sum(p.numel() for p in model.parameters())
        print(f"train_demo: {params / 1e6:.2f}M parameters, {cfg.steps} steps of {cfg.batch_size}", file=sys.stderr)

        aux = VisionProbe(model, config, cfg.aux)
        data = data_ranges(cfg.data)
        t_train = time.perf_counter()
        if int(cfg.vision.steps):
            pretrain_vision(model, processor, aux, cfg.vision,
                            shapes.iter_conversations(shapes.VISION_SEED + int(cfg.seed), **data))
        vision_s = time.perf_counter() - t_train

        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
        no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": float(cfg.weight_decay)},
                                 {"params": no_decay + list(aux.head.parameters()), "weight_decay": 0.0}],
                                lr=float(cfg.lr), betas=(0.9, 0.98))
        steps = int(cfg.steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(int(cfg.warmup_steps), steps))
        stream = shapes.iter_conversations(shapes.TRAIN_SEED + int(cfg.seed), **data)
        model.train()
        t0, running, running_aux = time.perf_counter(), 0.0, 0.0
        for step in range(steps):
            conversations = list(itertools.islice(stream, int(cfg.batch_size)))
            batch = encode_conversations(processor, conversations)
            loss = model(**batch).loss
            if float(cfg.aux.weight):
                aux_loss = aux.loss([scene for scene, _ in conversations], batch["image_grid_thw"])
                running_aux += float(aux_loss.detach())
                loss = loss + float(cfg.aux.weight) * aux_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(cfg.grad_clip))
            opt.step()
            sched.step()
            running += float(loss.detach())
            if (step + 1) % int(cfg.log_every) == 0 or step + 1 == steps:
                n = (step % int(cfg.log_every)) + 1
                print(f"train_demo: step {step + 1}/{steps} loss {running / n:.4f} (vision probe {running_aux / n:.4f}) "
                      f"lr {sched.get_last_lr()[0]:.2e} {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
                running = running_aux = 0.0
            if int(cfg.eval_every) and (step + 1) % int(cfg.eval_every) == 0 and step + 1 < steps:
                val = accuracy(model, processor, shapes.make_examples(int(cfg.eval_examples) // 2, shapes.VALIDATION_SEED,
                                                                      **data))
                print(f"train_demo: step {step + 1} validation accuracy {_rounded(val)}", file=sys.stderr, flush=True)
                model.train()
        train_s = time.perf_counter() - t_train  # both phases

        model.eval()
        summary = {"steps": steps, "batch_size": int(cfg.batch_size), "vision_steps": int(cfg.vision.steps),
                   "parameters": params, "vision_seconds": round(vision_s, 1), "train_seconds": round(train_s, 1),
                   "config": OmegaConf.to_container(cfg, resolve=True)}
        if cfg.get("init") and (Path(cfg.init) / "training.json").exists():  # the run it continued
            summary["continued_from"] = json.loads((Path(cfg.init) / "training.json").read_text())
        if int(cfg.eval_examples):
            val = accuracy(model, processor, shapes.make_examples(int(cfg.eval_examples), shapes.VALIDATION_SEED, **data))
            summary["validation_accuracy"] = _rounded(val)
            print(f"train_demo: validation accuracy {summary['validation_accuracy']}", file=sys.stderr)
        model.save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"train_demo: wrote {out} in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return out


@hydra.main(version_base=None, config_path=".", config_name="train_demo")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
