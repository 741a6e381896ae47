"""SmolVLM's and Idefics3's own part: images split into tiles plus a global view, each tile framed in the prompt.

Laurençon et al., 2024, "Building and better understanding vision-language models" (Idefics3,
arXiv:2408.12637); Marafioti et al., 2025, "SmolVLM: Redefining small and efficient multimodal
models" (arXiv:2504.05299). Checkpoints: ``SmolVLMForConditionalGeneration`` (SmolVLM, SmolVLM2)
and ``Idefics3ForConditionalGeneration``; the modules are components (``conf/model/smolvlm.yaml``:
the ``siglip_vit`` encoder with bucketed positions, the ``pixel_shuffle_linear`` adapter, the
``llama`` LM).

The image processor resizes each image (longest edge to ``size``), and with image splitting cuts it
into ``rows x cols`` square tiles of the tower's ``image_size`` plus the whole image resized to one
tile (the global view); an image that fits one tile is that tile alone (``rows = cols = 0``). Each
tile is one tower item of a fixed size (like InternVL's tiles), giving ``(image_size / patch_size /
k)^2`` LM tokens after the pixel shuffle; the tiles of all the request's images go through one tower
call. In the prompt, each image's placeholder becomes the processor's own text
(``replace_image_token``): per tile ``<fake_token_around_image><row_i_col_j>`` and its tokens, a
newline per row, then ``<fake_token_around_image><global-img>``, the global view's tokens and
``<fake_token_around_image>``. Token prompts carry either that whole text's ids or one placeholder
per image (expanded to the text's ids, as vLLM does). Precomputed ``image_embeds`` come with
``image_grid_thw`` rows ``[tiles, rows, cols]`` (what ``mmzoo.encode`` writes; ``tiles = rows * cols
+ 1``; an image that was not split is ``[1, 1, 1]``).

SmolVLM2's videos: the video processor resizes every frame to one square tile, and the processor's
``replace_video_token`` writes the video as an introduction (the frame count in words, the
duration), then ``Frame from MM:SS:`` and the frame as an unsplit image per frame: the frames fill the
image placeholder token (:attr:`~mmzoo.models.Family.shared_placeholders`). ``video_embeds`` come with
``video_grid_thw`` rows ``[frames, 1, 1]``, timestamped as frames passed without a rate (24 fps).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from mmzoo.adapters.pixel_shuffle import shuffled_tokens
from mmzoo.encoders import CLIP_RENAMES, square_side
from mmzoo.errors import MmzooError
from mmzoo.models._embeds import as_grid, embeds_media
from mmzoo.models._media import load_images, load_videos
from mmzoo.models._prompt import expand_runs
from mmzoo.models.family import FramedMedia, Media, SquareItems, lm_key, unsampled_metadata
from mmzoo.types import TowerInput

VISION_TYPES = ("smolvlm_vision", "idefics3_vision")  # the towers of the two architectures (the same SigLIP)


def tiles_of(rows: int, cols: int) -> int:
    """Tower items of an image split into ``rows x cols`` tiles: those and the global view, or one tile
    for an image that was not split (the processor's ``rows = cols = 0``; a layout row ``1 x 1``:
    the processor never splits an image into one tile)."""
    return rows * cols + 1 if rows * cols > 1 else 1


class SmolVLM(SquareItems):
    """SmolVLM / Idefics3: images split into fixed-size tiles plus a global view, each through
    SigLIP and the pixel-shuffle connector.

    Args:
        name: the conf option name.
        image_token_id: the ``<image>`` placeholder token (``config.json``).
        image_size, patch_size: a tile's side and a patch's, in pixels (an int or a square pair).
        in_channels: the tiles' channels.
        scale_factor: the pixel shuffle's ``k`` (``config.json``'s ``scale_factor``).
    """

    tower = "vision"
    modalities = ("image", "video")
    shared_placeholders = {"video": "image"}  # a video's frames fill the image placeholder token
    hf_class = "SmolVLMForConditionalGeneration"
    tiny_checkpoint = "make_tiny_smolvlm"
    config_sections = ("text_config", "vision_config")

    def __init__(self, *, name: str, image_token_id: int, image_size, patch_size, in_channels: int, scale_factor: int):
        super().__init__(name=name)
        self.image_token_id = int(image_token_id)
        self.image_size, self.in_channels = square_side(image_size, "image_size"), int(in_channels)
        self.patch_size, self.scale_factor = square_side(patch_size, "patch_size"), int(scale_factor)
        self.tile_side = self.image_size // self.patch_size // self.scale_factor  # tokens per tile side
        self.tokens_per_tile = self.tokens_per_item = self.tile_side ** 2  # an item is a tile

    # -- what the checkpoint must hold -----------------------------------------------------------
    @classmethod
    def check_config(cls, config, raw: dict, source: str) -> None:
        """The base's checks and a SmolVLM / Idefics3 SigLIP tower of square tiles."""
        super().check_config(config, raw, source)
        kind = config.vision_config.model_type
        if kind not in VISION_TYPES:
            raise MmzooError(f"{source}: vision_config.model_type={kind!r}: model=smolvlm's vision tower is one of "
                             f"{list(VISION_TYPES)}")
        for key in ("image_size", "patch_size"):
            value = getattr(config.vision_config, key)
            if not isinstance(value, int) and (len(value) != 2 or value[0] != value[1]):
                raise MmzooError(f"{source}: vision_config.{key}={list(value)}: model=smolvlm takes square tiles and "
                                 f"patches (height == width)")

    def check_processor(self, processor, *, vocab_size: int, source) -> None:
        """The base's checks, and a SmolVLM / Idefics3 processor: its tile framing tokens, its
        ``image_seq_len`` equal to the tokens a tile gives, its tiles the tower's ``image_size``."""
        super().check_processor(processor, vocab_size=vocab_size, source=source)
        if not callable(getattr(processor, "replace_image_token", None)) or \
                not isinstance(getattr(processor, "fake_image_token", None), str):
            raise MmzooError(f"the processor of {source} ({type(processor).__name__}) does not frame image tiles: "
                             f"model=smolvlm takes SmolVLMProcessor or Idefics3Processor")
        self.check_item_tokens(processor, "image_seq_len", source, what="a tile",
                               why=shuffled_tokens(self.image_size, self.patch_size, self.scale_factor))
        for name in ("image_processor", "video_processor"):
            if name == "video_processor" and getattr(processor, name, None) is None:
                continue  # Idefics3's: no videos
            tile = (getattr(getattr(processor, name, None), "max_image_size", None) or {}).get("longest_edge")
            if tile != self.image_size:
                raise MmzooError(f"{source}: the {name.replace('_', ' ')}'s max_image_size.longest_edge={tile!r} (its "
                                 f"tiles' side), but the vision tower takes tiles of {self.image_size} px "
                                 f"(vision_config.image_size)")

    # -- media -----------------------------------------------------------------------------------
    def refuse(self, request) -> None:
        """The base's refusals, and images beside videos in one request: transformers' SmolVLM takes one
        or the other (its model counts a prompt's image tokens against its images' alone)."""
        super().refuse(request)
        images = request.images or request.image_embeds is not None
        if images and (request.videos or request.video_embeds is not None):
            raise MmzooError(f"model={self.name} takes images or videos in one request, not both (as transformers' "
                             f"SmolVLM: a video's frames are written with the image token)")

    def placeholder(self, kind: str, processor) -> tuple[str, int]:
        """The rendered placeholder and the image token's id; a video's is ``<video>`` (Idefics3's
        processor, which takes no videos, names none)."""
        if kind == "video":
            return getattr(processor, "video_token", "<video>"), self.image_token_id
        return super().placeholder(kind, processor)

    def expand_placeholder(self, kind: str, media: Media, item: int, processor) -> str:
        """The processor's own text for image ``item`` (``replace_image_token``): its tiles framed
        by row and column, then its global view; for video ``item`` (``replace_video_token``): the
        introduction, then each frame's timestamp and tile."""
        if kind == "video":
            # replace_video_token reads the frame count off the processor's batch, whose videos are padded to the
            # longest: a shorter video's introduction counts the longest one's frames (its own are written)
            frames = np.empty((1, int(media.grid[:, 0].max())))
            return processor.replace_video_token({"pixel_values": frames, "video_metadata": [media.metadata[item]]}, 0)
        tiles, rows, cols = (int(v) for v in media.grid[item])
        rows, cols = (rows, cols) if tiles > 1 else (0, 0)  # not split: the processor's 0 x 0
        return processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)

    def expand_token_prompt(self, kind: str, ids: np.ndarray, media: Media | None, processor) -> np.ndarray:
        """Token ids holding each image's whole text (one placeholder run per tile) pass through;
        otherwise each placeholder token stands for one image (``<image><image>`` is two, as the
        chat template writes them) and becomes the ids of its text."""
        token = self.image_token_id
        if media is None:
            return expand_runs(ids, token, [], what=kind)
        if kind == "video":  # its text is long (an introduction, a timestamp per frame): as the processor writes it
            have, want = int(np.sum(ids == token)), sum(media.counts)
            if have != want:
                raise MmzooError(f"prompt_token_ids has {have} image placeholder tokens but the {len(media.counts)} "
                                 f"videos' frames fill {want} ({media.counts}): give a video's whole text as the "
                                 f"processor writes it (or give a prompt or messages)")
            return ids
        tiles = [int(t) for t in media.grid[:, 0]]
        where = np.flatnonzero(ids == token)
        runs = np.split(where, np.flatnonzero(np.diff(where) != 1) + 1) if len(where) else []
        if [len(r) for r in runs] == [self.tokens_per_tile] * sum(tiles):
            return ids
        if len(where) != len(tiles):
            raise MmzooError(f"prompt_token_ids has {len(where)} {kind} placeholders (token id {token}) in runs of "
                             f"{[len(r) for r in runs]} but {len(tiles)} {kind}s are given: give one placeholder per "
                             f"{kind}, or each tile's run of {self.tokens_per_tile} as the processor writes them "
                             f"({sum(tiles)} tiles)")
        out, last = [], 0
        for i, at in enumerate(where):
            text = self.expand_placeholder(kind, media, i, processor)
            out += [ids[last:at], np.asarray(processor.tokenizer(text, add_special_tokens=False)["input_ids"])]
            last = at + 1
        return np.concatenate(out + [ids[last:]]).astype(np.int64)

    def raw_media(self, kind: str, items: list, processor) -> Media:
        """The checkpoint's image processor with its processor's defaults: each image's tiles and
        global view, one tower call for all the request's tiles. Videos: its video processor, each
        frame one tile (and the metadata of its timestamps), one tower call per video."""
        if kind == "video":
            return self._videos(items, processor)
        out = processor.image_processor(images=[load_images(items)], **processor.images_kwargs, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], np.float32)[0]  # [tiles, c, h, w]: one sample
        rows, cols = [int(r) for r in out["rows"][0]], [int(c) for c in out["cols"][0]]
        mask = out.get("pixel_attention_mask")
        if mask is not None and not np.asarray(mask).all():  # tiles padded to one size: never, at one tile size
            raise MmzooError("the image processor padded some tiles (pixel_attention_mask): model=smolvlm takes "
                             "whole tiles of the vision tower's image_size")
        want = (self.in_channels, self.image_size, self.image_size)
        if tuple(pixels.shape[1:]) != want:
            raise MmzooError(f"the image processor gives {list(pixels.shape[1:])} pixels per tile but the vision "
                             f"tower takes {list(want)}")
        rows, cols = [max(r, 1) for r in rows], [max(c, 1) for c in cols]  # not split (0 x 0): one tile
        tiles = [tiles_of(r, c) for r, c in zip(rows, cols)]
        if pixels.shape[0] != sum(tiles):
            raise MmzooError(f"the image processor gives {pixels.shape[0]} tiles but its rows x cols "
                             f"{list(zip(rows, cols))} imply {sum(tiles)}")
        s = self.tokens_per_tile
        call = TowerInput(tower=self.tower, inputs={"pixel_values": pixels}, num_embeds=sum(tiles) * s)
        return Media(counts=[n * s for n in tiles], calls=[call],
                     grid=np.array([[n, r, c] for n, r, c in zip(tiles, rows, cols)], np.int64))

    def _videos(self, items: list, processor) -> FramedMedia:
        if getattr(processor, "video_processor", None) is None:
            raise MmzooError(f"model={self.name}: this checkpoint's {type(processor).__name__} takes no videos "
                             f"(SmolVLM2's SmolVLMProcessor does)")
        calls, metadata, frames = [], [], []
        for i, video in enumerate(load_videos(items)):
            try:
                out = processor.video_processor(videos=[video], **processor.videos_kwargs, return_tensors="np")
            except ValueError as e:  # e.g. a processor that samples frames by rate, of frames given without one
                raise MmzooError(f"videos[{i}]: the checkpoint's video processor refuses it: {e}") from None
            pixels = np.asarray(out["pixel_values"], np.float32)[0]  # [frames, c, h, w]
            want = (self.in_channels, self.image_size, self.image_size)
            if tuple(pixels.shape[1:]) != want:
                raise MmzooError(f"videos[{i}]: the video processor gives {list(pixels.shape[1:])} pixels per frame "
                                 f"but the vision tower takes {list(want)}")
            calls.append(TowerInput(tower=self.tower, inputs={"pixel_values": pixels},
                                    num_embeds=len(pixels) * self.tokens_per_tile))
            metadata.append(out["video_metadata"][0])
            frames.append(len(pixels))
        return FramedMedia(counts=[n * self.tokens_per_tile for n in frames], calls=calls, metadata=metadata,
                           grid=np.array([[n, 1, 1] for n in frames], np.int64))

    def precomputed(self, kind: str, embeds, layout, hidden_size: int) -> Media:
        """``image_embeds [sum(tiles) * tokens_per_tile, hidden]`` with ``image_grid_thw`` rows
        ``[tiles, rows, cols]``; ``video_embeds`` with ``video_grid_thw`` rows ``[frames, 1, 1]``
        (timestamped as frames passed without a rate: :func:`~mmzoo.models.family.unsampled_metadata`)."""
        if kind == "video":
            if layout is None:
                raise MmzooError("video_embeds needs video_grid_thw ([frames, 1, 1] per video)")
            grid = as_grid(layout, "video_grid_thw")
            odd = np.flatnonzero((grid[:, 1] != 1) | (grid[:, 2] != 1))
            if len(odd):
                raise MmzooError(f"video_grid_thw[{odd[0]}] = {grid[odd[0]].tolist()}: a video's frames are one tile "
                                 f"each, [frames, 1, 1]")
            media = embeds_media(embeds, "video_embeds", hidden=hidden_size, grid=grid, tower=self.tower,
                                 counts=[int(n) * self.tokens_per_tile for n in grid[:, 0]],
                                 implied=f"frames x {self.tokens_per_tile} tokens per frame")
            return FramedMedia(counts=media.counts, calls=media.calls, grid=grid,
                               metadata=[unsampled_metadata(int(n)) for n in grid[:, 0]])
        if layout is None:
            raise MmzooError(f"image_embeds needs image_grid_thw ([tiles, rows, cols] per image: model={self.name} "
                             f"frames each image's tiles by row and column)")
        grid = as_grid(layout, "image_grid_thw")
        for i, (n, r, c) in enumerate(grid.tolist()):
            if n != tiles_of(r, c):
                raise MmzooError(f"image_grid_thw[{i}] = {[n, r, c]}: an image of rows x cols tiles has rows * cols "
                                 f"+ 1 (the global view), or is one tile ([1, 1, 1])")
        return embeds_media(embeds, "image_embeds", hidden=hidden_size, grid=grid, tower=self.tower,
                            counts=[int(n) * self.tokens_per_tile for n in grid[:, 0]],
                            implied=f"tiles x {self.tokens_per_tile} tokens per tile")

    # -- weights ---------------------------------------------------------------------------------
    def convert_weights(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' keys (``model.vision_model.* / model.connector.* / model.text_model.* /
        lm_head.*``, as ``save_pretrained`` and the hub's checkpoints write them) -> the composition's:
        SigLIP under CLIP's names, ``modality_projection.proj`` as the adapter's ``proj``."""
        out: dict[str, torch.Tensor] = {}
        for key, value in hf.items():
            if key.startswith("model.vision_model."):
                k = key[len("model.vision_model."):]
                for pattern, repl in CLIP_RENAMES:
                    k = re.sub(pattern, repl, k)
                out["towers.vision.encoder." + k] = value
            elif key.startswith("model.connector.modality_projection."):
                out["towers.vision.adapter." + key[len("model.connector.modality_projection."):]] = value
            else:
                out[lm_key(key) or key] = value  # anything else is reported as unexpected by the strict loader
        return out


