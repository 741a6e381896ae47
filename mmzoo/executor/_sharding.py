"""Tensor and data parallelism over a device mesh with torch_xla SPMD (GSPMD).

The executor owns placement, so this module, not the model code, says where every tensor lives:
the modules stay plain ``nn.Module``s; the XLA executor annotates their parameters, its KV cache
and its decode inputs with ``torch_xla.distributed.spmd.mark_sharding``, and XLA's GSPMD
partitioner splits every compiled graph over the devices and inserts the collectives. The
program is the same one as on a single device (one process per host, one virtual device).

A mesh has two named axes, ``data`` and ``model`` (``conf/mesh/``: ``single``, ``tp``,
``dp_tp``). Which parameter splits how is a plan of parameter-name patterns, declared by the
family (:attr:`mmzoo.models.Family.tp_plan`; the style of transformers' ``tp_plan``): the shared
components' :data:`mmzoo.models.TP_PLAN` (the attention and MLP layers every LM, ViT block and
encoder shares, the LM's embedding and head) extended by the family with its own parts' patterns
(:func:`mmzoo.models.extend_tp_plan`: Llava's projector, Qwen2-VL's patch merger), in Megatron-LM's
split (Shoeybi et al., 2019):

* ``colwise`` (attention q/k/v, gate/up, MLP ``fc1``, an adapter's first linear): weight
  ``[out, in]`` -> ``('model', None)``, bias ``('model',)``: each shard computes whole heads (or a
  slice of the MLP width);
* ``rowwise`` (``o_proj``, ``down_proj``, ``fc2``, an adapter's second linear): ``(None, 'model')``,
  bias replicated: partial sums, all-reduced by GSPMD;
* ``vocab`` (the LM's token embedding and ``lm_head``): ``('model', None)``;
* anything unmatched (norms, conv stems, patch/position/class embeddings, the audio projector):
  replicated. Annotations never change the numbers (GSPMD inserts whatever collectives the split
  needs), so a plan is a performance choice; fused projections (``qkv_proj``, ``gate_up_proj``)
  are split column-wise like their parts;
* KV cache ``[slots, kv_heads, len, head_dim]`` -> ``('data', 'model', None, None)``. The decode
  step's small inputs (``[slots, ...]`` token ids, positions) are sent whole; GSPMD propagates
  the cache's split back onto the step, so each data shard computes only its own slots (seen in
  the partitioned HLO), and the decode path needs no annotation of its own. A prefill (one
  sequence) and the towers run replicated over ``data`` and split over ``model``; the media
  buffer is replicated.

Rules that need a word:

* **Fewer kv heads than the model axis** (``model % num_kv_heads == 0``, e.g. 2 kv heads at
  ``model=4``): the kv projections and the KV cache are replicated over ``model`` (each device
  holds every kv head; vLLM replicates kv heads the same way), query heads are still split.
  Any other mismatch of heads and ``model`` is an error at load.
* **Pallas** kernels are opaque to GSPMD, so the backend is handed this mesh
  (``PallasAttention.with_mesh``) and runs each kernel once per shard on its local heads (and
  local batch in decode): ``enable_manual_sharding`` -> kernel on the local shapes ->
  ``disable_manual_sharding``, the pattern of torch_xla's own SPMD ``flash_attention``, which
  gets ``partition_spec``/``mesh`` where it is used (TPU). When kv heads are replicated the
  cache is first repeated to one kv head per shard. On CPU the same code runs the interpret-mode
  kernel per shard.
* **Devices beyond the mesh**: torch_xla needs a mesh over every device, so a mesh smaller than
  the device count gets an outer ``replica`` axis that no tensor names (those devices compute
  copies). The mesh size must divide the device count.

SPMD is process-wide (``torch_xla.runtime.use_spmd()``): once an engine with a mesh is loaded,
every XLA tensor of the process lives on the SPMD virtual device; an engine without a mesh then
runs replicated on every device (the same numbers as one device). ``mesh=single`` never turns SPMD
on, so a process that never asks for a mesh behaves exactly as before.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from mmzoo.errors import MmzooError

DATA, MODEL, REPLICA = "data", "model", "replica"
ROW = (None, MODEL)


@dataclass(frozen=True)
class MeshSpec:
    """Devices along the ``data`` axis (decode slots) and the ``model`` axis (heads, MLP width,
    vocabulary). ``data * model == 1`` is one device without SPMD.

    Args:
        data: data-parallel ways; ``executor.max_batch`` must be a multiple of it.
        model: tensor-parallel ways; must divide every tower's and the LM's query heads.
    """

    data: int = 1
    model: int = 1

    def __post_init__(self):
        for axis in ("data", "model"):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MmzooError(f"mesh.{axis}={value!r} must be a positive integer")

    @property
    def size(self) -> int:
        return self.data * self.model

    @property
    def spmd(self) -> bool:
        return self.size > 1

    def __str__(self) -> str:
        return f"data={self.data} x model={self.model}"


def mesh_option(mesh) -> MeshSpec | None:
    """``mesh=`` of :func:`mmzoo.load`: None, a ``conf/mesh`` name (``"tp"``), a mapping
    (``{"model": 4}``, a Hydra node) or a :class:`MeshSpec`."""
    if mesh is None or isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, str):
        from mmzoo.config import build_option

        return build_option("mesh", mesh)
    if isinstance(mesh, Mapping) or hasattr(mesh, "items"):
        fields = {str(k): v for k, v in mesh.items() if k != "_target_"}
        unknown = sorted(set(fields) - {"data", "model"})
        if unknown:
            raise MmzooError(f"mesh: unknown fields {unknown}; a mesh has data and model")
        return MeshSpec(**{k: int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v
                           for k, v in fields.items()})
    raise MmzooError(f"mesh={mesh!r}: give a conf/mesh name, a mapping with data/model, or a MeshSpec")


# -------------------------------------------------------------------------------- the plan

_STYLES = ("colwise", "colwise_kv", "rowwise", "vocab", "replicate")


class ShardingPlan:
    """The partition spec of every parameter of ``model`` on ``mesh``, from a tensor-parallel plan of
    parameter-name patterns (``rules``: a family's :attr:`~mmzoo.models.Family.tp_plan`; default
    :data:`mmzoo.models.TP_PLAN`, the shared components' alone), validated on the host (no device is
    touched, so a bad mesh fails before SPMD is switched on).

    Attributes:
        specs: parameter name -> partition spec (a tuple of ``'model'``/``None`` per dim).
        kv_sharded: the LM's kv heads (and its KV cache) are split over ``model``; False: replicated.

    Raises:
        MmzooError: a head count ``model`` does not divide (naming the module and the numbers),
            or ``max_batch`` not a multiple of ``data``.
    """

    def __init__(self, mesh: MeshSpec, model: torch.nn.Module, *, max_batch: int, rules: Mapping | None = None):
        from mmzoo.layers import Attention
        from mmzoo.models.family import TP_PLAN

        self.mesh, m = mesh, mesh.model
        self.rules = dict(TP_PLAN if rules is None else rules)
        bad = sorted({v for v in self.rules.values() if v not in _STYLES})
        if bad:
            raise MmzooError(f"tp_plan: unknown styles {bad}; choose from {list(_STYLES)}")
        if max_batch % mesh.data:
            raise MmzooError(f"executor.max_batch={max_batch} is not a multiple of mesh.data={mesh.data}: "
                             f"the decode slots are split over the data axis")
        self.kv_split: dict[str, bool] = {}  # attention module -> its kv heads split over model
        for name, mod in model.named_modules():
            if not isinstance(mod, Attention):
                continue
            heads, kv = mod.num_heads, mod.num_kv_heads
            where = name.rsplit(".attn", 1)[0] if ".attn" in name else name
            if heads % m:
                raise MmzooError(f"mesh.model={m} does not divide num_heads={heads} of {where} "
                                 f"(attention heads are split over the model axis)")
            if kv % m and m % kv:
                raise MmzooError(f"mesh.model={m} and num_kv_heads={kv} of {where}: neither divides the other "
                                 f"(kv heads are split over the model axis, or replicated when fewer than it)")
            self.kv_split[name] = kv % m == 0
        self.kv_sharded = all(split for name, split in self.kv_split.items() if name.startswith("lm."))
        self.specs = {name: self.spec(name, p) for name, p in model.named_parameters()}

    def spec(self, name: str, param: torch.Tensor) -> tuple:
        """The partition spec of the parameter ``name`` (the first matching rule; unmatched: replicated)."""
        style = next((s for pattern, s in self.rules.items() if fnmatch.fnmatchcase(name, pattern)), "replicate")
        if style == "colwise_kv":
            style = "colwise" if self.kv_split.get(name.rsplit(".", 2)[0], True) else "replicate"
        if style == "replicate" or param.dim() not in (1, 2):
            return (None,) * param.dim()
        if style == "rowwise":
            return ROW if param.dim() == 2 else (None,)
        return (MODEL, None) if param.dim() == 2 else (MODEL,)  # colwise; vocab: rows of the table

    def cache_spec(self) -> tuple:
        """``[slots, kv_heads, len, head_dim]``."""
        return (DATA, MODEL if self.kv_sharded else None, None, None)


# -------------------------------------------------------------------------------- the device side

def device_count() -> int:
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count()


class DeviceMesh:
    """A plan on the devices: SPMD on, the torch_xla ``Mesh``, and the annotations.

    Raises:
        MmzooError: the mesh needs more devices than the runtime has, or does not divide them.
    """

    def __init__(self, plan: ShardingPlan):
        import os

        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        self.plan, spec = plan, plan.mesh
        n = device_count()
        if spec.size > n:
            hint = " (on CPU, set CPU_NUM_DEVICES before starting)" if xr.device_type() == "CPU" else ""
            raise MmzooError(f"mesh.data={spec.data} x mesh.model={spec.model} needs {spec.size} devices but "
                             f"PJRT_DEVICE={os.environ.get('PJRT_DEVICE')} has {n}{hint}")
        if n % spec.size:
            raise MmzooError(f"mesh.data={spec.data} x mesh.model={spec.model} = {spec.size} devices does not "
                             f"divide the {n} devices (the rest would hold replicas)")
        if torch_xla._XLAC._xla_get_spmd_config_is_locked() and not xr.is_spmd():
            raise MmzooError("a device mesh needs torch_xla SPMD, which must be switched on before this process "
                             "touches an XLA device or tensor; load the sharded engine first, in a fresh process")
        xr.use_spmd()
        self.replicas = n // spec.size
        shape, names = (spec.data, spec.model), (DATA, MODEL)
        if self.replicas > 1:  # an axis no tensor names: those devices hold copies
            shape, names = (self.replicas,) + shape, (REPLICA,) + names
        self.mesh = xs.Mesh(np.arange(n), shape, names)
        xs.set_global_mesh(self.mesh)  # torch_xla's SPMD flash_attention reads it
        self.num_devices = n
        self._xs = xs

    def describe(self) -> str:
        extra = f", {self.replicas} replicas" if self.replicas > 1 else ""
        kv = "" if self.plan.kv_sharded else ", kv heads replicated"
        return f"mesh {self.plan.mesh} (torch_xla SPMD{extra}{kv})"

    def mark(self, t: torch.Tensor, spec: tuple) -> None:
        self._xs.mark_sharding(t, self.mesh, tuple(spec))

    def place(self, model: torch.nn.Module, cache) -> None:
        """Annotate the parameters (by the plan's patterns, so fused projections are covered too)
        and the KV cache, before they first materialize; give every attention layer its backend
        built for this mesh (:meth:`~mmzoo.backends.AttentionBackend.with_mesh`). ``model`` is the
        executor's own copy."""
        for name, p in model.named_parameters():
            self.mark(p, self.plan.spec(name, p))
        for t in list(cache.k) + list(cache.v):
            self.mark(t, self.plan.cache_spec())
        from mmzoo.layers import Attention

        built = {}
        for mod in model.modules():
            if isinstance(mod, Attention):
                fn = mod.attn_fn
                if id(fn) not in built:
                    built[id(fn)] = fn.with_mesh(self)
                mod.attn_fn = built[id(fn)]

    def sharding_spec(self, t: torch.Tensor) -> str:
        """torch_xla's sharding of ``t`` (HLO text, e.g. ``{devices=[4,1]0,1,2,3}``)."""
        import torch_xla

        return torch_xla._XLAC._get_xla_sharding_spec(t)

    # -- kernels GSPMD cannot partition --------------------------------------------------
    def _batch_axis(self, b: int):
        data = self.plan.mesh.data
        return DATA if data > 1 and b % data == 0 else None

    def flash_kwargs(self, q: torch.Tensor) -> dict:
        """``partition_spec``/``mesh`` for torch_xla's ``flash_attention`` (q ``[b, h, s, d]``)."""
        return {"partition_spec": (self._batch_axis(q.shape[0]), MODEL, None, None), "mesh": self.mesh}

    def per_shard(self, call, tensors):
        """``call(local_tensors)`` once per shard: q ``[b, hq, sq, d]``, k/v ``[b, hkv, skv, d]``
        split over heads (and batch when it divides ``data``), the rest (per-sequence metadata,
        ``[b, ...]`` or None) over batch only; the ``[b, hq, sq, d]`` result is put back together.

        kv heads fewer than ``model`` are repeated first, so each shard holds the one kv head its
        query heads read (query head ``j`` reads kv head ``j // (hq / hkv)`` either way).
        """
        from mmzoo.backends import repeat_kv

        q, k, v, *meta = tensors
        m, hkv = self.plan.mesh.model, k.shape[1]
        if hkv % m:
            k, v = repeat_kv(k, m // hkv), repeat_kv(v, m // hkv)
        batch = self._batch_axis(q.shape[0])
        heads = (batch, MODEL, None, None)

        def local(t, spec):
            return None if t is None else self._xs.enable_manual_sharding(t, spec, mesh=self.mesh).global_tensor

        args = [local(t, heads) for t in (q, k, v)]
        args += [local(t, None if t is None else (batch,) + (None,) * (t.dim() - 1)) for t in meta]
        out = call(args)  # [b / data?, hq / model, sq, d]
        return self._xs.disable_manual_sharding(out, heads, q.shape, mesh=self.mesh).global_tensor
