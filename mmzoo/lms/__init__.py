"""Language models (decoders) and their KV cache."""

from mmzoo.lms.decoder import DecoderLM
from mmzoo.lms.kv_cache import DecodeView, KVCache, PrefillView

__all__ = ["DecoderLM", "KVCache", "PrefillView", "DecodeView"]
