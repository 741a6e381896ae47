"""Executors: own devices, padding, caches, scheduling and sampling; modules own none of it."""

from mmzoo.executor.base import Executor
from mmzoo.executor._sharding import MeshSpec, mesh_option
from mmzoo.executor.buckets import Buckets
from mmzoo.executor.eager import EagerExecutor
from mmzoo.executor.loop import Generation, generate
from mmzoo.executor.scheduler import Drain

__all__ = ["Executor", "EagerExecutor", "XLAExecutor", "Buckets", "Generation", "generate", "MeshSpec", "mesh_option",
           "Drain"]


def __getattr__(name):
    if name == "XLAExecutor":  # importing torch_xla is slow; only when asked for
        from mmzoo.executor.xla import XLAExecutor

        return XLAExecutor
    raise AttributeError(name)
