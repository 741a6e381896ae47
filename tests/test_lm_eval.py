"""lm-evaluation-harness as a real client of ``mmzoo.serve``: its ``local-completions`` model runs a
small task defined here (multiple-choice loglikelihood and generate_until, a few dozen questions
about the demo's drawn shapes) against the server on the embedded demo checkpoint, and every score
it gets equals scoring the same token ids with transformers' own class directly; its
``local-chat-completions`` model runs the generate_until task through the chat endpoint and the
checkpoint's chat template, each answer transformers' greedy continuation of the same chat."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmzoo.paths import ASSETS
from test_serve import Server

CKPT = ASSETS / "qwen2_vl_shapes"
SHAPES = {"triangle": 3, "square": 4, "pentagon": 5, "hexagon": 6}
COLORS = ["red", "green", "blue"]

TASKS = {
    "mmzoo_shapes_mc": """
task: mmzoo_shapes_mc
dataset_path: json
dataset_kwargs: {data_files: {test: DATA/mc.jsonl}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}]
""",
    "mmzoo_shapes_gen": """
task: mmzoo_shapes_gen
dataset_path: json
dataset_kwargs: {data_files: {test: DATA/gen.jsonl}}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n", "."], max_gen_toks: 6, do_sample: false, temperature: 0}
metric_list: [{metric: exact_match}]
"""}


def _write_tasks(root) -> None:
    shapes = list(SHAPES)
    mc = [{"question": f"How many corners does a {color} {shape} have?", "choices": [str(n) for n in SHAPES.values()],
           "answer": shapes.index(shape)} for shape in shapes for color in COLORS]
    mc += [{"question": f"Which shape has {n} sides?", "choices": shapes, "answer": i} for i, n in
           enumerate(SHAPES.values())] * 2
    gen = [{"question": f"What color is the {color} {shape}?", "answer": color} for shape in shapes for color in COLORS]
    for name, rows in (("mc", mc), ("gen", gen)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, text in TASKS.items():
        (root / f"{name}.yaml").write_text(text.replace("DATA", str(root)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(CKPT, tmp_path_factory.mktemp("media"), "executor=eager", "executor.max_model_len=256",
                 "served_model_name=shapes")
    yield srv
    srv.stop()


def test_lm_eval_scores_through_the_server_equal_transformers(server, tmp_path):
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager
    from transformers import Qwen2VLForConditionalGeneration

    _write_tasks(tmp_path)
    args = {"model": "shapes", "base_url": f"{server.url}/v1/completions", "tokenizer": str(CKPT),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1,
            "max_length": 256, "batch_size": 4}
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=list(TASKS),
                                  task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
                                  bootstrap_iters=0)
    client = get_model("local-completions")(**args)  # its tokenization of each (context, continuation)
    model = Qwen2VLForConditionalGeneration.from_pretrained(CKPT, dtype=torch.float32).eval()

    samples = out["samples"]["mmzoo_shapes_mc"]
    assert len(samples) == 20
    correct = []
    for sample in samples:
        mine = []
        for (context, continuation), (ll, greedy) in zip(sample["arguments"], [r[0] for r in sample["resps"]]):
            ctx, cont = client._encode_pair(context, continuation)
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            picked = logp[torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1), torch.tensor(cont)]
            want = float(picked.sum())
            assert ll == pytest.approx(want, abs=1e-3), (context, continuation)
            is_greedy = bool((logp[len(ctx) - 1:len(ctx) + len(cont) - 1].argmax(-1) == torch.tensor(cont)).all())
            assert greedy == is_greedy
            mine.append(want)
        correct.append(float(np.argmax(mine) == sample["doc"]["answer"]))
    assert out["results"]["mmzoo_shapes_mc"]["acc,none"] == pytest.approx(np.mean(correct))

    def greedy_answer(ids: list[int]) -> str:
        """transformers' greedy continuation of ``ids``, cut at the task's stops as lm-eval cuts it."""
        with torch.no_grad():
            gen = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=6, do_sample=False, pad_token_id=0)
        want = client.tokenizer.decode(gen[0, len(ids):], skip_special_tokens=True)
        for stop in ("\n", "."):
            want = want.split(stop)[0]
        return want

    samples = out["samples"]["mmzoo_shapes_gen"]
    assert len(samples) == 12
    hits = []
    for sample in samples:
        (context, kwargs), (text,) = sample["arguments"][0], sample["resps"][0]
        assert text == greedy_answer(client.tok_encode(context)), context
        hits.append(float(text.strip() == sample["doc"]["answer"]))
    assert out["results"]["mmzoo_shapes_gen"]["exact_match,none"] == pytest.approx(np.mean(hits))

    chat = lm_eval.simple_evaluate(model="local-chat-completions", tasks=["mmzoo_shapes_gen"], log_samples=True,
                                   model_args={"model": "shapes", "base_url": f"{server.url}/v1/chat/completions",
                                               "num_concurrent": 1, "max_retries": 1},
                                   task_manager=TaskManager(include_path=str(tmp_path)), bootstrap_iters=0,
                                   apply_chat_template=True)
    samples = chat["samples"]["mmzoo_shapes_gen"]
    assert len(samples) == 12
    hits = []
    for sample in samples:
        (context, kwargs), (text,) = sample["arguments"][0], sample["resps"][0]
        messages = json.loads(context[0])  # the chat lm-eval sent (its JsonChatStr, logged as a tuple)
        assert [m["role"] for m in messages] == ["user"]
        ids = client.tokenizer(client.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                    tokenize=False))["input_ids"]
        assert text == greedy_answer(ids), messages
        hits.append(float(text.strip() == sample["doc"]["answer"]))
    assert chat["results"]["mmzoo_shapes_gen"]["exact_match,none"] == pytest.approx(np.mean(hits))
