"""Model families: component builders, weight mapping and request preparation per family."""

from mmzoo.models._types import Prepared, Request, TowerInput
from mmzoo.models.composition import MultimodalLM, Tower
from mmzoo.models.qwen2_vl import Qwen2VL

__all__ = ["MultimodalLM", "Tower", "Qwen2VL", "Prepared", "Request", "TowerInput"]

from mmzoo.models.llava import Llava  # noqa: E402
from mmzoo.models.qwen2_audio import Qwen2Audio  # noqa: E402

__all__ += ["Llava", "Qwen2Audio"]
