"""transformers' ``generate()`` answering what ``python -m mmzoo.infer`` would: the peer of the
time-to-first-answer stage (:mod:`mmzoo.bench.first_answer`), run as a fresh process.

``python -m mmzoo.bench.hf_answer`` answers the default command's question about the bundled image
on the embedded checkpoint; ``... requests=FILE`` each line's ``prompt`` and ``images``. One answer
per line on stdout, greedy, EOS on, at most 32 new tokens: the CLI's defaults.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    import torch
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from mmzoo.paths import ASSETS

    args = dict(a.split("=", 1) for a in argv if "=" in a)
    checkpoint = args.get("checkpoint", str(ASSETS / "qwen2_vl_shapes"))
    if "requests" in args:
        with open(args["requests"]) as f:
            reqs = [json.loads(line) for line in f if line.strip()]
    else:
        reqs = [{"prompt": "What shape is this?", "images": [str(ASSETS / "sample.png")]}]
    processor = AutoProcessor.from_pretrained(checkpoint, local_files_only=True)
    model = Qwen2VLForConditionalGeneration.from_pretrained(checkpoint, local_files_only=True).eval()
    from transformers.image_utils import load_image  # what a transformers user reads a file with

    for req in reqs:
        images = [load_image(str(p)) for p in req.get("images", [])]
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": req["prompt"]}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        n = inputs["input_ids"].shape[1]
        print(processor.tokenizer.decode(out[0, n:], skip_special_tokens=True), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
