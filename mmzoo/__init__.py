"""mmzoo: config-driven multimodal LLM inference on XLA.

Public API::

    import mmzoo
    engine = mmzoo.load("path/to/checkpoint", executor="xla", attention="pallas")
    result = engine.generate("Describe this image.", images=["cat.png"], max_new_tokens=32)
    print(result.text)

    cfg = mmzoo.compose(["model=qwen2_vl", "checkpoint=path/to/checkpoint"])  # the config tree the CLI uses
    engine = mmzoo.build(cfg)
"""

__version__ = "0.1.0"

from mmzoo.config import compose
from mmzoo.engine import Engine, build, load
from mmzoo.errors import MmzooError
from mmzoo.types import Request, Result, StreamOutput

__all__ = ["load", "build", "compose", "Engine", "Request", "Result", "StreamOutput", "MmzooError", "__version__"]
