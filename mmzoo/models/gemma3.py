"""Gemma 3's own part: fixed-size images framed by ``<start_of_image>`` / ``<end_of_image>``, attending both ways.

Gemma Team, 2025, "Gemma 3 Technical Report" (arXiv:2503.19786). Checkpoints:
``Gemma3ForConditionalGeneration``; the modules are components (``conf/model/gemma3.yaml``: the
``siglip_vit`` encoder, the ``avg_pool_projector`` adapter, the ``gemma3`` LM).

The image processor resizes each image to the tower's square input (896 px: 64 x 64 patches, pooled
to 256 tokens); each image is one tower item of a fixed size, like Llava's, and with pan-and-scan
crops (``do_pan_and_scan``, which Gemma3Processor's defaults turn off) they would follow it as items
of their own (its views). The chat template
renders an image as ``<start_of_image>``, which the processor replaces by ``\\n\\n<start_of_image>``
+ the image's soft tokens + ``<end_of_image>\\n\\n``, or with crops by its "Here is the original
image ... and here are some crops ..." text (its ``replace_image_token``:
:meth:`Gemma3.expand_placeholder`). Token prompts carry the framing themselves around one soft token
(or the whole run) per view. During a prompt's forward the soft tokens of one view attend to each
other both ways (transformers' ``token_type_ids`` mask): :attr:`Gemma3.bidirectional_token`.
Precomputed ``image_embeds`` may come with ``image_grid_thw`` rows ``[views, t, t]`` (``t * t``
tokens per view; what ``mmzoo.encode`` writes); without it each image is one view.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from mmzoo.encoders import CLIP_RENAMES, square_side
from mmzoo.errors import MmzooError
from mmzoo.lms import gemma3_lm_key
from mmzoo.models._embeds import as_embeds, as_grid, embeds_media
from mmzoo.models._media import load_images
from mmzoo.models.family import Media, SquareItems
from mmzoo.types import TowerInput


class Gemma3(SquareItems):
    """Gemma 3: images through SigLIP and the average-pool projector, each image's tokens attending
    to each other both ways.

    Args:
        name: the conf option name.
        image_token_id: the image soft token (``image_token_index``); ``boi_token_id``,
            ``eoi_token_id``: the tokens framing an image.
        image_size, patch_size: the tower's input side and a patch's, in pixels.
        in_channels: the images' channels.
        tokens_per_image: ``mm_tokens_per_image``.
    """

    tower = "vision"
    modalities = ("image",)
    hf_class = "Gemma3ForConditionalGeneration"
    tiny_checkpoint = "make_tiny_gemma3"
    config_sections = ("text_config", "vision_config")

    def __init__(self, *, name: str, image_token_id: int, boi_token_id: int, eoi_token_id: int, image_size,
                 patch_size, in_channels: int, tokens_per_image: int):
        super().__init__(name=name)
        self.image_token_id, self.boi_token_id, self.eoi_token_id = int(image_token_id), int(boi_token_id), \
            int(eoi_token_id)
        self.image_size, self.in_channels = square_side(image_size, "image_size"), int(in_channels)
        self.patch_size, self.tokens_per_image = square_side(patch_size, "patch_size"), int(tokens_per_image)
        self.tokens_per_item = self.tokens_per_image  # an item is an image or one of its crops

    @property
    def bidirectional_token(self) -> int:
        return self.image_token_id

    # -- what the checkpoint must hold -----------------------------------------------------------
    @classmethod
    def check_config(cls, config, raw: dict, source: str) -> None:
        """The base's checks, a SigLIP tower without its pooling head, and a text model of causal
        attention (EmbeddingGemma's ``use_bidirectional_attention`` is not Gemma 3's generator)."""
        super().check_config(config, raw, source)
        kind = config.vision_config.model_type
        if kind != "siglip_vision_model":
            raise MmzooError(f"{source}: vision_config.model_type={kind!r}: model=gemma3's vision tower is SigLIP "
                             f"(siglip_vision_model)")
        if getattr(config.vision_config, "vision_use_head", False):
            raise MmzooError(f"{source}: vision_config.vision_use_head=true: Gemma 3 reads SigLIP's patch features, "
                             f"not its pooled head")
        if getattr(config.text_config, "use_bidirectional_attention", False):
            raise MmzooError(f"{source}: text_config.use_bidirectional_attention=true (an embedding model): "
                             f"model=gemma3 generates with causal attention")
        for name in ("boi_token_index", "eoi_token_index"):
            value = getattr(config, name)
            if not isinstance(value, int) or not 0 <= value < config.text_config.vocab_size:
                raise MmzooError(f"{source}: {name}={value!r} is not a token id of the vocabulary "
                                 f"(text_config.vocab_size={config.text_config.vocab_size})")

    def placeholder(self, kind: str, processor) -> tuple[str, int]:
        """The chat template renders ``<start_of_image>`` per image; the prompt's placeholders are the
        image soft tokens it expands to."""
        return processor.boi_token, self.image_token_id

    def placeholder_token(self, kind: str, processor) -> str:
        """The image soft token (the tokenizer's ``image_token``), not the rendered ``<start_of_image>``."""
        return processor.tokenizer.image_token

    def check_processor(self, processor, *, vocab_size: int, source) -> None:
        """The base's checks on the tokenizer and template, then Gemma 3's framing tokens: the
        tokenizer's ``boi_token``, ``eoi_token`` and ``image_token`` are the config's ids, the
        processor's ``image_seq_length`` is the projector's tokens per image."""
        tokenizer = getattr(processor, "tokenizer", None)
        if not all(isinstance(getattr(tokenizer, a, None), str) for a in ("boi_token", "eoi_token", "image_token")):
            raise MmzooError(f"the tokenizer of {source} does not name boi_token, eoi_token and image_token: "
                             f"model=gemma3 frames images with Gemma3Processor's tokens")
        for attr, want, field in (("boi_token", self.boi_token_id, "boi_token_index"),
                                  ("eoi_token", self.eoi_token_id, "eoi_token_index"),
                                  ("image_token", self.image_token_id, "image_token_index")):
            got = tokenizer.convert_tokens_to_ids(getattr(tokenizer, attr))
            if got != want:
                raise MmzooError(f"{source}/config.json: {field}={want}, but the tokenizer's {attr} "
                                 f"{getattr(tokenizer, attr)!r} is id {got}")
        super().check_processor(processor, vocab_size=vocab_size, source=source)
        self.check_item_tokens(processor, "image_seq_length", source, what="the projector",
                               why=" per image (mm_tokens_per_image)")

    # -- media -----------------------------------------------------------------------------------
    def expand_placeholder(self, kind: str, media: Media, item: int, processor) -> str:
        """The processor's own text for image ``item`` (``replace_image_token``): its
        ``full_image_sequence`` (``\\n\\n<start_of_image>`` + soft tokens + ``<end_of_image>\\n\\n``),
        once per view with its pan-and-scan crops' words around them."""
        return processor.replace_image_token({"num_crops": [int(media.grid[item][0]) - 1]}, 0)

    def raw_media(self, kind: str, items: list, processor) -> Media:
        """The checkpoint's image processor with Gemma3Processor's image defaults (as its ``__call__``
        passes them; they turn pan-and-scan off whatever preprocessor_config.json says): each image
        resized to the tower's input, followed by its pan-and-scan crops where it makes any."""
        out = processor.image_processor(images=load_images(items), **processor.images_kwargs, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], np.float32)
        crops = [int(c) for c in np.asarray(out.get("num_crops", [0] * len(items))).reshape(-1)]
        want = (len(items) + sum(crops), self.in_channels, self.image_size, self.image_size)
        if tuple(pixels.shape) != want or len(crops) != len(items):
            raise MmzooError(f"the image processor gives pixels of shape {list(pixels.shape)} ({crops} crops) but the "
                             f"vision tower takes {list(want)}")
        n = self.tokens_per_image
        call = TowerInput(tower=self.tower, inputs={"pixel_values": pixels}, num_embeds=want[0] * n)
        return Media(counts=[(1 + c) * n for c in crops], calls=[call], grid=self._grid([1 + c for c in crops]))

    def _grid(self, views: list[int]) -> np.ndarray:
        """``[images, 3]`` layout rows ``[views, t, t]`` (``t * t`` tokens per view)."""
        t = round(self.tokens_per_image ** 0.5)
        return np.array([[v, t, t] for v in views], np.int64).reshape(-1, 3)

    def precomputed(self, kind: str, embeds, layout, hidden_size: int) -> Media:
        """``image_embeds [views * tokens_per_image, hidden]``, with ``image_grid_thw`` rows
        ``[views, t, t]`` per image (an image and its pan-and-scan crops) or without: one view each."""
        per = self.tokens_per_image
        if layout is None:
            emb = as_embeds(embeds, "image_embeds", hidden=hidden_size)
            if emb.shape[0] % per:
                raise MmzooError(f"image_embeds has {emb.shape[0]} rows, not a multiple of the {per} tokens per image")
            views, embeds = [1] * (emb.shape[0] // per), emb
        else:
            grid, t = as_grid(layout, "image_grid_thw"), round(per ** 0.5)
            bad = np.flatnonzero((grid[:, 1] != t) | (grid[:, 2] != t))
            if len(bad):
                raise MmzooError(f"image_grid_thw[{bad[0]}] = {grid[bad[0]].tolist()}: each view gives {t}x{t} tokens "
                                 f"([views, {t}, {t}])")
            views = [int(v) for v in grid[:, 0]]
        return embeds_media(embeds, "image_embeds", hidden=hidden_size, counts=[v * per for v in views],
                            grid=self._grid(views), tower=self.tower, implied=f"views x {per} tokens per view")

    def embeds_items(self, tensors: dict, kind: str) -> int:
        """Images in an embeddings file: its layout's rows, or without one its rows over the tokens
        per image."""
        if kind == "image" and "image_embeds" in tensors and "image_grid_thw" not in tensors:
            return int(tensors["image_embeds"].shape[0]) // self.tokens_per_image
        return super().embeds_items(tensors, kind)

    # -- weights ---------------------------------------------------------------------------------
    def convert_weights(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' keys (v5 ``model.vision_tower.* / model.multi_modal_projector.* /
        model.language_model.* / lm_head.*`` or the hub's ``vision_tower.* / multi_modal_projector.* /
        language_model.model.*``, what ``save_pretrained`` writes) -> the composition's: SigLIP under
        CLIP's names, the projector's norm and matrix, the LM under :func:`~mmzoo.lms.gemma3_lm_key`'s
        (Gemma's ``post_attention_layernorm`` is the attention output's norm)."""
        out: dict[str, torch.Tensor] = {}
        for key, value in hf.items():
            k = re.sub(r"^model\.(vision_tower|multi_modal_projector|language_model)\.", r"\1.", key)
            k = re.sub(r"^language_model\.model\.", "language_model.", k)
            k = re.sub(r"^language_model\.lm_head\.", "lm_head.", k)
            if k.startswith("vision_tower."):
                k = k[len("vision_tower."):].removeprefix("vision_model.")
                for pattern, repl in CLIP_RENAMES:
                    k = re.sub(pattern, repl, k)
                out["towers.vision.encoder." + k] = value
            elif k == "multi_modal_projector.mm_input_projection_weight":
                out["towers.vision.adapter.weight"] = value
            elif k.startswith("multi_modal_projector.mm_soft_emb_norm."):
                out["towers.vision.adapter.norm." + k.rsplit(".", 1)[1]] = value
            elif k.startswith("language_model."):
                out["lm." + gemma3_lm_key(k[len("language_model."):])] = value
            elif k.startswith("lm_head."):
                out["lm." + k] = value
            else:
                out[key] = value  # reported as unexpected by the strict loader
        return out


