"""Qwen2-Audio's own part: the ``<|AUDIO|>`` placeholder, log-mel windows, each clip's valid tokens.

Chu et al., 2024, "Qwen2-Audio Technical Report" (arXiv:2407.10759). Checkpoints:
``Qwen2AudioForConditionalGeneration``; the modules are components (``conf/model/qwen2_audio.yaml``:
the ``whisper`` encoder pooled x2, the ``audio_projector`` adapter, the ``qwen2`` LM).

Each clip is resampled to the feature extractor's rate (16 kHz), turned into a log-mel window of
fixed length (30 s: 3000 frames; a longer clip is refused, where transformers' processor would cut
it), encoded to 1500 positions, pooled to 750 and projected; a clip of ``L`` valid mel frames fills
``((L - 1) // 2 + 1) // 2`` placeholder tokens, the rest of its rows are dropped. The tower runs
on whole clips: its input rows are clips at the fixed window, which the XLA executor pads to a
bucket of clip counts (the encoder's ``rows_per_item``); each clip's keys are masked to its valid
length, so neither padding frames nor padding clips change the result.
"""

from __future__ import annotations

import numpy as np
import torch

from mmzoo.encoders import conv_lengths
from mmzoo.errors import MmzooError
from mmzoo.models._embeds import as_embeds
from mmzoo.models._media import load_audios
from mmzoo.models.family import Family, Media, lm_key
from mmzoo.types import TowerInput

_ENCODER_RENAMES = [
    (".self_attn.out_proj.", ".attn.o_proj."),
    (".self_attn.", ".attn."),
    (".self_attn_layer_norm.", ".norm1."),
    (".final_layer_norm.", ".norm2."),
    (".fc1.", ".mlp.fc1."),
    (".fc2.", ".mlp.fc2."),
]


class Qwen2Audio(Family):
    """Qwen2-Audio: audio clips through a Whisper encoder.

    Args:
        name: the conf option name.
        audio_token_id: the ``<|AUDIO|>`` placeholder token (``config.json``).
        num_mel_bins, max_positions, pool_stride: the encoder's input window (``2 * max_positions``
            mel frames) and pooling: each clip gives ``max_positions / pool_stride`` rows.
    """

    tower = "audio"
    modalities = ("audio",)
    hf_class = "Qwen2AudioForConditionalGeneration"
    tiny_checkpoint = "make_tiny_qwen2_audio"
    config_sections = ("text_config", "audio_config")
    # tp_plan: the shared one (Family's); the projector, one linear to the LM's width, stays replicated

    def __init__(self, *, name: str, audio_token_id: int, num_mel_bins: int, max_positions: int, pool_stride: int):
        super().__init__(name=name)
        self.audio_token_id, self.num_mel_bins = int(audio_token_id), int(num_mel_bins)
        self.frames, self.pool = 2 * int(max_positions), int(pool_stride)
        self.tokens_per_clip = int(max_positions) // self.pool  # rows the tower gives per clip, valid and masked

    def audio_tokens(self, mel_frames):
        """Placeholder tokens (valid pooled rows) of a clip with ``mel_frames`` valid frames (int or array)."""
        return (conv_lengths(mel_frames) - self.pool) // self.pool + 1

    def features(self, items: list, processor) -> tuple[np.ndarray, np.ndarray]:
        """``input_features [clips, mels, frames]`` and valid mel frames ``[clips]``, from the
        checkpoint's feature extractor as Qwen2-Audio's processor calls it."""
        fe = processor.feature_extractor
        clips = load_audios(items, fe.sampling_rate)
        for i, clip in enumerate(clips):  # the extractor would cut it to its window without a word
            if clip.shape[0] > fe.n_samples:
                raise MmzooError(f"audios[{i}] is {clip.shape[0] / fe.sampling_rate:.2f} s long ({clip.shape[0]} "
                                 f"samples at {fe.sampling_rate} Hz); the audio encoder hears at most "
                                 f"{fe.n_samples / fe.sampling_rate:g} s ({fe.n_samples} samples): split it into "
                                 f"shorter clips")
        out = fe(clips, sampling_rate=fe.sampling_rate, padding="max_length", return_attention_mask=True,
                 return_tensors="np")
        feats, frames = np.asarray(out["input_features"], np.float32), np.asarray(out["attention_mask"]).sum(-1)
        if feats.shape[1:] != (self.num_mel_bins, self.frames):
            raise MmzooError(f"the feature extractor gives {list(feats.shape[1:])} features per clip but the audio "
                             f"tower takes [{self.num_mel_bins}, {self.frames}]")
        for i, (clip, n) in enumerate(zip(clips, self.audio_tokens(frames))):
            if n < 1:
                raise MmzooError(f"audios[{i}] is too short ({clip.shape[0]} samples, {int(frames[i])} mel frames) "
                                 f"to give any audio token")
        return feats, frames.astype(np.int64)

    def raw_media(self, kind: str, items: list, processor) -> Media:
        """Audio files read with librosa at the feature extractor's rate, as log-mel windows; one
        tower call for all the request's clips. Clip ``i``'s rows start at ``i * tokens_per_clip``;
        its first ``count`` are the valid ones."""
        feats, frames = self.features(items, processor)
        counts = [int(n) for n in self.audio_tokens(frames)]
        per = self.tokens_per_clip
        rows = np.concatenate([i * per + np.arange(n) for i, n in enumerate(counts)])
        call = TowerInput(tower=self.tower, inputs={"features": feats, "lengths": frames},
                          num_embeds=len(counts) * per, pad={"lengths": feats.shape[-1]})
        return Media(counts=counts, calls=[call], rows=rows)

    def precomputed(self, kind: str, embeds, layout, hidden_size: int) -> Media:
        """``audio_embeds``: one 2-D ``[tokens, hidden]`` per clip (a list), or one 2-D split by
        ``audio_lengths`` (one clip without it)."""
        if isinstance(embeds, (list, tuple)):
            if layout is not None:
                raise MmzooError("audio_lengths splits a 2-D audio_embeds; give one or the other, not a list too")
            parts = [as_embeds(p, f"audio_embeds[{i}]", hidden=hidden_size) for i, p in enumerate(embeds)]
        else:
            parts = split_rows(as_embeds(embeds, "audio_embeds", hidden=hidden_size), layout)
        if not parts:
            raise MmzooError("audio_embeds is an empty list")
        for i, e in enumerate(parts):
            if e.shape[0] == 0:
                raise MmzooError(f"audio_embeds[{i}] has no rows")
        emb = torch.cat([e.to(parts[0].dtype) for e in parts])
        return Media(counts=[int(e.shape[0]) for e in parts],
                     calls=[TowerInput(tower=self.tower, inputs={}, num_embeds=emb.shape[0], embeds=emb)])

    def convert_weights(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' keys (v5 ``model.audio_tower.* / model.multi_modal_projector.* /
        model.language_model.*`` or the hub's ``audio_tower.* / multi_modal_projector.* /
        language_model.model.*``) -> the composition's; Whisper's missing key-projection bias is
        added as zeros."""
        out: dict[str, torch.Tensor] = {}
        for key, value in hf.items():
            k = key[len("model."):] if key.startswith(("model.audio_tower.", "model.multi_modal_projector.")) else key
            if k.startswith("audio_tower."):
                k = k[len("audio_tower."):]
                if k.startswith("layers."):
                    k = "blocks." + k[len("layers."):]
                    for old, new in _ENCODER_RENAMES:
                        k = k.replace(old, new)
                elif k.startswith("layer_norm."):
                    k = "norm." + k[len("layer_norm."):]
                out["towers.audio.encoder." + k] = value
                if k.endswith(".attn.k_proj.weight"):
                    out.setdefault("towers.audio.encoder." + k[:-len("weight")] + "bias",
                                   torch.zeros(value.shape[0], dtype=value.dtype))
            elif k.startswith("multi_modal_projector."):
                out["towers.audio.adapter." + k[len("multi_modal_projector."):]] = value
            else:
                out[lm_key(key) or key] = value  # anything else is reported as unexpected by the strict loader
        return out

    def dummy_media(self, rows: int) -> TowerInput:
        """``rows`` silent full-length clips."""
        return TowerInput(tower=self.tower,
                          inputs={"features": np.zeros((rows, self.num_mel_bins, self.frames), np.float32),
                                  "lengths": np.full(rows, self.frames, np.int64)},
                          num_embeds=rows * self.tokens_per_clip, pad={"lengths": self.frames})


def split_rows(embeds: torch.Tensor, lengths) -> list[torch.Tensor]:
    """A 2-D ``audio_embeds`` as one clip, or split into clips of ``audio_lengths`` rows each."""
    if lengths is None:
        return [embeds]
    arr = lengths.numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or (arr < 1).any():
        raise MmzooError(f"audio_lengths must be a 1-D list of positive integers, got {arr.tolist()}")
    if int(arr.sum()) != embeds.shape[0]:
        raise MmzooError(f"audio_lengths {arr.tolist()} sum to {int(arr.sum())} rows but audio_embeds has "
                         f"{embeds.shape[0]}")
    return list(torch.split(embeds, [int(n) for n in arr]))
