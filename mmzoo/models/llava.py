"""Llava's own part: the ``<image>`` placeholder, a fixed token count per image, CLIP pixels.

Liu et al., 2023, "Visual Instruction Tuning" (arXiv:2304.08485) and "Improved Baselines with
Visual Instruction Tuning" (LLaVA-1.5, arXiv:2310.03744). Checkpoints:
``LlavaForConditionalGeneration``; the modules are components (``conf/model/llava.yaml``: the
``clip_vit`` encoder, the ``mlp_projector`` adapter, and the LM ``text_config.model_type`` names:
``llama``, or ``qwen2`` for LLaVA-Interleave / OneVision-style checkpoints).

Every image is resized and cropped to the ViT's fixed size, so each gives the same number of LM
tokens (576 for LLaVA-1.5's 336 px, patch 14). The tower runs on whole images: its input rows are
images, which the XLA executor pads to a bucket of image counts (:meth:`Llava.encoder_buckets`);
images never attend to each other, so padding images change nothing and their rows are never read.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from mmzoo.encoders import CLIP_RENAMES, resolve_feature_layers
from mmzoo.errors import MmzooError
from mmzoo.models._embeds import as_embeds
from mmzoo.models._media import load_images
from mmzoo.models.family import Media, SquareItems, extend_tp_plan, lm_key
from mmzoo.types import TowerInput

class Llava(SquareItems):
    """Llava: images through a CLIP ViT read at a hidden layer.

    Args:
        name: the conf option name.
        image_token_id: the ``<image>`` placeholder token (``config.json``).
        image_size, patch_size, in_channels: the ViT's input (every image is processed to it).
        select_strategy: ``default`` (the class token dropped) or ``full`` (kept: one more token).
        num_layers, feature_layer: the ViT's depth and the hidden layer(s) read: the checkpoint's
            blocks past the deepest one are never computed, so they are not built or loaded.
    """

    tower = "vision"
    modalities = ("image",)
    hf_class = "LlavaForConditionalGeneration"
    tiny_checkpoint = "make_tiny_llava"
    config_sections = ("text_config", "vision_config")
    # the projector: the shared MLP under the adapter's own names (not *.mlp.*), split as the MLPs are
    tp_plan = extend_tp_plan({"towers.*.adapter.fc1.*": "colwise", "towers.*.adapter.fc2.*": "rowwise"})

    def __init__(self, *, name: str, image_token_id: int, image_size: int, patch_size: int, in_channels: int,
                 select_strategy: str, num_layers: int, feature_layer: int | list[int]):
        super().__init__(name=name)
        self.depth = max(resolve_feature_layers(feature_layer, num_layers))
        self.num_layers = int(num_layers)
        self.image_token_id = int(image_token_id)
        self.image_size, self.in_channels = int(image_size), int(in_channels)
        self.tokens_per_image = (image_size // patch_size) ** 2 + int(select_strategy == "full")
        self.tokens_per_item = self.tokens_per_image  # an item is an image

    @classmethod
    def check_config(cls, config, raw: dict, source: str) -> None:
        """The base's checks, and a CLIP vision tower (the ``clip_vit`` encoder is CLIP's)."""
        super().check_config(config, raw, source)
        kind = config.vision_config.model_type
        if kind != "clip_vision_model":
            raise MmzooError(f"{source}: vision_config.model_type={kind!r}: model=llava's vision tower is CLIP's "
                             f"(clip_vision_model)")

    def raw_media(self, kind: str, items: list, processor) -> Media:
        """The checkpoint's image processor (resize, center crop, normalize); one tower call for all
        the request's images."""
        pixels = processor.image_processor(images=load_images(items), return_tensors="np")["pixel_values"]
        want = (self.in_channels, self.image_size, self.image_size)
        if tuple(pixels.shape[1:]) != want:
            raise MmzooError(f"the image processor gives {list(pixels.shape[1:])} pixels but the vision tower takes "
                             f"{list(want)}")
        n = pixels.shape[0]
        call = TowerInput(tower=self.tower, inputs={"pixel_values": np.asarray(pixels, np.float32)},
                          num_embeds=n * self.tokens_per_image)
        return Media(counts=[self.tokens_per_image] * n, calls=[call])

    def precomputed(self, kind: str, embeds, layout, hidden_size: int) -> Media:
        """``image_embeds``: ``[images * tokens_per_image, hidden]`` (or a list of 2-D)."""
        if layout is not None:  # every image gives the same rows: there is no layout to give
            raise MmzooError(f"model={self.name} does not take image_grid_thw (each image is {self.tokens_per_image} "
                             f"rows of image_embeds)")
        emb = as_embeds(embeds, "image_embeds", hidden=hidden_size)
        per = self.tokens_per_image
        if emb.shape[0] % per:
            raise MmzooError(f"image_embeds has {emb.shape[0]} rows, not a multiple of the {per} tokens per image "
                             f"[images * {per}, {hidden_size}]")
        return Media(counts=[per] * (emb.shape[0] // per),
                     calls=[TowerInput(tower=self.tower, inputs={}, num_embeds=emb.shape[0], embeds=emb)])

    def embeds_items(self, tensors: dict, kind: str) -> int:
        """Images: the rows of ``image_embeds`` over the tokens per image (there is no layout tensor:
        every image gives the same rows)."""
        if kind == "image" and "image_embeds" in tensors:
            return int(tensors["image_embeds"].shape[0]) // self.tokens_per_image
        return super().embeds_items(tensors, kind)

    def convert_weights(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' keys (v5 ``model.vision_tower.* / model.multi_modal_projector.* /
        model.language_model.*`` or the hub's ``vision_tower.vision_model.* / multi_modal_projector.* /
        language_model.model.*``) -> the composition's. CLIP's ``post_layernorm`` is not part of
        Llava's computation and is dropped, as are the blocks past the deepest feature layer (a block
        past ``vision_config.num_hidden_layers`` is kept, for the strict loader to report)."""
        out: dict[str, torch.Tensor] = {}
        for key, value in hf.items():
            k = re.sub(r"^model\.(vision_tower|multi_modal_projector)\.", r"\1.", key)
            if k.startswith("vision_tower."):
                k = k[len("vision_tower."):]
                k = k[len("vision_model."):] if k.startswith("vision_model.") else k
                if k.startswith("post_layernorm."):
                    continue
                m = re.match(r"encoder\.layers\.(\d+)\.", k)
                if m and self.depth <= int(m.group(1)) < self.num_layers:  # a layer past num_layers: unexpected
                    continue
                for pattern, repl in CLIP_RENAMES:
                    k = re.sub(pattern, repl, k)
                out["towers.vision.encoder." + k] = value
            elif k.startswith("multi_modal_projector."):
                k = k[len("multi_modal_projector."):].replace("linear_1.", "fc1.").replace("linear_2.", "fc2.")
                out["towers.vision.adapter." + k] = value
            else:
                out[lm_key(key) or key] = value  # anything else is reported as unexpected by the strict loader
        return out

