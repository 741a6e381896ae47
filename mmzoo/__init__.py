"""mmzoo: config-driven multimodal LLM inference on XLA.

Public API::

    import mmzoo
    engine = mmzoo.load("path/to/checkpoint", executor="xla", attention="pallas")
    result = engine.generate("Describe this image.", images=["cat.png"], max_new_tokens=32)
    print(result.text)
"""

__version__ = "0.1.0"

from mmzoo.engine import Engine, load
from mmzoo.errors import MmzooError
from mmzoo.executor import Result
from mmzoo.models._types import Request

__all__ = ["load", "Engine", "Request", "Result", "MmzooError", "__version__"]
