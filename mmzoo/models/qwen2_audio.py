"""Qwen2-Audio: Whisper-style audio encoder (pooled x2) + linear projector + Qwen2 decoder.

Chu et al., 2024, "Qwen2-Audio Technical Report" (arXiv:2407.10759). Checkpoints:
``Qwen2AudioForConditionalGeneration``. Each clip is resampled to the feature extractor's rate
(16 kHz), turned into a log-mel window of fixed length (30 s: 3000 frames; longer clips are cut),
encoded to 1500 positions, pooled to 750 and projected; a clip of ``L`` valid mel frames fills
``((L - 1) // 2 + 1) // 2`` placeholder tokens (``<|AUDIO|>``), the rest of its rows are dropped.

The tower runs on whole clips: its input rows are clips at the fixed window, which the XLA
executor pads to a bucket of clip counts (:meth:`Qwen2Audio.encoder_buckets`); each clip's keys
are masked to its valid length, so neither padding frames nor padding clips change the result.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmzoo.adapters import AudioProjector
from mmzoo.encoders import WhisperEncoder, conv_lengths
from mmzoo.errors import MmzooError
from mmzoo.executor._buckets import doubling
from mmzoo.models._embeds import as_embeds
from mmzoo.models._types import Prepared, Request, TowerInput
from mmzoo.models.composition import MultimodalLM, Tower
from mmzoo._paths import cached_default
from mmzoo.models._prompt import expand_runs, prepare_inputs_embeds, refuse, render_prompt
from mmzoo.models.llava import lm_key, rope_theta_1d
from mmzoo.models.qwen2_vl import qwen2_lm

POOL = 2  # Qwen2-Audio's average pooling (kernel 2, stride 2)
MAX_CLIPS_PER_CALL = 16  # the largest default XLA bucket of clips (executor.encoder_buckets.audio for more)


# ---------------------------------------------------------------- component builders

def qwen2_audio_tower(*, num_mel_bins: int, embed_dim: int, depth: int, num_heads: int, ffn_dim: int, act: str,
                      max_positions: int, out_dim: int, attn_fn) -> Tower:
    """Whisper encoder with Qwen2-Audio's pooling before its final norm, then the linear projector."""
    encoder = WhisperEncoder(num_mel_bins=num_mel_bins, embed_dim=embed_dim, depth=depth, num_heads=num_heads,
                             ffn_dim=ffn_dim, act=act, max_positions=max_positions, attn_fn=attn_fn, pool_stride=POOL)
    return Tower(encoder=encoder, adapter=AudioProjector(in_dim=embed_dim, out_dim=out_dim))


def audio_tokens(mel_frames):
    """Placeholder tokens (valid pooled rows) of a clip with ``mel_frames`` valid frames (int or array)."""
    return (conv_lengths(mel_frames) - POOL) // POOL + 1


# ---------------------------------------------------------------- audio files

def load_audios(items: list[Any], sampling_rate: int, field: str = "audios") -> list[np.ndarray]:
    """Mono float32 clips at ``sampling_rate``: files are read and resampled with librosa; 1-D arrays
    are taken as already at that rate. Errors name the item."""
    import librosa

    clips = []
    for i, item in enumerate(items or []):
        name = f"{field}[{i}]"
        if isinstance(item, (np.ndarray, torch.Tensor)):
            clip = np.asarray(item.cpu() if isinstance(item, torch.Tensor) else item)
            if clip.ndim != 1 or clip.dtype.kind != "f":
                raise MmzooError(f"{name}: an audio array must be 1-D float samples at {sampling_rate} Hz, "
                                 f"got {clip.dtype} {list(clip.shape)}")
            where = "the array"
        else:
            path = Path(str(item))
            if not path.exists():
                raise MmzooError(f"{name}: audio file {path} does not exist")
            if not path.is_file():
                raise MmzooError(f"{name}: {path} is not a file")
            try:
                with warnings.catch_warnings():  # librosa warns before its fallback decoder; the error says it all
                    warnings.simplefilter("ignore")
                    clip, _ = librosa.load(str(path), sr=sampling_rate, mono=True)
            except Exception as e:  # soundfile, audioread and resampling errors have no common base
                raise MmzooError(f"{name}: {path} is not a readable audio file ({e.__class__.__name__})") from None
            where = str(path)
        if clip.size == 0:
            raise MmzooError(f"{name}: {where} is empty (no samples)")
        if not np.all(np.isfinite(clip)):
            raise MmzooError(f"{name}: {where} has non-finite samples")
        clips.append(clip.astype(np.float32))
    return clips


# ---------------------------------------------------------------- the family

_ENCODER_RENAMES = [
    (".self_attn.out_proj.", ".attn.o_proj."),
    (".self_attn.", ".attn."),
    (".self_attn_layer_norm.", ".norm1."),
    (".final_layer_norm.", ".norm2."),
    (".fc1.", ".mlp.fc1."),
    (".fc2.", ".mlp.fc2."),
]


class Qwen2Audio:
    """The Qwen2-Audio family: builds the modules from a ``Qwen2AudioConfig``, maps weights, prepares requests."""

    name = "qwen2_audio"
    architectures = ("Qwen2AudioForConditionalGeneration",)
    towers = ("audio",)

    def default_checkpoint(self) -> Path:
        from mmzoo.testing_zoo import make_tiny_qwen2_audio

        return cached_default("qwen2_audio-random-v1", self.name, make_tiny_qwen2_audio)

    @staticmethod
    def tokens_per_clip(config) -> int:
        """Rows the tower gives per clip (valid and masked)."""
        return config.audio_config.max_source_positions // POOL

    def build(self, config, attn_fn) -> MultimodalLM:
        """Modules sized by a ``Qwen2AudioConfig`` (random weights until loaded)."""
        tc, ac = config.text_config, config.audio_config
        if getattr(tc, "use_sliding_window", False):
            raise MmzooError("config.json: text_config use_sliding_window=true is not supported")
        lm = qwen2_lm(vocab_size=tc.vocab_size, dim=tc.hidden_size, num_layers=tc.num_hidden_layers,
                      num_heads=tc.num_attention_heads, num_kv_heads=tc.num_key_value_heads,
                      intermediate_dim=tc.intermediate_size, rope_theta=rope_theta_1d(tc, 1e6), mrope_section=None,
                      norm_eps=tc.rms_norm_eps, attn_fn=attn_fn, act=tc.hidden_act,
                      tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                      head_dim=getattr(tc, "head_dim", None))
        try:
            audio = qwen2_audio_tower(num_mel_bins=ac.num_mel_bins, embed_dim=ac.d_model, depth=ac.encoder_layers,
                                      num_heads=ac.encoder_attention_heads, ffn_dim=ac.encoder_ffn_dim,
                                      act=ac.activation_function, max_positions=ac.max_source_positions,
                                      out_dim=tc.hidden_size, attn_fn=attn_fn)
        except ValueError as e:
            raise MmzooError(f"config.json: {e}") from None
        return MultimodalLM(lm=lm, towers={"audio": audio})

    def convert_weights(self, hf: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """Map transformers' keys (v5 ``model.audio_tower.* / model.multi_modal_projector.* /
        model.language_model.*`` or the hub's ``audio_tower.* / multi_modal_projector.* /
        language_model.model.*``) onto mmzoo's names; add Whisper's missing key-projection bias as zeros."""
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
        if getattr(config, "tie_word_embeddings", False):
            out.pop("lm.lm_head.weight", None)
        return out

    def encoder_buckets(self, config, *, max_model_len: int, max_media_rows: int) -> dict[str, list[int]]:
        """XLA buckets of the audio tower, in clips per call: doubling up to :data:`MAX_CLIPS_PER_CALL`
        (a clip can fill as few as one token, so ``max_model_len`` does not bound the count) and to
        as many clips as the executor's media buffer of ``max_media_rows`` embeddings takes (each
        clip writes all its ``tokens_per_clip`` rows)."""
        most = min(MAX_CLIPS_PER_CALL, max_model_len, max_media_rows // self.tokens_per_clip(config))
        return {"audio": doubling(1, max(1, most))}

    def dummy_media(self, config, tower: str, rows: int) -> TowerInput:
        """``rows`` silent full-length clips, for compiling the tower at that bucket."""
        ac = config.audio_config
        frames = 2 * ac.max_source_positions
        return TowerInput(tower=tower, inputs={"features": np.zeros((rows, ac.num_mel_bins, frames), np.float32),
                                               "lengths": np.full(rows, frames, np.int64)},
                          num_embeds=rows * self.tokens_per_clip(config), pad={"lengths": frames})

    def features(self, processor, config, request: Request) -> tuple[np.ndarray, np.ndarray]:
        """``input_features [clips, mels, frames]`` and valid mel frames ``[clips]`` of the request's audios,
        from the checkpoint's feature extractor as Qwen2-Audio's processor calls it."""
        fe = processor.feature_extractor
        clips = load_audios(request.audios, fe.sampling_rate)
        for i, clip in enumerate(clips):
            if clip.shape[0] > fe.n_samples:
                print(f"mmzoo: note: audios[{i}] is {clip.shape[0] / fe.sampling_rate:.1f} s; the model hears only "
                      f"its first {fe.n_samples / fe.sampling_rate:.0f} s", file=sys.stderr)
        out = fe(clips, sampling_rate=fe.sampling_rate, padding="max_length", return_attention_mask=True,
                 return_tensors="np")
        feats, frames = np.asarray(out["input_features"], np.float32), np.asarray(out["attention_mask"]).sum(-1)
        want = 2 * config.audio_config.max_source_positions
        if feats.shape[1:] != (config.audio_config.num_mel_bins, want):
            raise MmzooError(f"the feature extractor gives {list(feats.shape[1:])} features per clip but the audio "
                             f"tower takes [{config.audio_config.num_mel_bins}, {want}]")
        for i, (clip, n) in enumerate(zip(clips, audio_tokens(frames))):
            if n < 1:
                raise MmzooError(f"audios[{i}] is too short ({clip.shape[0]} samples, {int(frames[i])} mel frames) "
                                 f"to give any audio token")
        return feats, frames.astype(np.int64)

    def prepare(self, processor, config, request: Request) -> Prepared:
        """One request -> token ids, 1-D positions and the clips to encode (or their embeddings).

        Raw audios are read with librosa at the feature extractor's rate and turned into log-mel
        windows; ``audio_embeds`` (one 2-D ``[tokens, hidden]`` per clip, as a list, or one 2-D for
        one clip) skip the tower; ``inputs_embeds`` replaces the whole prompt. The chat template
        renders one user turn (the audios, then the text) unless ``prompt_token_ids`` is given, and
        each ``<|AUDIO|>`` becomes its clip's token count, as the processor does.
        """
        tc = config.text_config
        refuse(request, self.name, ("images", "videos", "image_embeds", "image_grid_thw", "video_embeds",
                                    "video_grid_thw"))
        if request.inputs_embeds is not None:
            return prepare_inputs_embeds(request, hidden=tc.hidden_size)
        feats = frames = embeds = None
        if request.audio_embeds is not None:
            if request.audios:
                raise MmzooError("give audios or audio_embeds, not both")
            value = request.audio_embeds
            if isinstance(value, (list, tuple)):
                if request.audio_lengths is not None:
                    raise MmzooError("audio_lengths splits a 2-D audio_embeds; give one or the other, not a list too")
                embeds = [as_embeds(p, f"audio_embeds[{i}]", hidden=tc.hidden_size) for i, p in enumerate(value)]
            else:
                embeds = split_rows(as_embeds(value, "audio_embeds", hidden=tc.hidden_size), request.audio_lengths)
            if not embeds:
                raise MmzooError("audio_embeds is an empty list")
            for i, e in enumerate(embeds):
                if e.shape[0] == 0:
                    raise MmzooError(f"audio_embeds[{i}] has no rows")
            counts = [int(e.shape[0]) for e in embeds]
        elif request.audios:
            feats, frames = self.features(processor, config, request)
            counts = [int(n) for n in audio_tokens(frames)]
        else:
            counts = []
        token = int(config.audio_token_id)
        if request.prompt_token_ids is not None:
            input_ids = expand_runs(np.asarray(request.prompt_token_ids, dtype=np.int64), token, counts, what="audio")
        else:
            input_ids = render_prompt(processor, request, ["audio"], {"audio": (processor.audio_token, counts)})
        where = np.flatnonzero(input_ids == token)
        if len(where) != sum(counts):
            raise MmzooError(f"prompt has {len(where)} audio placeholder tokens but the {len(counts)} audios give "
                             f"{sum(counts)} ({counts})")
        mm_index = np.full(len(input_ids), -1, np.int64)
        media = []
        if embeds is not None:
            mm_index[where] = np.arange(len(where))
            media = [TowerInput(tower="audio", inputs={}, num_embeds=sum(counts), embeds=torch.cat(
                [e.to(embeds[0].dtype) for e in embeds]))]
        elif counts:
            per = self.tokens_per_clip(config)  # each clip's rows start at clip * per; its first `count` are valid
            mm_index[where] = np.concatenate([i * per + np.arange(n) for i, n in enumerate(counts)])
            media = [TowerInput(tower="audio", inputs={"features": feats, "lengths": frames},
                                num_embeds=len(counts) * per, pad={"lengths": feats.shape[-1]})]
        return Prepared(request=request, input_ids=input_ids, positions=np.arange(len(input_ids))[None],
                        position_delta=0, mm_index=mm_index, media=media,
                        lengths={"audio": np.asarray(counts, np.int64)} if counts else {})


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
