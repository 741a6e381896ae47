"""Llava: CLIP ViT + two-layer MLP projector + Llama decoder, image tokens by placeholder.

Liu et al., 2023, "Visual Instruction Tuning" (arXiv:2304.08485) and "Improved Baselines with
Visual Instruction Tuning" (LLaVA-1.5, arXiv:2310.03744). Checkpoints:
``LlavaForConditionalGeneration``. Every image is resized and cropped to the ViT's fixed size, so
each one gives the same number of LM tokens (576 for LLaVA-1.5's 336 px, patch 14).

The tower runs on whole images: its input rows are images, which the XLA executor pads to a
bucket of image counts (:meth:`Llava.encoder_buckets`); images never attend to each other, so the
padding images change nothing and their rows are never read.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from mmzoo._paths import cached_default
from mmzoo.adapters import mlp_projector
from mmzoo.encoders import ClipVisionEncoder, resolve_feature_layers
from mmzoo.errors import MmzooError
from mmzoo.executor._buckets import doubling
from mmzoo.layers import rope_1d
from mmzoo.lms import DecoderLM
from mmzoo.models._embeds import as_embeds
from mmzoo.models._media import load_images
from mmzoo.models._prompt import expand_runs, prepare_inputs_embeds, refuse, render_prompt
from mmzoo.models._types import Prepared, Request, TowerInput
from mmzoo.models.composition import MultimodalLM, Tower


# ---------------------------------------------------------------- component builders

def clip_vision_tower(*, image_size: int, patch_size: int, in_channels: int, embed_dim: int, num_layers: int,
                      num_heads: int, intermediate_dim: int, act: str, feature_layer: int | list[int],
                      keep_cls: bool, out_dim: int, projector_act: str, projector_bias: bool, attn_fn,
                      norm_eps: float = 1e-5) -> Tower:
    """CLIP ViT (only the blocks up to the deepest ``feature_layer``) + Llava's MLP projector."""
    layers = resolve_feature_layers(feature_layer, num_layers)
    encoder = ClipVisionEncoder(image_size=image_size, patch_size=patch_size, in_channels=in_channels,
                                embed_dim=embed_dim, depth=max(layers), num_heads=num_heads,
                                intermediate_dim=intermediate_dim, act=act, feature_layers=layers,
                                keep_cls=keep_cls, attn_fn=attn_fn, norm_eps=norm_eps)
    adapter = mlp_projector(in_dim=encoder.out_dim, out_dim=out_dim, act=projector_act, bias=projector_bias)
    return Tower(encoder=encoder, adapter=adapter)


def llama_lm(*, vocab_size: int, dim: int, num_layers: int, num_heads: int, num_kv_heads: int,
             intermediate_dim: int, rope_theta: float, norm_eps: float, attn_fn, act: str = "silu",
             tie_word_embeddings: bool = False, head_dim: int | None = None) -> DecoderLM:
    """The Llama decoder: no q/k/v bias, RMSNorm, SwiGLU, 1-D RoPE."""
    head_dim = head_dim or dim // num_heads
    return DecoderLM(vocab_size=vocab_size, dim=dim, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_dim=intermediate_dim,
                     rotary=rope_1d(head_dim, rope_theta), attn_fn=attn_fn, qkv_bias=False, norm_eps=norm_eps,
                     act=act, tie_word_embeddings=tie_word_embeddings)


def rope_theta_1d(text_config, default: float) -> float:
    """``rope_theta`` of a plain-RoPE text config; scaled RoPE variants are refused, not ignored."""
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise MmzooError(f"config.json: text_config rope_type={kind!r} is not supported (only plain RoPE)")
    return float(rope.get("rope_theta", getattr(text_config, "rope_theta", default)))


_LM_RENAMES = [(r"\.self_attn\.", ".attn."), (r"\.input_layernorm\.", ".norm1."),
               (r"\.post_attention_layernorm\.", ".norm2.")]


def lm_key(key: str) -> str | None:
    """mmzoo's name for a language-model key of a ``*ForConditionalGeneration`` checkpoint (transformers
    5's ``model.language_model.* / lm_head.*`` or the hub's ``language_model.model.* /
    language_model.lm_head.*``), or None if it is not one."""
    for prefix, repl in (("model.language_model.", "lm."), ("language_model.model.", "lm."),
                         ("language_model.lm_head.", "lm.lm_head."), ("lm_head.", "lm.lm_head.")):
        if key.startswith(prefix):
            new = repl + key[len(prefix):]
            for pattern, sub in _LM_RENAMES:
                new = re.sub(pattern, sub, new)
            return new
    return None


# ---------------------------------------------------------------- the family

_VIT_RENAMES = [
    (r"^embeddings\.patch_embedding\.", "patch_embed."),
    (r"^embeddings\.class_embedding$", "class_embedding"),
    (r"^embeddings\.position_embedding\.", "position_embedding."),
    (r"^pre_layrnorm\.", "pre_norm."),
    (r"^encoder\.layers\.", "blocks."),
    (r"\.self_attn\.out_proj\.", ".attn.o_proj."),
    (r"\.self_attn\.", ".attn."),
    (r"\.layer_norm1\.", ".norm1."),
    (r"\.layer_norm2\.", ".norm2."),
]


class Llava:
    """The Llava family: builds the modules from a ``LlavaConfig``, maps weights, prepares requests."""

    name = "llava"
    architectures = ("LlavaForConditionalGeneration",)
    towers = ("vision",)

    def default_checkpoint(self) -> Path:
        from mmzoo.testing_zoo import make_tiny_llava

        return cached_default("llava-random-v1", self.name, make_tiny_llava)

    @staticmethod
    def tokens_per_image(config) -> int:
        vc = config.vision_config
        return (vc.image_size // vc.patch_size) ** 2 + int(config.vision_feature_select_strategy == "full")

    def build(self, config, attn_fn) -> MultimodalLM:
        """Modules sized by a ``LlavaConfig`` (random weights until loaded)."""
        tc, vc = config.text_config, config.vision_config
        if getattr(tc, "attention_bias", False) or getattr(tc, "mlp_bias", False):
            raise MmzooError("config.json: text_config attention_bias/mlp_bias=true is not supported (Llama has none)")
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise MmzooError(f"config.json: vision_feature_select_strategy={config.vision_feature_select_strategy!r}; "
                             f"expected 'default' or 'full'")
        for name in ("image_size", "patch_size"):
            if not isinstance(getattr(vc, name), int):
                raise MmzooError(f"config.json: vision_config.{name}={getattr(vc, name)!r}; only square sizes are supported")
        lm = llama_lm(vocab_size=tc.vocab_size, dim=tc.hidden_size, num_layers=tc.num_hidden_layers,
                      num_heads=tc.num_attention_heads, num_kv_heads=tc.num_key_value_heads,
                      intermediate_dim=tc.intermediate_size, rope_theta=rope_theta_1d(tc, 10000.0),
                      norm_eps=tc.rms_norm_eps, attn_fn=attn_fn, act=tc.hidden_act,
                      tie_word_embeddings=bool(config.tie_word_embeddings), head_dim=getattr(tc, "head_dim", None))
        try:
            vision = clip_vision_tower(
                image_size=vc.image_size, patch_size=vc.patch_size, in_channels=vc.num_channels,
                embed_dim=vc.hidden_size, num_layers=vc.num_hidden_layers, num_heads=vc.num_attention_heads,
                intermediate_dim=vc.intermediate_size, act=vc.hidden_act, feature_layer=config.vision_feature_layer,
                keep_cls=config.vision_feature_select_strategy == "full", out_dim=tc.hidden_size,
                projector_act=config.projector_hidden_act, projector_bias=bool(config.multimodal_projector_bias),
                attn_fn=attn_fn, norm_eps=vc.layer_norm_eps)
        except ValueError as e:
            raise MmzooError(f"config.json: {e}") from None
        return MultimodalLM(lm=lm, towers={"vision": vision})

    def convert_weights(self, hf: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """Map transformers' keys (v5 ``model.vision_tower.* / model.multi_modal_projector.* /
        model.language_model.*`` or the hub's ``vision_tower.vision_model.* / multi_modal_projector.* /
        language_model.model.*``) onto mmzoo's names. CLIP's ``post_layernorm`` and the blocks past
        the deepest feature layer are not part of Llava's computation and are dropped."""
        depth = max(resolve_feature_layers(config.vision_feature_layer, config.vision_config.num_hidden_layers))
        out: dict[str, torch.Tensor] = {}
        for key, value in hf.items():
            k = re.sub(r"^model\.(vision_tower|multi_modal_projector)\.", r"\1.", key)
            if k.startswith("vision_tower."):
                k = k[len("vision_tower."):]
                k = k[len("vision_model."):] if k.startswith("vision_model.") else k
                if k.startswith("post_layernorm."):
                    continue
                m = re.match(r"encoder\.layers\.(\d+)\.", k)
                if m and int(m.group(1)) >= depth:
                    continue
                for pattern, repl in _VIT_RENAMES:
                    k = re.sub(pattern, repl, k)
                out["towers.vision.encoder." + k] = value
            elif k.startswith("multi_modal_projector."):
                k = k[len("multi_modal_projector."):].replace("linear_1.", "fc1.").replace("linear_2.", "fc2.")
                out["towers.vision.adapter." + k] = value
            else:
                out[lm_key(key) or key] = value  # anything else is reported as unexpected by the strict loader
        if config.tie_word_embeddings:
            out.pop("lm.lm_head.weight", None)
        return out

    def encoder_buckets(self, config, *, max_model_len: int, max_media_rows: int) -> dict[str, list[int]]:
        """XLA buckets of the vision tower, in images per call (the executor's own buckets count input
        rows of a packed tower): doubling up to as many images as a ``max_model_len`` prompt holds,
        and as the executor's media buffer of ``max_media_rows`` embeddings takes."""
        return {"vision": doubling(1, max(1, min(max_model_len, max_media_rows) // self.tokens_per_image(config)))}

    def dummy_media(self, config, tower: str, rows: int) -> TowerInput:
        """``rows`` blank images, for compiling the tower at that bucket."""
        vc = config.vision_config
        pixels = np.zeros((rows, vc.num_channels, vc.image_size, vc.image_size), np.float32)
        return TowerInput(tower=tower, inputs={"pixel_values": pixels}, num_embeds=rows * self.tokens_per_image(config))

    def prepare(self, processor, config, request: Request) -> Prepared:
        """One request -> token ids, 1-D positions and the images to encode (or their embeddings).

        Raw images go through the checkpoint's image processor (resize, center crop, normalize);
        ``image_embeds`` (``[images * tokens_per_image, hidden]``, or a list of 2-D) skip the tower;
        ``inputs_embeds`` replaces the whole prompt. The chat template renders one user turn (the
        images, then the text) unless ``prompt_token_ids`` is given; each ``<image>`` becomes
        ``tokens_per_image`` placeholder tokens, as the processor does.
        """
        tc = config.text_config
        refuse(request, self.name, ("videos", "audios", "video_embeds", "video_grid_thw", "audio_embeds",
                                    "audio_lengths", "image_grid_thw"))
        if request.inputs_embeds is not None:
            return prepare_inputs_embeds(request, hidden=tc.hidden_size)
        per = self.tokens_per_image(config)
        pixels = emb = None
        if request.image_embeds is not None:
            if request.images:
                raise MmzooError("give images or image_embeds, not both")
            emb = as_embeds(request.image_embeds, "image_embeds", hidden=tc.hidden_size)
            if emb.shape[0] % per:
                raise MmzooError(f"image_embeds has {emb.shape[0]} rows, not a multiple of the {per} tokens per image "
                                 f"[images * {per}, {tc.hidden_size}]")
            n_images = emb.shape[0] // per
        elif request.images:
            pixels = processor.image_processor(images=load_images(request.images), return_tensors="np")["pixel_values"]
            side = config.vision_config.image_size
            if tuple(pixels.shape[1:]) != (config.vision_config.num_channels, side, side):
                raise MmzooError(f"the image processor gives {list(pixels.shape[1:])} pixels but the vision tower takes "
                                 f"[{config.vision_config.num_channels}, {side}, {side}]")
            n_images = pixels.shape[0]
        else:
            n_images = 0
        token = int(config.image_token_id)
        if request.prompt_token_ids is not None:
            input_ids = expand_runs(np.asarray(request.prompt_token_ids, dtype=np.int64), token, [per] * n_images,
                                    what="image")
        else:
            input_ids = render_prompt(processor, request, ["image"], {"image": (processor.image_token, [per] * n_images)})
        where = np.flatnonzero(input_ids == token)
        if len(where) != n_images * per:
            raise MmzooError(f"prompt has {len(where)} image placeholder tokens but {n_images} images need "
                             f"{n_images * per} ({per} each)")
        mm_index = np.full(len(input_ids), -1, np.int64)
        mm_index[where] = np.arange(len(where))
        media = []
        if emb is not None and n_images:
            media = [TowerInput(tower="vision", inputs={}, num_embeds=n_images * per, embeds=emb)]
        elif n_images:
            media = [TowerInput(tower="vision", inputs={"pixel_values": np.asarray(pixels, np.float32)},
                                num_embeds=n_images * per)]
        return Prepared(request=request, input_ids=input_ids, positions=np.arange(len(input_ids))[None],
                        position_delta=0, mm_index=mm_index, media=media)
