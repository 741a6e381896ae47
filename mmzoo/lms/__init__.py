"""Language models (decoders) and their KV cache.

``conf/lm/*.yaml`` name the component builders ``qwen2``, ``llama``, ``qwen3`` and ``gemma3`` (one
:class:`DecoderLM`, parametrized) as their ``_target_``.
"""

from mmzoo.lms.decoder import DecoderLM, ScaledEmbedding, gemma3, gemma3_lm_key, llama, qwen2, qwen3
from mmzoo.lms.kv_cache import DecodeView, KVCache, PrefillView

__all__ = ["qwen2", "llama", "qwen3", "gemma3", "gemma3_lm_key", "DecoderLM", "ScaledEmbedding", "KVCache",
           "PrefillView", "DecodeView"]
