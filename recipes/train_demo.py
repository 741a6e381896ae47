"""Recipe: train the embedded demo checkpoint, a small Qwen2-VL that answers questions about shapes.

transformers' own ``Qwen2VLForConditionalGeneration`` (so the checkpoint is a plain Hugging Face
one, and the math is the one mmzoo matches) is trained from scratch with a plain torch loop on an
endless stream of :mod:`mmzoo.shapes` scenes of one to three shapes. Each scene is one multi-turn
conversation asking every unambiguous question about it ("What shape is this?", "What color is the
square?", "How many shapes are there?", in a random order), each with a one-word answer; the loss
is on the answers and their closing ``<|im_end|>`` only. Validation asks one question per image,
as inference does. Two choices matter for a model this small (measured on 300-step runs):
several answers per image (5x the supervision for 1.5x the step time), and an init std of 0.1
rather than transformers' 0.02 (at 0.02 the attention logits start so flat that the LM takes
over a thousand steps to start looking at the image at all). The tokenizer, chat template and
processor are those of :mod:`mmzoo.testing`. Everything is seeded: the same config gives the same
data stream and initial weights.

Run (about 17 minutes on 2 CPU cores; writes mmzoo/assets/qwen2_vl_shapes)::

    python recipes/train_demo.py
    python recipes/train_demo.py steps=200 output=/tmp/demo   # a quick, weaker one elsewhere
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from mmzoo import shapes
from mmzoo._paths import ASSETS
from mmzoo.testing import generation_config, qwen2_vl_config, save_processor, synthetic_corpus, train_tokenizer

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


def _rounded(acc: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in acc.items()}


def train(cfg: DictConfig) -> Path:
    """Train per ``cfg`` (see ``recipes/train_demo.yaml``), save the checkpoint, return its directory."""
    from transformers import Qwen2VLForConditionalGeneration

    t_start = time.perf_counter()
    torch.set_num_threads(int(cfg.threads))
    out = Path(cfg.output) if cfg.output else DEFAULT_OUTPUT
    # mmzoo.testing's tokenizer, with this data's words added so that each answer is one token
    tokenizer = train_tokenizer(int(cfg.tokenizer_vocab_size), corpus=synthetic_corpus() + shapes.tokenizer_corpus())
    config = qwen2_vl_config(tokenizer, **OmegaConf.to_container(cfg.model))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    processor = save_processor(tmp, tokenizer, config, min_pixels=int(cfg.processor.min_pixels),
                               max_pixels=int(cfg.processor.max_pixels), default_system=None)

    torch.manual_seed(int(cfg.seed))
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = generation_config(tokenizer)
    params = sum(p.numel() for p in model.parameters())
    print(f"train_demo: {params / 1e6:.2f}M parameters, {cfg.steps} steps of {cfg.batch_size}", file=sys.stderr)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": float(cfg.weight_decay)},
                             {"params": no_decay, "weight_decay": 0.0}], lr=float(cfg.lr), betas=(0.9, 0.98))
    steps, warmup = int(cfg.steps), int(cfg.warmup_steps)

    def schedule(step: int) -> float:  # linear warmup, cosine decay to 1/20 of the peak
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    stream = shapes.iter_conversations(shapes.TRAIN_SEED + int(cfg.seed))
    model.train()
    t0, running = time.perf_counter(), 0.0
    for step in range(steps):
        batch = encode_conversations(processor, list(itertools.islice(stream, int(cfg.batch_size))))
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(cfg.grad_clip))
        opt.step()
        sched.step()
        running += float(loss.detach())
        if (step + 1) % int(cfg.log_every) == 0 or step + 1 == steps:
            n = (step % int(cfg.log_every)) + 1
            print(f"train_demo: step {step + 1}/{steps} loss {running / n:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            running = 0.0
        if int(cfg.eval_every) and (step + 1) % int(cfg.eval_every) == 0 and step + 1 < steps:
            val = accuracy(model, processor, shapes.make_examples(int(cfg.eval_examples) // 2, shapes.VALIDATION_SEED))
            print(f"train_demo: step {step + 1} validation accuracy {_rounded(val)}", file=sys.stderr, flush=True)
            model.train()
    train_s = time.perf_counter() - t0

    model.eval()
    summary = {"steps": steps, "batch_size": int(cfg.batch_size), "parameters": params,
               "train_seconds": round(train_s, 1), "config": OmegaConf.to_container(cfg, resolve=True)}
    if int(cfg.eval_examples):
        val = accuracy(model, processor, shapes.make_examples(int(cfg.eval_examples), shapes.VALIDATION_SEED))
        summary["validation_accuracy"] = _rounded(val)
        print(f"train_demo: validation accuracy {summary['validation_accuracy']}", file=sys.stderr)
    model.save_pretrained(tmp)
    (tmp / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"train_demo: wrote {out} in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return out


@hydra.main(version_base=None, config_path=".", config_name="train_demo")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
