"""An OpenAI-compatible server on mmzoo's executor (``python -m mmzoo.serve``): FastAPI + uvicorn,
one engine loop thread owning the device, continuous batching."""

from mmzoo.engine_loop import EngineLoop
from mmzoo.serve.app import create_app, free_port, run
from mmzoo.text import TextStream

__all__ = ["create_app", "run", "free_port", "EngineLoop", "TextStream"]
