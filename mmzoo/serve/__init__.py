"""An OpenAI-compatible server on mmzoo's executor (``python -m mmzoo.serve``): FastAPI + uvicorn,
one engine loop thread owning the device, continuous batching."""

from mmzoo.serve.app import TextStream, create_app, free_port, run
from mmzoo.serve.loop import EngineLoop

__all__ = ["create_app", "run", "free_port", "EngineLoop", "TextStream"]
