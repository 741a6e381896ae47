"""Helpers of the parity tests against transformers (shared by test_parity.py and the family files).

``reference`` runs transformers' own model class on a checkpoint: prompt ids, prefill logits and
greedy tokens with EOS off, for a request of ``n`` media items; ``engine`` keeps one mmzoo engine
per (checkpoint, executor, backend) for the whole session; ``EXECUTORS``, ``XLA`` and ``GEN`` are
the executors, XLA options and generation settings the family files share.
"""

from __future__ import annotations

import json

import mmzoo

EXECUTORS = ("eager", "xla")
# XLA options of the families whose tower rows are whole items (Llava's images, Qwen2-Audio's clips):
# one 64-row encoder bucket, two slots, graphs compiled on first use
XLA = {"progress": False, "warmup": False, "buckets": {"min_encoder_rows": 64, "max_encoder_rows": 64}, "max_batch": 2}
GEN = {"max_new_tokens": 16, "ignore_eos": True}
LOGPROBS = 5  # alternatives per generated token the parity test compares  # 16 greedy tokens, EOS off as in :func:`reference`

_ENGINES: dict = {}


def engine(ckpt, executor: str, attention: str = "sdpa", **xla):
    """One engine per (checkpoint, executor, backend, options), built on first use."""
    key = (str(ckpt), executor, attention, json.dumps(xla, sort_keys=True) if executor == "xla" else "")
    if key not in _ENGINES:
        _ENGINES[key] = mmzoo.load(ckpt, executor=executor, attention=attention, max_model_len=256,
                                   **(xla if executor == "xla" else {}))
    return _ENGINES[key]


def reference(ckpt, hf_class: str, kind: str, files: list[str], counts, prompt, new_tokens: int = 16) -> dict:
    """transformers' prompt ids, prefill logits, greedy tokens (EOS disabled) and each generated
    token's log-probability with the :data:`LOGPROBS` most likely ones, per item count.

    Args:
        hf_class: the transformers class name (``"LlavaForConditionalGeneration"``).
        kind: ``"image"`` or ``"audio"``: what ``files`` hold.
        prompt: the text, or ``{count: text}``.
    """
    import librosa
    import torch
    import transformers
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(ckpt)
    model = getattr(transformers, hf_class).from_pretrained(ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = {}
    for n in counts:
        text = prompt[n] if isinstance(prompt, dict) else prompt
        content = [{"type": kind}] * n + [{"type": "text", "text": text}]
        chat = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        if kind == "audio":
            sr = processor.feature_extractor.sampling_rate
            clips = [librosa.load(f, sr=sr)[0] for f in files[:n]]
            inputs = processor(text=[chat], audio=clips or None, sampling_rate=sr, return_tensors="pt")
        else:
            # the request's images as one sample, as apply_chat_template gives a conversation's
            images = [[Image.open(f).convert("RGB") for f in files[:n]]] if n else None
            inputs = processor(text=[chat], images=images, return_tensors="pt")
        with torch.no_grad():
            logits = model(**inputs).logits[0].float().numpy()
            gen = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
        ids = inputs["input_ids"][0].tolist()
        tokens = gen.sequences[0, len(ids):].tolist()
        # each generated token's log-probability and the LOGPROBS most likely: the raw logits' log-softmax
        steps = torch.log_softmax(torch.cat(gen.logits).float(), dim=-1)
        top = steps.topk(LOGPROBS, dim=-1)
        out[n] = {"ids": ids, "logits": logits, "tokens": tokens,
                  "logprobs": steps.gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy(),
                  "top_logprobs": top.values.numpy(), "top_ids": top.indices.numpy()}
    return out


def qwen_vl_inputs(processor, prompt: str, images=(), videos=()):
    """transformers' processor inputs for one user turn of ``images`` (paths), then ``videos``
    (lists of frames), then ``prompt``, through the chat template (the Qwen-VL families' tests)."""
    from PIL import Image

    content = [{"type": "image"}] * len(images) + [{"type": "video"}] * len(videos) + [{"type": "text", "text": prompt}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return processor(text=[chat], images=[Image.open(f).convert("RGB") for f in images] or None,
                     videos=list(videos) or None, return_tensors="pt")


def assert_refused(engine, cases, prompt: str, *, kind: str, files: list[str]) -> None:
    """Every ``(request fields, message pattern)`` in ``cases`` is refused at prepare time with a
    :class:`MmzooError` matching it; and token ids with one placeholder for two items are refused."""
    import pytest

    from mmzoo.errors import MmzooError

    for kwargs, match in cases:
        with pytest.raises(MmzooError, match=match):
            engine.prepare(mmzoo.Request(**{"prompt": prompt, **kwargs}))
    pad = getattr(engine.config, f"{kind}_token_id")
    with pytest.raises(MmzooError, match=rf"prompt_token_ids has 1 {kind} placeholder.* but 2 {kind}s"):
        engine.prepare(mmzoo.Request(prompt_token_ids=[5, pad, 6], **{f"{kind}s": files[:2]}))


def served_chat(engine, images: list[str], prompt: str, new_tokens: int) -> tuple[int, list[int]]:
    """One greedy chat completion through the OpenAI server's app (in process, FastAPI's TestClient)
    with ``images`` as data-URL ``image_url`` parts before ``prompt``: ``(prompt tokens, token ids)``."""
    import base64

    from fastapi.testclient import TestClient

    from mmzoo.serve.app import create_app

    urls = ["data:image/png;base64," + base64.b64encode(open(f, "rb").read()).decode() for f in images]
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": prompt}]
    body = {"model": "tiny", "temperature": 0, "max_tokens": new_tokens, "ignore_eos": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": content}]}
    with TestClient(create_app(engine, served_model_name="tiny")) as client:
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"], r.json()["choices"][0]["token_ids"]
