"""Language models (decoders) and their KV cache.

``conf/lm/*.yaml`` name the component builders ``qwen2`` and ``llama`` (one :class:`DecoderLM`,
parametrized) as their ``_target_``.
"""

from mmzoo.lms.decoder import DecoderLM, llama, qwen2
from mmzoo.lms.kv_cache import DecodeView, KVCache, PrefillView

__all__ = ["qwen2", "llama", "DecoderLM", "KVCache", "PrefillView", "DecodeView"]
