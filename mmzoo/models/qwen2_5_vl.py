"""Qwen2.5-VL's own part: Qwen2-VL's, plus the window order of the patches and video positions in time.

Bai et al., 2025, "Qwen2.5-VL Technical Report" (arXiv:2502.13923). Checkpoints:
``Qwen2_5_VLForConditionalGeneration``. The modules are components (``conf/model/qwen2_5_vl.yaml``:
the ``qwen2_5_vl_vit`` encoder, the ``patch_merger`` adapter with an RMSNorm, the ``qwen2`` LM with
``mrope_section``). What the family adds to Qwen2-VL's code (:class:`~mmzoo.models.Qwen2VL`, whose
prompt expansion, placeholders, precomputed embeddings and weight names it keeps):

* window attention, prepared on the host: each item's patches are reordered window by window
  (:func:`~mmzoo.encoders.window_order`) and given their window's id (``window_ids``), so every
  attention backend serves the windowed blocks through its segment ids; the tower's output rows
  come out in window order, and each placeholder reads its own row back (:attr:`Media.rows`).
* video positions in time: temporal index ``k`` of a video sits at
  ``int(k * tokens_per_second * second_per_grid_t)``, ``second_per_grid_t`` being
  ``temporal_patch_size / fps`` as transformers' ``Qwen2_5_VLProcessor`` computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mmzoo.encoders import window_order
from mmzoo.errors import MmzooError
from mmzoo.models.family import Media
from mmzoo.models.qwen2_vl import Qwen2VL, check_vit_blocks, rope_index
from mmzoo.types import TowerInput


@dataclass
class TimedMedia(Media):
    """:class:`Media` of items with a time axis.

    Attributes:
        seconds: ``[items]`` seconds of video one temporal grid step spans (``second_per_grid_ts``);
            None for images.
    """

    seconds: np.ndarray | None = None


class Qwen2_5_VL(Qwen2VL):
    """Qwen2.5-VL: Qwen2-VL's family with a windowed vision tower and time-scaled video positions.

    Args:
        window_size: a window's side in pixels (``vision_config.window_size``): windows of
            ``window_size // (patch_size * merge_size)`` merged units a side.
        tokens_per_second: temporal rotary positions per second of video
            (``vision_config.tokens_per_second``).
        **kwargs: :class:`~mmzoo.models.Qwen2VL`'s.
    """

    hf_class = "Qwen2_5_VLForConditionalGeneration"
    tiny_checkpoint = "make_tiny_qwen2_5_vl"
    vit_width_key, merger_width_key = "hidden_size", "out_hidden_size"
    video_kwargs = {"return_metadata": True}  # each video's frame rate (second_per_grid_ts), as its processor asks

    def __init__(self, *, window_size: int, tokens_per_second: float, **kwargs):
        super().__init__(**kwargs)
        unit = self.patch_size * self.merge_size
        if window_size < unit:
            raise MmzooError(f"model.family.window_size={window_size} px is below one merged unit (patch_size="
                             f"{self.patch_size} x merge_size={self.merge_size} = {unit} px)")
        self.window = int(window_size) // unit  # transformers: window_size // spatial_merge_size // patch_size
        self.tokens_per_second = float(tokens_per_second)

    @classmethod
    def check_config(cls, config, raw: dict, source: str) -> None:
        """Qwen2-VL's checks (the merger's ``out_hidden_size`` equal to the LM's width, the ViT's
        head dim), a window of at least one merged unit, full-attention blocks that are blocks of
        the ViT, and a positive ``tokens_per_second``."""
        super().check_config(config, raw, source)
        vc = config.vision_config
        unit = vc.patch_size * vc.spatial_merge_size
        if vc.window_size < unit:
            raise MmzooError(f"{source}: vision_config.window_size={vc.window_size} is below one merged unit "
                             f"(patch_size={vc.patch_size} x spatial_merge_size={vc.spatial_merge_size} = {unit} px)")
        check_vit_blocks(vc, "fullatt_block_indexes", source)
        tps = vc.tokens_per_second
        if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not tps > 0:
            raise MmzooError(f"{source}: vision_config.tokens_per_second={tps!r} must be a positive number")

    def raw_media(self, kind: str, items: list, processor) -> Media:
        """Qwen2-VL's tower calls (one per item) with each item's patches in window order and
        their ``window_ids``; each placeholder reads its merged unit's row of the windowed output
        (``rows``). Videos carry their ``second_per_grid_ts`` from the video processor's metadata."""
        pixels, grid, out = self.process(kind, items, processor)
        media = self.item_calls(pixels, grid)
        calls, rows, start = [], [], 0
        for call, g in zip(media.calls, grid):
            call, order = self.windowed(call, g)
            calls.append(call)
            rows.append(start + np.argsort(order))  # unit j (processor order) is output row argsort(order)[j]
            start += call.num_embeds
        seconds = None
        if kind == "video":  # Qwen2_5_VLProcessor: temporal_patch_size / the sampled frame rate, per video
            frames = processor.video_processor.temporal_patch_size  # frames per temporal grid step
            seconds = np.array([frames / md.sampled_fps for md in out["video_metadata"]], np.float32)
        return TimedMedia(counts=media.counts, calls=calls, rows=np.concatenate(rows), grid=grid, seconds=seconds)

    def windowed(self, call: TowerInput, grid_thw: np.ndarray) -> tuple[TowerInput, np.ndarray]:
        """``call`` (one item of ``grid_thw [3]``, rows in processor order) with its rows in
        window order (each ``merge x merge`` block moved whole) and a ``window_ids`` input; and
        the merged units in window order (:func:`~mmzoo.encoders.window_order`)."""
        m2 = self.merge_size ** 2
        order, windows = window_order(np.asarray(grid_thw)[None], self.merge_size, self.window)
        rows = (order[:, None] * m2 + np.arange(m2)).reshape(-1)  # [units * m2] patch rows in window order
        inputs = {name: value[rows] for name, value in call.inputs.items()}
        inputs["window_ids"] = np.repeat(windows, m2)  # [units * m2]
        return replace(call, inputs=inputs, pad={**call.pad, "window_ids": -1}), order

    def precomputed(self, kind: str, embeds, layout, hidden_size: int) -> Media:
        """Qwen2-VL's (embeddings in placeholder order, as :meth:`mmzoo.Engine.encode` writes them).
        A video's embeddings are positioned as its raw frames are: mmzoo's videos are frames
        without a frame rate, for which transformers' video processor takes its default
        (``VideoMetadata.sampled_fps``, 24)."""
        media = super().precomputed(kind, embeds, layout, hidden_size)
        seconds = None
        if kind == "video":
            from transformers.video_utils import VideoMetadata

            rate = VideoMetadata(total_num_frames=1).sampled_fps
            seconds = np.full(len(media.grid), self.temporal_patch_size / rate, np.float32)
        return TimedMedia(counts=media.counts, calls=media.calls, rows=media.rows, grid=media.grid, seconds=seconds)

    def positions(self, input_ids: np.ndarray, media: dict[str, Media]) -> tuple[np.ndarray, int]:
        """Qwen2-VL's M-RoPE positions, a video's temporal index scaled by
        ``tokens_per_second * second_per_grid_t`` (float32, truncated: transformers' get_rope_index)."""
        if not self.mrope:
            return super().positions(input_ids, media)
        grids = {tok: media[kind].grid for kind, tok in (("image", self.image_token_id), ("video", self.video_token_id))
                 if kind in media}
        steps = {}
        video = media.get("video")
        if video is not None:
            steps[self.video_token_id] = np.float32(self.tokens_per_second) * np.asarray(video.seconds, np.float32)
        return rope_index(input_ids, grids, merge_size=self.merge_size, time_steps=steps)

    def dummy_media(self, rows: int) -> TowerInput:
        """Qwen2-VL's zero patches, with zero ``window_ids``."""
        call = super().dummy_media(rows)
        return replace(call, inputs={**call.inputs, "window_ids": np.zeros(rows, np.int64)},
                       pad={**call.pad, "window_ids": -1})
