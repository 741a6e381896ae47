"""Qwen3-VL's own part: Qwen2-VL's, plus the position grid's taps, DeepStack rows and timestamped video frames.

Qwen Team, 2025, "Qwen3-VL Technical Report" (arXiv:2511.21631). Checkpoints:
``Qwen3VLForConditionalGeneration``. The modules are components (``conf/model/qwen3_vl.yaml``: the
``qwen3_vl_vit`` encoder, the ``patch_merger`` adapter with post-shuffle norms and a DeepStack
merger per tap, the ``qwen3`` LM with interleaved M-RoPE). What the family adds to Qwen2-VL's code
(:class:`~mmzoo.models.Qwen2VL`, whose per-item tower calls, placeholders and weight layout
checks it keeps):

* each patch's four taps into the learned position grid and their bilinear weights, computed on
  the host (:func:`~mmzoo.encoders.pos_interpolation`) and fed beside the patches;
* DeepStack: the tower's rows are ``(1 + k) * dim`` wide (the main embedding, then the ``k``
  DeepStack levels); :class:`~mmzoo.models.MultimodalLM` adds level ``j`` to the LM's hidden
  states after layer ``j`` at the placeholder positions (:attr:`Qwen3VL.deepstack_levels`), so
  precomputed ``image_embeds`` / ``video_embeds`` carry all ``1 + k`` parts per row (vLLM's layout);
* videos: every temporal step (two frames) is written as ``<t seconds>`` then its own
  ``<|vision_start|>`` ... ``<|vision_end|>`` run (the processor's ``replace_video_token``), and
  each step is positioned as a one-frame image (transformers' ``get_rope_index`` splits the video
  grid the same way); ``video_embeds`` come with ``video_timestamps`` (each step's seconds), which
  ``mmzoo.encode`` writes, so a video's embeddings give its raw frames' prompt.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import ClassVar

import numpy as np
import torch

from mmzoo.encoders import pos_interpolation, qwen3_vl_vision_weights
from mmzoo.errors import MmzooError
from mmzoo.models.family import FramedMedia, Media, extend_tp_plan, lm_key, unsampled_metadata
from mmzoo.models.qwen2_vl import Qwen2VL, check_vit_blocks, rope_index
from mmzoo.types import TowerInput


class Qwen3VL(Qwen2VL):
    """Qwen3-VL: Qwen2-VL's family with a learned position grid, DeepStack and timestamped videos.

    Args:
        num_position_embeddings: rows of the ViT's learned position grid (a square:
            ``vision_config.num_position_embeddings``).
        deepstack_levels: how many DeepStack feature levels each tower row carries after the main
            embedding (``len(vision_config.deepstack_visual_indexes)``).
        **kwargs: :class:`~mmzoo.models.Qwen2VL`'s.
    """

    hf_class = "Qwen3VLForConditionalGeneration"
    tiny_checkpoint = "make_tiny_qwen3_vl"
    vit_width_key, merger_width_key = "hidden_size", "out_hidden_size"
    video_kwargs: ClassVar[dict] = {"return_metadata": True}  # the frame indices and rate: the timestamps
    layout_extras = ("video_timestamps",)  # video_embeds' timestamps (mmzoo.encode writes them)
    # each DeepStack merger's two linears, Megatron's pair like the main merger's
    tp_plan = extend_tp_plan({"towers.*.adapter.deepstack.*.mlp.0.*": "colwise",
                              "towers.*.adapter.deepstack.*.mlp.2.*": "rowwise"}, Qwen2VL.tp_plan)

    def __init__(self, *, num_position_embeddings: int, deepstack_levels: int, **kwargs):
        super().__init__(**kwargs)
        side = math.isqrt(int(num_position_embeddings))
        if side * side != num_position_embeddings or side < 1:
            raise MmzooError(f"model.family.num_position_embeddings={num_position_embeddings} is not a square grid")
        self.position_side = side
        self._deepstack_levels = int(deepstack_levels)

    @property
    def deepstack_levels(self) -> int:
        return self._deepstack_levels

    @classmethod
    def check_config(cls, config, raw: dict, source: str) -> None:
        """Qwen2-VL's checks (the mergers' ``out_hidden_size`` equal to the LM's width, the ViT's
        head dim), a square position grid, DeepStack taps that are blocks of the ViT, and the text
        model's interleaved M-RoPE sections."""
        super().check_config(config, raw, source)
        vc = config.vision_config
        n = vc.num_position_embeddings
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or math.isqrt(n) ** 2 != n:
            raise MmzooError(f"{source}: vision_config.num_position_embeddings={n!r} must be a square number (the "
                             f"learned position grid is side x side)")
        taps = check_vit_blocks(vc, "deepstack_visual_indexes", source)
        if len(taps) > config.get_text_config().num_hidden_layers:
            raise MmzooError(f"{source}: {len(taps)} DeepStack levels (vision_config.deepstack_visual_indexes) but the "
                             f"text model has {config.get_text_config().num_hidden_layers} layers to add them to")

    # -- media ---------------------------------------------------------------------------------
    def raw_media(self, kind: str, items: list, processor) -> Media:
        """Qwen2-VL's tower calls (one per item) with each patch's position-grid taps; videos keep
        the processor's metadata for their timestamps."""
        pixels, grid, out = self.process(kind, items, processor)
        media = self.item_calls(pixels, grid)
        if kind != "video":
            return FramedMedia(counts=media.counts, calls=media.calls, grid=grid)
        metadata = list(out["video_metadata"])
        steps = np.concatenate([self.step_seconds(m) for m in metadata])  # float64, as the prompt's text is made
        return FramedMedia(counts=media.counts, calls=media.calls, grid=grid, metadata=metadata,
                           extras={"video_timestamps": steps})

    def step_seconds(self, metadata) -> np.ndarray:
        """A video's temporal steps' timestamps, as its processor writes them: the mean time of each
        step's frames (the kept frames' indices over the rate, 24 fps when the video has none; the last
        frame repeated to fill the last step)."""
        fps = 24.0 if metadata.fps is None else float(metadata.fps)
        frames = [float(i) for i in np.asarray(metadata.frames_indices).reshape(-1)]
        k = self.temporal_patch_size
        frames += frames[-1:] * (-len(frames) % k)
        seconds = [i / fps for i in frames]
        return np.array([(seconds[i] + seconds[i + k - 1]) / 2 for i in range(0, len(seconds), k)])

    def item_calls(self, pixels: np.ndarray, grid: np.ndarray) -> Media:
        media = super().item_calls(pixels, grid)
        calls = []
        for call, g in zip(media.calls, grid):
            index, weight = pos_interpolation(g[None], self.position_side, self.merge_size)
            calls.append(replace(call, inputs={**call.inputs, "interp_indices": index, "interp_weights": weight},
                                 float32=frozenset({"interp_weights"})))
        return replace(media, calls=calls)

    def precomputed(self, kind: str, embeds, layout, hidden_size: int, video_timestamps=None) -> Media:
        """Qwen2-VL's, with rows ``(1 + deepstack_levels) * hidden_size`` wide (the main embedding
        and each DeepStack level, as :meth:`mmzoo.Engine.encode` writes them). A video's timestamps
        are ``video_timestamps`` (one per temporal step, as ``mmzoo.encode`` writes them from the
        processor's metadata); without them, those of ``2 t`` frames kept whole at 24 fps (what
        transformers' video processor gives frames passed without a rate), the raw video's own only
        for one the processor did not sample (up to 4 frames)."""
        width = hidden_size * (1 + self.deepstack_levels)
        for i, part in enumerate(embeds if isinstance(embeds, (list, tuple)) else [embeds]):
            shape = getattr(part, "shape", None)
            if shape is not None and len(shape) == 2 and shape[1] != width:
                name = f"{kind}_embeds" + (f"[{i}]" if isinstance(embeds, (list, tuple)) else "")
                raise MmzooError(f"{name} has {shape[1]} columns but Qwen3-VL's {kind} rows are {width} wide: the "
                                 f"LM's hidden size {hidden_size} for the embedding, then as many for each of its "
                                 f"{self.deepstack_levels} DeepStack levels (mmzoo.encode writes them so)")
        media = super().precomputed(kind, embeds, layout, width)
        if kind != "video":
            return FramedMedia(counts=media.counts, calls=media.calls, grid=media.grid)
        steps = [int(t) for t in media.grid[:, 0]]
        if video_timestamps is None:
            metadata = [unsampled_metadata(t * self.temporal_patch_size) for t in steps]
            return FramedMedia(counts=media.counts, calls=media.calls, grid=media.grid, metadata=metadata)
        from transformers.video_utils import VideoMetadata

        seconds = as_seconds(video_timestamps, sum(steps))
        # each step's frames all at its time: the processor's mean of them is that time
        k, metadata, at = self.temporal_patch_size, [], 0
        for t in steps:
            metadata.append(VideoMetadata(total_num_frames=t * k, fps=1.0,
                                          frames_indices=np.repeat(seconds[at:at + t], k)))
            at += t
        return FramedMedia(counts=media.counts, calls=media.calls, grid=media.grid, metadata=metadata,
                           extras={"video_timestamps": seconds})

    def expand_placeholder(self, kind: str, media: Media, item: int, processor) -> str:
        """An image: its run of placeholders. A video: the processor's ``replace_video_token``, each
        temporal step as ``<t seconds>`` and a bracketed run of its placeholders."""
        if kind != "video":
            return super().expand_placeholder(kind, media, item, processor)
        return processor.replace_video_token({"video_grid_thw": media.grid, "video_metadata": media.metadata}, item)

    def expand_token_prompt(self, kind: str, ids: np.ndarray, media: Media | None, processor) -> np.ndarray:
        """Images as Qwen2-VL's; a video's placeholders are runs split by the timestamp text, so a token
        prompt must already hold them as the processor writes them (refused otherwise, by count)."""
        if kind != "video" or media is None:
            return super().expand_token_prompt(kind, ids, media, processor)
        want = sum(media.counts)
        have = int(np.sum(ids == self.video_token_id))
        if have != want:
            raise MmzooError(f"prompt_token_ids has {have} video placeholder tokens but the {len(media.counts)} videos "
                             f"give {want} ({media.counts}); Qwen3-VL writes each temporal step of a video as "
                             f"'<t seconds>' and its own run of placeholders, so give the prompt with them expanded "
                             f"(or give a prompt or messages)")
        return ids

    def positions(self, input_ids: np.ndarray, media: dict[str, Media]) -> tuple[np.ndarray, int]:
        """Qwen2-VL's M-RoPE positions with each video split into one-frame grids: its temporal
        steps are separate runs (timestamps between them), each positioned as an image."""
        if not self.mrope:
            return super().positions(input_ids, media)
        grids = {}
        if "image" in media:
            grids[self.image_token_id] = media["image"].grid
        if "video" in media:
            g = np.asarray(media["video"].grid)
            frames = np.repeat(g, g[:, 0], axis=0)
            frames[:, 0] = 1
            grids[self.video_token_id] = frames
        return rope_index(input_ids, grids, merge_size=self.merge_size)

    # -- weights and warmup ------------------------------------------------------------------------
    def convert_weights(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' keys (``model.visual.* / model.language_model.* / lm_head.*``) -> the
        composition's (:func:`~mmzoo.encoders.qwen3_vl_vision_weights` for the tower)."""
        vision = {key.split("visual.", 1)[1]: value for key, value in hf.items()
                  if key.startswith(("model.visual.", "visual."))}
        out = {f"towers.{self.tower}.{key}": value for key, value in qwen3_vl_vision_weights(vision).items()}
        for key, value in hf.items():
            if key.startswith(("model.visual.", "visual.")):
                continue
            out[lm_key(key) or key] = value  # an unknown key is reported as unexpected by the strict loader
        return out

    def dummy_media(self, rows: int) -> TowerInput:
        """Qwen2-VL's zero patches, with zero position-grid taps and weights."""
        call = super().dummy_media(rows)
        return replace(call, inputs={**call.inputs, "interp_indices": np.zeros((rows, 4), np.int64),
                                     "interp_weights": np.zeros((rows, 4), np.float32)},
                       float32=frozenset({"interp_weights"}))


def as_seconds(value, steps: int) -> np.ndarray:
    """``video_timestamps``: ``[steps]`` finite seconds >= 0 (each video's temporal steps in order), float64
    (the prompt writes them to a tenth of a second, as the processor does from its own float64 values)."""
    try:
        seconds = np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as e:
        raise MmzooError(f"video_timestamps is not an array of seconds ({e})") from None
    if seconds.shape[0] != steps:
        raise MmzooError(f"video_timestamps has {seconds.shape[0]} entries but video_grid_thw gives {steps} temporal "
                         f"steps (one timestamp per step)")
    if not np.all(np.isfinite(seconds)) or (seconds < 0).any():
        raise MmzooError(f"video_timestamps must be finite seconds >= 0, got {seconds.tolist()}"[:300])
    return seconds
