"""The ``pallas`` attention backend: mmzoo's own JAX Pallas kernels, on TPU and off it.

Where each call runs is decided at construction (TPU or not, interpret or native, how JAX is
embedded in a torch_xla graph); per call only the static shapes and which masking arguments
are given choose between the kernels:

* xla tensors on TPU: torch_xla's ``flash_attention`` for self-attention shaped calls it
  handles exactly (equal q/kv heads, ``sq == skv`` in whole 128-row tiles, no positions,
  lengths, sliding window or blocks), the decode kernel for decode (no segment ids or blocks),
  the flash kernel of :mod:`._pallas_kernels` otherwise.
* xla tensors elsewhere (CPU XLA): the same kernels in interpret mode, embedded in the graph.
* plain CPU tensors (executor=eager): the same kernels run by JAX on the host, in interpret mode.

Inference only: no autograd through the kernels.
"""

from __future__ import annotations

import copy
import functools

import jax
import torch

from mmzoo.backends import _pallas_kernels as _pk
from mmzoo.backends._base import AttentionBackend, check_blocks, check_inputs

_MiB = 1 << 20
_KERNEL_STATIC = ("scale", "causal", "block_q", "block_kv", "interpret", "vmem_limit_bytes", "window")
_jit_flash = jax.jit(_pk.flash_attention, static_argnames=_KERNEL_STATIC)
_jit_decode = jax.jit(_pk.decode_attention, static_argnames=_KERNEL_STATIC[:2] + _KERNEL_STATIC[3:])


def _torch_xla_runtime():
    """``(on_tpu, xla_builder)``; ``(False, None)`` without torch_xla."""
    try:
        import torch_xla  # noqa: F401  (importing it selects the PJRT device)
        import torch_xla.core.xla_builder as xb
        import torch_xla.runtime as xr
    except ImportError:
        return False, None
    return xr.device_type() == "TPU", xb


def _torchax_importable() -> bool:
    # torch_xla's call_jax needs torchax, and torchax 0.0.13 imports flax at import time.
    try:
        import torchax  # noqa: F401
    except ImportError:
        return False
    return True


class PallasAttention(AttentionBackend):
    """Blocked online-softmax attention written with ``jax.experimental.pallas``.

    Args:
        interpret: run the kernels in Pallas interpret mode. ``None`` (default): native on a
            TPU, interpret anywhere else. ``False`` off a TPU raises. Plain CPU tensors always
            run in interpret mode (Mosaic kernels only run on a TPU).
        block_q: query rows per flash tile, a multiple of 8.
        block_kv: keys per tile (flash and decode), a multiple of 128.
        decode_max_q: calls with at most this many queries and no segment ids or bidirectional
            blocks (``q_blocks``) take the decode kernel (query heads of a kv head share one
            tile, blocks past each sequence's length are skipped); the others take the flash
            kernel.
        vmem_limit_bytes: scoped VMEM the TPU compiler may use per kernel; :meth:`check_shape`
            rejects shapes whose tiles would not fit.
        use_torch_xla_flash: on TPU, let torch_xla's ``flash_attention`` take the calls it
            handles exactly (see the module docstring).
    """

    name = "pallas"
    skips_past_length = True
    skips_masked_blocks = True

    def __init__(self, *, interpret: bool | None = None, block_q: int = 256, block_kv: int = 512,
                 decode_max_q: int = 16, vmem_limit_bytes: int = 32 * _MiB,
                 use_torch_xla_flash: bool = True):
        if block_q <= 0 or block_q % _pk.SUBLANES:
            raise ValueError(f"pallas attention: block_q={block_q} must be a positive multiple of {_pk.SUBLANES}")
        if block_kv <= 0 or block_kv % _pk.LANES:
            raise ValueError(f"pallas attention: block_kv={block_kv} must be a positive multiple of {_pk.LANES}")
        if decode_max_q < 0:
            raise ValueError(f"pallas attention: decode_max_q={decode_max_q} must be >= 0")
        self.on_tpu, self._xb = _torch_xla_runtime()
        if interpret is False and not self.on_tpu:
            raise ValueError("pallas attention: interpret=False needs a TPU (PJRT_DEVICE=TPU); "
                             "off a TPU the kernels run in interpret mode")
        self.interpret = (not self.on_tpu) if interpret is None else interpret
        self.block_q, self.block_kv = block_q, block_kv
        self.decode_max_q = decode_max_q
        self.vmem_limit_bytes = vmem_limit_bytes
        self._xla_flash = None
        if self.on_tpu:
            from torch_xla._internal.jax_workarounds import jax_import_guard

            jax_import_guard()  # torch_xla must own the TPU before JAX initializes its backends
            if use_torch_xla_flash and not self.interpret:
                from torch_xla.experimental.custom_kernel import flash_attention

                self._xla_flash = flash_attention
        # How JAX code enters a torch_xla graph: torch_xla's call_jax, or the same lowering
        # done here when torchax (which call_jax needs) cannot be imported.
        if self._xb is None:
            self._embed = None
        elif _torchax_importable():
            self._embed = self._xb.call_jax
        else:
            self._embed = functools.partial(_call_jax_without_torchax, self._xb)

    _spmd = None  # a device mesh (mmzoo.executor._sharding.DeviceMesh) after with_mesh()

    def with_mesh(self, mesh) -> "PallasAttention":
        """This backend, run per shard under torch_xla SPMD: GSPMD cannot split a Pallas kernel, so
        on xla tensors each call runs on the local heads (and batch) of every device, through
        ``mesh.per_shard``; torch_xla's ``flash_attention`` gets ``mesh.flash_kwargs``
        (``partition_spec``, ``mesh``). Called by the XLA executor when it is given a mesh."""
        out = copy.copy(self)
        out._spmd = mesh
        return out

    def __repr__(self) -> str:
        return (f"PallasAttention(interpret={self.interpret}, block_q={self.block_q}, "
                f"block_kv={self.block_kv}, decode_max_q={self.decode_max_q})")

    def check_shape(self, *, head_dim: int, num_heads: int, num_kv_heads: int) -> None:
        """Base checks, plus: one flash tile (``block_q`` rows) and one decode tile
        (``groups * decode_max_q`` rows) of ``head_dim`` channels must fit ``vmem_limit_bytes``.

        Checked in interpret mode too, so a shape that cannot compile on a TPU fails on CPU first.
        """
        super().check_shape(head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads)
        groups = num_heads // num_kv_heads
        for kernel, rows in (("flash", self.block_q), ("decode", groups * max(self.decode_max_q, 1))):
            need = _pk.vmem_bytes(rows=rows, block_kv=self.block_kv, head_dim=head_dim)
            if need > self.vmem_limit_bytes:
                raise ValueError(
                    f"pallas attention: a {kernel} tile of {rows} query rows x block_kv={self.block_kv} "
                    f"keys with head_dim={head_dim} needs about {need / _MiB:.1f} MiB of VMEM, over "
                    f"vmem_limit_bytes={self.vmem_limit_bytes / _MiB:.1f} MiB; lower block_q/block_kv "
                    f"(or decode_max_q) or raise vmem_limit_bytes")

    def __call__(self, q, k, v, *, scale, causal=False, q_segment_ids=None, kv_segment_ids=None,
                 q_positions=None, kv_lengths=None, sliding_window=None, q_blocks=None, kv_blocks=None):
        check_inputs(q, k, v)
        if (q_segment_ids is None) != (kv_segment_ids is None):
            raise ValueError("attention: pass both q_segment_ids and kv_segment_ids, or neither")
        b, hq, sq, _ = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        on_xla = q.device.type == "xla"
        if sliding_window is not None and not causal:
            raise ValueError("attention: a sliding window applies to causal attention")
        check_blocks(causal, q_blocks, kv_blocks, b, sq, skv)
        blocks = q_blocks is not None
        if on_xla and self._xla_flash is not None and sliding_window is None and not blocks and self._xla_flash_takes(
                hq, hkv, sq, skv, q_positions, kv_lengths, q_segment_ids, kv_segment_ids):
            seg = None if q_segment_ids is None else q_segment_ids.to(torch.int32)
            return self._xla_flash(q, k, v, causal=causal, q_segment_ids=seg, kv_segment_ids=seg,
                                   sm_scale=float(scale), **({} if self._spmd is None else self._spmd.flash_kwargs(q)))

        ints = [None if t is None else t.to(torch.int32) for t in (q_positions, kv_lengths)]
        # the decode kernel has no blocks: a decode query is in none (an executor passes None);
        # a short call with blocks (a chunk of a prompt) takes the flash kernel
        decode = sq <= self.decode_max_q and q_segment_ids is None and not blocks
        interpret = self.interpret or not on_xla
        static = {"scale": float(scale), "causal": bool(causal), "block_kv": self.block_kv,
                  "interpret": interpret, "vmem_limit_bytes": None if interpret else self.vmem_limit_bytes,
                  "window": None if sliding_window is None else int(sliding_window)}
        if decode:
            fn, jitted, tensors = _pk.decode_attention, _jit_decode, (q, k, v, *ints)
        else:
            static["block_q"] = self.block_q
            segs = [None if t is None else t.to(torch.int32) for t in (q_segment_ids, kv_segment_ids)]
            fn, jitted, tensors = _pk.flash_attention, _jit_flash, (q, k, v, *segs, *ints)
            if blocks:  # appended only when given: calls without blocks keep their exact graph
                tensors += tuple(t.to(torch.int32) for t in (q_blocks, kv_blocks))
        if on_xla:
            if self._embed is None:
                raise RuntimeError("pallas attention: xla tensors but torch_xla is not importable")
            if self._spmd is not None:  # one kernel per shard, on its local heads
                return self._spmd.per_shard(lambda local: self._embed(fn, tuple(local), static), tensors)
            return self._embed(fn, tensors, static)
        if q.device.type != "cpu":
            raise ValueError(f"pallas attention runs on xla or cpu tensors, got {q.device}")
        # exact shapes (executor=eager): lengths padded to HOST_KV_QUANTUM, so JAX compiles the kernels once per
        # 64 cache lengths (a decode step) or prompt lengths, not at every new length
        tensors = _host_decode_padded(q, k, v, *ints, causal=causal) if decode else _host_flash_padded(
            tensors, causal=causal)
        out = torch.from_dlpack(jitted(*(None if t is None else _to_jax(t) for t in tensors), **static))
        return out[:, :, :sq] if out.shape[2] != sq else out

    @staticmethod
    def _xla_flash_takes(hq, hkv, sq, skv, q_positions, kv_lengths, q_segment_ids, kv_segment_ids) -> bool:
        """Whether torch_xla's TPU flash_attention computes exactly the mmzoo contract.

        It needs equal q/kv heads and aligns causal at the top-left (right only when ``sq == skv``);
        it zero-pads keys to its 512 block without masking them, so lengths must tile; it has no
        positions or lengths; and a row that sees no key is not zeroed, so segment ids are taken
        only as self-attention (the same tensor for q and kv: every query sees itself).
        """
        return (hq == hkv and sq == skv and sq % 128 == 0 and (sq <= 512 or sq % 512 == 0)
                and q_positions is None and kv_lengths is None
                and (q_segment_ids is None or q_segment_ids is kv_segment_ids))


HOST_KV_QUANTUM = 64  # rows a host call's queries and keys are padded to a multiple of


def _rows(t, pad: int, value=0):
    """``t`` (``[b, n]`` ids or ``[b, h, n, d]`` activations, or None) padded by ``pad`` rows along ``n``."""
    if t is None or not pad:
        return t
    return torch.nn.functional.pad(t, (0, 0, 0, pad) if t.dim() == 4 else (0, pad), value=value)


def _explicit_masks(q_positions, kv_lengths, *, b: int, sq: int, skv: int, causal: bool) -> tuple:
    """The kernels' defaults made explicit before padding: causal queries at the last ``sq`` key
    positions, every sequence ``skv`` keys long (so the padded keys are masked)."""
    if causal and q_positions is None:
        q_positions = (torch.arange(sq, dtype=torch.int32) + (skv - sq)).expand(b, sq)
    if kv_lengths is None:
        kv_lengths = torch.full((b,), skv, dtype=torch.int32)
    return q_positions, kv_lengths


def _host_decode_padded(q, k, v, q_positions, kv_lengths, *, causal: bool) -> tuple:
    """The decode kernel's inputs with the keys and values padded to a multiple of
    :data:`HOST_KV_QUANTUM` rows, masked by explicit ``kv_lengths`` (and, causal, the queries'
    explicit positions: the last ``sq`` real keys'), so that a host decode whose cache grows a token
    a step reuses JAX's compiled kernel instead of tracing and compiling it again at every length.
    The padded keys are masked out: the output is the unpadded call's."""
    b, _, sq, _ = q.shape
    skv = k.shape[2]
    pad = -skv % HOST_KV_QUANTUM
    if not pad:
        return q, k, v, q_positions, kv_lengths
    q_positions, kv_lengths = _explicit_masks(q_positions, kv_lengths, b=b, sq=sq, skv=skv, causal=causal)
    return q, _rows(k, pad), _rows(v, pad), q_positions, kv_lengths


def _host_flash_padded(tensors: tuple, *, causal: bool) -> tuple:
    """The flash kernel's inputs ``(q, k, v, q_seg, kv_seg, q_positions, kv_lengths[, q_blocks,
    kv_blocks])`` with the queries and the keys padded to a multiple of :data:`HOST_KV_QUANTUM` rows,
    as the kernel pads to its tiles: padded keys masked by explicit ``kv_lengths``, padded queries at
    position -1 (causal; they see nothing) and in no block, their rows dropped by the caller. The real
    rows' outputs are the unpadded call's."""
    q, k, v, q_seg, kv_seg, q_positions, kv_lengths, *blocks = tensors
    b, _, sq, _ = q.shape
    skv = k.shape[2]
    pad_q, pad_kv = -sq % HOST_KV_QUANTUM, -skv % HOST_KV_QUANTUM
    if not (pad_q or pad_kv):
        return tensors
    q_positions, kv_lengths = _explicit_masks(q_positions, kv_lengths, b=b, sq=sq, skv=skv, causal=causal)
    blocks = [_rows(blocks[0], pad_q, -1), _rows(blocks[1], pad_kv, -1)] if blocks else []
    return (_rows(q, pad_q), _rows(k, pad_kv), _rows(v, pad_kv), _rows(q_seg, pad_q), _rows(kv_seg, pad_kv),
            _rows(q_positions, pad_q, -1), kv_lengths, *blocks)


def _to_jax(t: torch.Tensor) -> jax.Array:
    """A CPU tensor as a JAX array, without a copy when it is already contiguous."""
    return jax.dlpack.from_dlpack(t.detach().contiguous())


_TORCH_TO_JAX_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                       torch.int32: "int32"}
_LOWERED = {}


def _call_jax_without_torchax(xb, fn, tensors, static):
    """``fn(*tensors, **static)`` as a node of the torch_xla graph, as ``xb.call_jax`` does.

    The JAX function is lowered to HLO once per (function, static args, shapes) and inserted as a
    user computation. ``None`` entries of ``tensors`` stay ``None`` for ``fn``.
    """
    present = [i for i, t in enumerate(tensors) if t is not None]
    key = (fn, tuple(sorted(static.items())),
           tuple(None if t is None else (tuple(t.shape), t.dtype) for t in tensors))
    if key not in _LOWERED:
        def flat(*arrays):
            full = [None] * len(tensors)
            for i, a in zip(present, arrays):
                full[i] = a
            return (fn(*full, **static),)

        specs = [jax.ShapeDtypeStruct(tuple(tensors[i].shape), _TORCH_TO_JAX_DTYPE[tensors[i].dtype])
                 for i in present]
        hlo = jax.jit(flat, keep_unused=True).lower(*specs).compiler_ir("hlo")
        computation = xb.computation_from_module_proto("mmzoo_pallas", hlo.as_serialized_hlo_module_proto())
        _LOWERED[key] = xb.xla_computation_as_func(computation, "mmzoo_pallas")
    (out,) = _LOWERED[key]([tensors[i] for i in present])
    return out
