"""InternVL's own part: images as tiles, ``<img>`` + one placeholder per token of each tile + ``</img>``.

Chen et al., 2024, "InternVL: Scaling up Vision Foundation Models and Aligning for Generic
Visual-Linguistic Tasks" (arXiv:2312.14238); InternVL3: Zhu et al., 2025 (arXiv:2504.10479).
Checkpoints: ``InternVLForConditionalGeneration`` (the transformers "-hf" format); the modules are
components (``conf/model/internvl.yaml``: the ``intern_vit`` encoder, the ``pixel_shuffle``
adapter, the ``qwen2`` LM).

The image processor (transformers' ``GotOcr2ImageProcessor`` with ``crop_to_patches``, as
``InternVLProcessor`` calls it) resizes each image onto the grid of 1 to ``max_patches`` tiles
closest to its aspect ratio and cuts it, adding a thumbnail of the whole image when there are
several tiles. Each tile is one tower item of a fixed size (like Llava's images), giving
``(image_size / patch_size / k)^2`` LM tokens after the pixel shuffle; the tiles of all the
request's images go through one tower call. In the prompt, each image's placeholder becomes
``<img>`` + its tiles' tokens + ``</img>`` (:meth:`InternVL.expand_placeholder`). A video is its
frames, each resized to one tile by the video processor and written as ``FrameN: <img>`` + its
tokens + ``</img>`` with the image placeholder token (``InternVLProcessor.replace_video_token``):
images and videos fill one token, told apart by their order in the prompt
(:attr:`~mmzoo.models.Family.shared_placeholders`). Token prompts (``prompt_token_ids``) carry the
``<img>`` / ``</img>`` tokens themselves around one placeholder per image (videos go through a
prompt or messages). Precomputed ``image_embeds`` / ``video_embeds`` come with ``image_grid_thw`` /
``video_grid_thw`` rows ``[tiles or frames, s, s]`` (``s * s`` tokens per tile), which is what
``mmzoo.encode`` writes.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from mmzoo.adapters.pixel_shuffle import shuffled_tokens
from mmzoo.encoders import resolve_feature_layers, square_side
from mmzoo.errors import MmzooError
from mmzoo.models._embeds import as_grid, embeds_media
from mmzoo.models._media import load_images, load_videos
from mmzoo.models.family import Media, SquareItems, extend_tp_plan, lm_key
from mmzoo.types import TowerInput

# transformers' InternVLVisionModel names -> the ClipVisionEncoder's (after the tower prefix is stripped)
_VIT_RENAMES = [
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed."),
    (r"^embeddings\.cls_token$", "class_embedding"),
    (r"^embeddings\.position_embeddings$", "position_embedding.weight"),
    (r"^layernorm\.", "post_norm."),
    (r"^encoder\.layer\.", "blocks."),
    (r"\.attention\.projection_layer\.", ".attn.o_proj."),
    (r"\.attention\.", ".attn."),
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
    (r"\.lambda_1$", ".scale1.weight"),
    (r"\.lambda_2$", ".scale2.weight"),
]
# the projector: InternVLMultiModalProjector -> PixelShuffle(norm, proj = MLP)
_PROJECTOR_RENAMES = {"layer_norm.": "norm.", "linear_1.": "proj.fc1.", "linear_2.": "proj.fc2."}


class InternVL(SquareItems):
    """InternVL: images cut into fixed-size tiles (plus a thumbnail), each through InternViT and the
    pixel-shuffle projector.

    Args:
        name: the conf option name.
        image_token_id: the ``<IMG_CONTEXT>`` placeholder token (``config.json``).
        image_size, patch_size: a tile's side and a patch's, in pixels (an int or a square pair).
        in_channels: the tiles' channels.
        scale_factor: the pixel shuffle's ``k`` (``1 / downsample_ratio``).
        num_layers, feature_layer: the ViT's depth and the hidden state read: the checkpoint's blocks
            past it are never computed, so they are not built or loaded.
        mean_pooling: ``use_mean_pooling``; without it the checkpoint has the ViT's final LayerNorm,
            which is computed only when ``feature_layer`` is -1 (as transformers reads it).
    """

    tower = "vision"
    modalities = ("image", "video")
    shared_placeholders = {"video": "image"}  # a video's frames fill the image placeholder token
    hf_class = "InternVLForConditionalGeneration"
    tiny_checkpoint = "make_tiny_internvl"
    config_sections = ("text_config", "vision_config")
    # the projector's MLP under the adapter's own names (proj.*, not *.mlp.*), split as the MLPs are
    tp_plan = extend_tp_plan({"towers.*.adapter.proj.fc1.*": "colwise", "towers.*.adapter.proj.fc2.*": "rowwise"})

    def __init__(self, *, name: str, image_token_id: int, image_size, patch_size, in_channels: int,
                 scale_factor: int, num_layers: int, feature_layer: int | list[int], mean_pooling: bool):
        super().__init__(name=name)
        self.image_token_id = int(image_token_id)
        self.image_size, self.in_channels = square_side(image_size, "image_size"), int(in_channels)
        self.patch_size, self.scale_factor = square_side(patch_size, "patch_size"), int(scale_factor)
        self.tile_side = self.image_size // self.patch_size // self.scale_factor  # tokens per tile side
        self.tokens_per_tile = self.tokens_per_item = self.tile_side ** 2  # an item is a tile
        self.num_layers = int(num_layers)
        self.depth = max(resolve_feature_layers(feature_layer, num_layers))
        self.post_norm = not mean_pooling and feature_layer == -1

    # -- what the checkpoint must hold -----------------------------------------------------------
    @classmethod
    def check_config(cls, config, raw: dict, source: str) -> None:
        """The base's checks, an InternViT tower, one feature layer and the class token dropped (the
        pixel shuffle needs a square grid of patches), as transformers' ``get_image_features``."""
        super().check_config(config, raw, source)
        kind = config.vision_config.model_type
        if kind != "internvl_vision":
            raise MmzooError(f"{source}: vision_config.model_type={kind!r}: model=internvl's vision tower is "
                             f"InternViT (internvl_vision)")
        for key in ("image_size", "patch_size"):
            value = list(getattr(config.vision_config, key))  # transformers' (height, width)
            if value[0] != value[-1]:
                raise MmzooError(f"{source}: vision_config.{key}={value}: model=internvl takes square tiles and "
                                 f"patches (height == width)")
        if not isinstance(config.vision_feature_layer, int):
            raise MmzooError(f"{source}: vision_feature_layer={config.vision_feature_layer!r}: InternVL reads one "
                             f"hidden layer (an integer)")
        if config.vision_feature_select_strategy != "default":
            raise MmzooError(f"{source}: vision_feature_select_strategy={config.vision_feature_select_strategy!r}: "
                             f"InternVL drops the class token ('default'); the pixel shuffle needs a square grid of "
                             f"patches")

    def check_processor(self, processor, *, vocab_size: int, source) -> None:
        """The base's checks, and an InternVL processor: its ``<img>`` / ``</img>`` tokens, and its
        ``image_seq_length`` equal to the tokens a tile gives."""
        super().check_processor(processor, vocab_size=vocab_size, source=source)
        for attr in ("start_image_token", "end_image_token", "video_token"):
            if not isinstance(getattr(processor, attr, None), str):
                raise MmzooError(f"the processor of {source} ({type(processor).__name__}) has no {attr}: "
                                 f"model=internvl frames each image's tokens with InternVLProcessor's")
        self.check_item_tokens(processor, "image_seq_length", source, what="a tile",
                               why=shuffled_tokens(self.image_size, self.patch_size, self.scale_factor))

    # -- media -----------------------------------------------------------------------------------
    def expand_placeholder(self, kind: str, media: Media, item: int, processor) -> str:
        """``<img>`` + the item's placeholders + ``</img>``, as ``InternVLProcessor`` writes an image;
        a video as its ``replace_video_token`` does: ``FrameN: <img>...</img>`` per frame."""
        if kind == "video":
            frames = np.empty(int(media.grid[item][0]))  # replace_video_token reads the frame count off its length
            return processor.replace_video_token({"pixel_values_videos": [frames]}, 0)
        pad = processor.image_token
        return f"{processor.start_image_token}{pad * media.counts[item]}{processor.end_image_token}"

    def raw_media(self, kind: str, items: list, processor) -> Media:
        """The checkpoint's image processor with InternVLProcessor's defaults (``crop_to_patches``):
        each image's tiles (and thumbnail), one tower call for all the request's tiles; its video
        processor: each video's frames as tiles."""
        if kind == "video":
            videos = [np.asarray(processor.video_processor(videos=[frames], return_tensors="np")["pixel_values_videos"],
                                 np.float32)[0] for frames in load_videos(items)]  # [frames, c, h, w] each
            pixels, tiles = np.concatenate(videos), [len(v) for v in videos]
        else:
            out = processor.image_processor(images=load_images(items), **processor.images_kwargs,
                                            return_tensors="np")
            pixels, tiles = np.asarray(out["pixel_values"], np.float32), [int(n) for n in out["num_patches"]]
        want = (self.in_channels, self.image_size, self.image_size)
        if tuple(pixels.shape[1:]) != want:
            raise MmzooError(f"the image processor gives {list(pixels.shape[1:])} pixels per tile but the vision "
                             f"tower takes {list(want)}")
        s = self.tile_side
        call = TowerInput(tower=self.tower, inputs={"pixel_values": pixels}, num_embeds=sum(tiles) * s * s)
        return Media(counts=[n * s * s for n in tiles], calls=[call], grid=np.array([[n, s, s] for n in tiles]))

    def precomputed(self, kind: str, embeds, layout, hidden_size: int) -> Media:
        """``{kind}_embeds [sum(tiles) * s * s, hidden]`` with ``{kind}_grid_thw`` rows ``[tiles, s, s]``
        (a video's tiles are its frames)."""
        s, what = self.tile_side, "tiles" if kind == "image" else "frames"
        if layout is None:
            raise MmzooError(f"{kind}_embeds needs {kind}_grid_thw ([{what}, {s}, {s}] per {kind}: model={self.name} "
                             f"places each {kind} by its {what})")
        grid = as_grid(layout, f"{kind}_grid_thw")
        bad = np.flatnonzero((grid[:, 1] != s) | (grid[:, 2] != s))
        if len(bad):
            raise MmzooError(f"{kind}_grid_thw[{bad[0]}] = {grid[bad[0]].tolist()}: each tile gives "
                             f"{s}x{s} tokens ([{what}, {s}, {s}])")
        return embeds_media(embeds, f"{kind}_embeds", hidden=hidden_size, grid=grid, tower=self.tower,
                            counts=[int(n) for n in grid.prod(axis=1)],
                            implied=f"{what} x {self.tokens_per_tile} tokens per tile")

    # -- weights ---------------------------------------------------------------------------------
    def convert_weights(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' keys (v5 ``model.vision_tower.* / model.multi_modal_projector.* /
        model.language_model.*`` or the hub's ``vision_tower.* / multi_modal_projector.* /
        language_model.model.*``, what ``save_pretrained`` writes) -> the composition's: the class
        token and the positions as CLIP's shapes, the layer scales as each block's ``scale1`` /
        ``scale2``. The blocks past the feature layer and a final LayerNorm that is not read are
        dropped (a block past ``vision_config.num_hidden_layers`` is kept, for the strict loader to
        report); so is the unused ``mask_token``."""
        out: dict[str, torch.Tensor] = {}
        for key, value in hf.items():
            k = re.sub(r"^model\.(vision_tower|multi_modal_projector)\.", r"\1.", key)
            if k.startswith("vision_tower."):
                k = k[len("vision_tower."):]
                if k == "embeddings.mask_token" or (k.startswith("layernorm.") and not self.post_norm):
                    continue
                m = re.match(r"encoder\.layer\.(\d+)\.", k)
                if m and self.depth <= int(m.group(1)) < self.num_layers:
                    continue
                for pattern, repl in _VIT_RENAMES:
                    k = re.sub(pattern, repl, k)
                if k in ("class_embedding", "position_embedding.weight"):
                    value = value.reshape(value.shape[-2:] if k.startswith("position") else value.shape[-1:])
                out["towers.vision.encoder." + k] = value
            elif k.startswith("multi_modal_projector."):
                k = k[len("multi_modal_projector."):]
                for old, new in _PROJECTOR_RENAMES.items():
                    k = new + k[len(old):] if k.startswith(old) else k
                out["towers.vision.adapter." + k] = value
            else:
                out[lm_key(key) or key] = value  # anything else is reported as unexpected by the strict loader
        return out


