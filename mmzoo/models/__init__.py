"""The composition (towers + LM) and the model families (what each adds to its components)."""

from mmzoo.models.composition import MultimodalLM, Tower
from mmzoo.models.gemma3 import Gemma3
from mmzoo.models.family import TP_PLAN, Family, FramedMedia, Media, SquareItems, extend_tp_plan
from mmzoo.models.internvl import InternVL
from mmzoo.models.llava import Llava
from mmzoo.models.llava_onevision import LlavaOnevision
from mmzoo.models.qwen2_5_vl import Qwen2_5_VL
from mmzoo.models.qwen2_audio import Qwen2Audio
from mmzoo.models.qwen2_vl import Qwen2VL
from mmzoo.models.qwen3_vl import Qwen3VL
from mmzoo.models.smolvlm import SmolVLM

__all__ = ["MultimodalLM", "Tower", "Family", "SquareItems", "Media", "FramedMedia", "TP_PLAN", "extend_tp_plan",
           "Qwen2VL",
           "Qwen2_5_VL", "Qwen3VL", "Llava", "LlavaOnevision", "InternVL", "SmolVLM", "Gemma3", "Qwen2Audio"]
