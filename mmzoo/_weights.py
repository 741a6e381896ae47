"""Loading weights once, in place, in the run dtype.

A checkpoint is read lazily: :func:`checkpoint_tensors` reads only the safetensors headers and gives
a :class:`LazyTensor` per tensor (name, shape, dtype), whose bytes are read when it is loaded. The
pipeline's modules are built with their parameters on the meta device (:func:`parameters_on_meta`:
no memory, no random init); :func:`materialize` then fills them unit by unit (an attention or gated
MLP whole, or one module's own parameters): each tensor is read, cast to the run dtype, laid out by
the executor (fused, transposed, packed) and placed on the device before the next unit is read, so
at most one unit's copies are on the host besides the placed weights. A tensor used as it is (the
eager executor's, already in the run dtype) stays a view of one read-only mapping per file, as in
transformers' loader: its pages are read when first touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.nn.utils import parametrize

from mmzoo.errors import MmzooError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor of a safetensors file, read when :meth:`load` is called.

    It answers ``shape`` and ``dtype`` (from the file's header), :meth:`chunk` and :meth:`reshape`,
    so that a family's :meth:`~mmzoo.models.Family.convert_weights` (renames, a fused qkv split in
    three, InternViT's ``[1, 1, d]`` class token as CLIP's ``[d]``) runs on the checkpoint's names
    without reading a byte.

    Attributes:
        path: the safetensors file.
        key: the tensor's name in it.
        shape: the shape after ``part`` is taken.
        dtype: its torch dtype.
        part: ``(dim, start, stop)``: only that slice along ``dim`` (a chunk), or None.
        reshaped: the file's tensor is read as ``shape`` (:meth:`reshape`).
    """

    path: Path
    key: str
    shape: torch.Size
    dtype: torch.dtype
    part: tuple[int, int, int] | None = None
    reshaped: bool = False

    def numel(self) -> int:
        return self.shape.numel()

    def chunk(self, chunks: int, dim: int = 0) -> list[LazyTensor]:
        """``torch.chunk`` of the tensor, lazily (equal parts along ``dim``)."""
        if self.part is not None or self.reshaped:
            raise NotImplementedError("LazyTensor.chunk of a chunk or of a reshaped tensor")
        dim = dim % len(self.shape)
        size = -(-self.shape[dim] // chunks)
        out = []
        for start in range(0, self.shape[dim], size):
            stop = min(start + size, self.shape[dim])
            shape = list(self.shape)
            shape[dim] = stop - start
            out.append(LazyTensor(self.path, self.key, torch.Size(shape), self.dtype, (dim, start, stop)))
        return out

    def reshape(self, *shape) -> LazyTensor:
        """``torch.reshape`` of the whole tensor, lazily (the same elements in the same order).

        Raises:
            ValueError: ``shape`` holds another number of elements than the tensor.
        """
        new = torch.Size(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)
        if self.part is not None:
            raise NotImplementedError("LazyTensor.reshape of a chunk")
        if new.numel() != self.shape.numel():
            raise ValueError(f"{self.key}: cannot reshape {list(self.shape)} to {list(new)}")
        return LazyTensor(self.path, self.key, new, self.dtype, None, True)

    def contiguous(self) -> LazyTensor:
        return self  # a loaded tensor is always contiguous

    def load(self, handles: dict | None = None) -> torch.Tensor:
        """The tensor's values, in the file's dtype: a view of a read-only mapping of the file.

        Args:
            handles: path -> open file, shared by the loads of one checkpoint: the tensors are views
                of one mapping per file (nothing is copied; a page is read when first touched, as
                transformers' loader does). None: the file is opened for this tensor alone, and its
                mapping goes with the tensor (copy or cast it: a kept view keeps a mapping per tensor).
        """
        try:
            if handles is not None:
                f = handles.get(self.path)
                if f is None:
                    f = handles[self.path] = safe_open(str(self.path), framework="pt")
                return self._read(f)
            with safe_open(str(self.path), framework="pt") as f:
                return self._read(f)
        except (SafetensorError, OSError) as e:
            raise _unreadable(self.path, e) from None

    def _read(self, f) -> torch.Tensor:
        if self.part is None:
            t = f.get_tensor(self.key)
            return t.reshape(self.shape) if self.reshaped else t
        dim, start, stop = self.part
        return f.get_slice(self.key)[(slice(None),) * dim + (slice(start, stop),)]


def load(t) -> torch.Tensor:
    """The values of a :class:`LazyTensor` (a tensor of its own memory) or of a tensor given as it is."""
    return t.load().clone() if isinstance(t, LazyTensor) else t


def checkpoint_files(checkpoint: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: ``model.safetensors`` or the shards listed
    in ``model.safetensors.index.json``; anything else is an :class:`MmzooError` saying what is there."""
    root = Path(checkpoint)
    index, single = root / INDEX, root / "model.safetensors"
    if index.is_file():
        files = [root / name for name in sorted(set(weight_map(index).values()))]
    elif single.is_file():
        files = [single]
    else:
        pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
        hint = f" (found {', '.join(pickles)}: pickle weights are not loaded; convert them to safetensors)" if pickles else ""
        raise MmzooError(f"checkpoint {root} has no model.safetensors or {INDEX}{hint}")
    for path in files:
        try:
            exists = path.is_file()
        except OSError as e:  # a name the file system refuses (too long)
            raise MmzooError(f"checkpoint shard {path.name[:80]!r} listed in {index.name} cannot be opened "
                             f"({e.strerror})") from None
        if not exists:
            raise MmzooError(f"checkpoint shard {_shown(str(path))} listed in {index.name} does not exist")
    return files


INDEX = "model.safetensors.index.json"


def weight_map(index: Path) -> dict[str, str]:
    """An index's ``weight_map`` (tensor name -> shard file name in the checkpoint directory),
    refusing a malformed index and any file outside the directory."""
    from mmzoo.config import read_json_object

    raw = read_json_object(index)
    if "weight_map" not in raw:
        raise MmzooError(f"{index} has no weight_map (tensor name -> shard file name)")
    mapping = raw["weight_map"]
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise MmzooError(f"{index}: weight_map must map each tensor name to a shard file name, "
                         f"got {json.dumps(mapping)[:80]}")
    if not mapping:
        raise MmzooError(f"{index}: weight_map is empty (it lists no tensor)")
    for key, name in mapping.items():
        if not name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise MmzooError(f"{index}: tensor {_shown(key)} is in {name!r}, outside the checkpoint directory")
    return mapping


def checkpoint_tensors(checkpoint: str | Path) -> dict[str, LazyTensor]:
    """Every tensor of a checkpoint directory as a :class:`LazyTensor` (only the headers are read).
    With an index, each shard must hold exactly the tensors its ``weight_map`` puts there (a
    tensor in another shard, twice, or in none is refused: which copy is read would be a guess)."""
    root = Path(checkpoint)
    index = root / INDEX
    listed = weight_map(index) if index.is_file() else None
    out: dict[str, LazyTensor] = {}
    for path in checkpoint_files(checkpoint):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key in out:
                        raise MmzooError(f"checkpoint tensor {_shown(key)} is in both {_shown(out[key].path.name)} and "
                                         f"{_shown(path.name)}")
                    if listed is not None and listed.get(key) != path.name:
                        where = f"puts it in {_shown(listed[key])}" if key in listed else "does not list it"
                        raise MmzooError(f"{index}: shard {_shown(path.name)} holds tensor {_shown(key)}, "
                                         f"but weight_map {where}")
                    s = f.get_slice(key)
                    dtype = _DTYPES.get(s.get_dtype())
                    if dtype is None:
                        raise MmzooError(f"checkpoint file {path}: tensor {_shown(key)} has dtype {s.get_dtype()}, "
                                         f"which mmzoo does not load")
                    out[key] = LazyTensor(path, key, torch.Size(s.get_shape()), dtype)
        except (SafetensorError, OSError) as e:
            raise _unreadable(path, e) from None
    if listed is not None:
        absent = sorted(set(listed) - set(out))
        if absent:
            raise MmzooError(f"{index}: weight_map lists {len(absent)} tensors its shards do not hold, e.g. "
                             f"{_shown(absent[0])} in {_shown(listed[absent[0]])}")
    return out


def _unreadable(path: Path, error: Exception) -> MmzooError:
    return MmzooError(f"checkpoint file {_shown(str(path))} is not a readable safetensors file ({error}): it may be "
                      f"truncated or corrupt")


def _shown(name: str) -> str:
    """A name from a checkpoint's files as a message shows it: as it is, or quoted with its escapes
    when it holds a character that is not printable (a newline would split the one-line error)."""
    return name if name.isprintable() else repr(name)


def check_names(expected: Mapping[str, torch.Size], given: Mapping, *, source: str, optional=frozenset(),
                floating=frozenset()) -> None:
    """Refuse ``given`` (name -> tensor or :class:`LazyTensor`) unless it has exactly the names of
    ``expected`` (name -> shape; ``optional`` ones may be absent) with their shapes, and floating
    point values for the names in ``floating`` (a float parameter is cast to the run dtype; an
    integer or boolean tensor there would be taken as it is), naming every missing, unexpected,
    mis-shaped or mis-typed tensor."""
    missing = sorted(set(expected) - set(given) - set(optional))
    unexpected = sorted(set(given) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors: {', '.join(map(_shown, missing[:20]))}"
                        f"{' ...' if len(missing) > 20 else ''}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensors: {', '.join(map(_shown, unexpected[:20]))}"
                        f"{' ...' if len(unexpected) > 20 else ''}")
    shapes = [f"{k} {tuple(given[k].shape)} vs {tuple(v)}" for k, v in expected.items()
              if k in given and tuple(given[k].shape) != tuple(v)]
    if shapes:
        problems.append(f"shape mismatch (checkpoint vs model): {'; '.join(shapes[:10])}")
    types = [f"{k} {str(given[k].dtype).replace('torch.', '')}" for k in sorted(floating)
             if k in given and not given[k].dtype.is_floating_point]
    if types:
        problems.append(f"not floating point (the model's weights are): {', '.join(types[:10])}"
                        f"{' ...' if len(types) > 10 else ''}")
    if problems:
        raise MmzooError(f"weights in {source} do not match the model: " + "; ".join(problems))


# ------------------------------------------------------------------------------------- building empty

@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no random init;
    :func:`materialize` fills them), while buffers (rotary frequencies) are computed as usual.

    Not thread-safe: it replaces ``nn.Module.register_parameter`` while it lasts."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def parameter_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """``name -> shape`` of every parameter (tied aliases included) and persistent buffer."""
    out = {name: p.shape for name, p in module.named_parameters(remove_duplicate=False)}
    non_persistent = {f"{prefix}{'.' if prefix else ''}{b}" for prefix, m in module.named_modules()
                      for b in m._non_persistent_buffers_set}
    out.update({name: b.shape for name, b in module.named_buffers() if name not in non_persistent})
    return out


def floating_names(module: nn.Module) -> set[str]:
    """The names (tied aliases included) of the floating-point parameters and persistent buffers."""
    shapes = parameter_shapes(module)
    tensors = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    return {name for name in shapes if tensors[name].is_floating_point()}


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """``alias -> name`` of the parameters shared under a second name (a tied LM head's weight is
    the embedding's)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


# ------------------------------------------------------------------------------------- materializing

def units(module: nn.Module, whole: tuple[type, ...], prefix: str = "") -> Iterator[tuple[str, nn.Module, bool]]:
    """``(prefix, module, is_whole)`` in module order: a module of a ``whole`` type with everything
    under it, or a module's own (direct) parameters."""
    if isinstance(module, whole):
        yield prefix, module, True
        return
    if any(p is not None for p in module._parameters.values()):
        yield prefix, module, False
    for name, child in module._modules.items():
        if child is not None:
            yield from units(child, whole, f"{prefix}{name}.")


def materialize(model: nn.Module, weights: Mapping, *, dtype: torch.dtype, device: torch.device,
                layout: Callable[[str, nn.Module, bool, bool], nn.Module | None] | None = None,
                whole: tuple[type, ...] = (),
                map_files: Callable[[str], bool] = lambda name: False,
                progress: Callable[[int, int], None] | None = None) -> int:
    """Give every parameter of ``model`` its value from ``weights`` (name -> tensor or
    :class:`LazyTensor`, under ``model``'s names), unit by unit (:func:`units`): read, cast to
    ``dtype`` (floating point only), laid out by ``layout(name, unit, is_whole, mapped)`` (a whole
    unit, or a module whose own parameters these are; ``mapped``: every one of its tensors is still a
    view of its file, read when touched; it may return a module that replaces ``unit``), placed
    on ``device``. Where ``map_files(name)`` (the unit's weights used in place on the CPU, with a
    layout that changes none of them), a checkpoint tensor already in ``dtype`` is a view of its
    file's one mapping, as in transformers' loader: nothing is copied and a page is read when first
    touched; otherwise each tensor is read into memory of its own. A tied alias
    (:func:`tied_aliases`) takes the placed tensor of its first name. ``progress(done_bytes,
    total_bytes)`` is called after each unit. Buffers are moved to ``device`` as they are.

    The names and shapes should have been checked (:func:`check_names`). Returns the bytes placed."""
    aliases = tied_aliases(model)
    targets = set(aliases.values())
    placed: dict[str, nn.Parameter] = {}
    tied: list[tuple[nn.Module, str, nn.Parameter]] = []
    handles: dict = {}  # path -> open file, for map_files
    views: set[int] = set()  # data pointers of the unit's tensors that view a mapping of their own
    total = sum(_nbytes(weights[n], dtype) for n, _ in model.named_parameters() if n in weights)
    done = 0
    for prefix, unit, is_whole in list(units(model, whole)):
        mapped = True  # every tensor of the unit read as a view of its file (nothing read yet)
        names = ([n for n, _ in unit.named_parameters(remove_duplicate=False)] if is_whole else
                 [n for n, p in unit._parameters.items() if p is not None])
        for local in names:
            full = prefix + local
            name = aliases.get(full, full)
            owner, leaf = _owner(unit, local)
            if name in placed:  # the first name of a tied parameter, placed already: shared, unless the
                # layout changes it (a layout re-binds the parameter object it is given: it gets one of its own)
                owner._parameters[leaf] = nn.Parameter(placed[name].data, requires_grad=False)
                tied.append((owner, leaf, placed[name]))
                continue
            t = weights[name]
            if isinstance(t, LazyTensor) and map_files(prefix[:-1]) and (t.dtype == dtype or not t.dtype.is_floating_point):
                t = t.load(handles)  # used as it is: a view of the file's one mapping
            elif isinstance(t, LazyTensor):  # copied (cast, laid out, or moved to the device)
                t = t.load()
                if t.is_floating_point() and t.dtype != dtype:
                    t, mapped = t.to(dtype), False
                else:
                    views.add(t.data_ptr())  # a view of its own mapping of the file: copied below if kept as it is
            else:
                t, mapped = (t.to(dtype) if t.is_floating_point() else t), False
            owner._parameters[leaf] = param = nn.Parameter(t, requires_grad=False)
            done += t.nbytes
            if name in targets:
                placed[name] = param  # replaced by the placed one below
        if layout is not None:
            new = layout(prefix[:-1], unit, is_whole, mapped)
            if new is not None and new is not unit:  # the layout replaced the module (a packed linear)
                parent, leaf = _owner(model, prefix[:-1])
                setattr(parent, leaf, new)
                unit = new
        for owner, leaf, shared in tied:
            if owner._parameters.get(leaf) is not None:  # left as it was: the one shared parameter again
                owner._parameters[leaf] = shared
        tied.clear()
        own = [unit, *(unit.parametrizations.modules() if parametrize.is_parametrized(unit) else [])]
        for m in (unit.modules() if is_whole else own):  # a layout may have moved a weight into a parametrization
            for leaf, p in m._parameters.items():
                if p is not None and (p.device != device or p.data_ptr() in views):
                    moved = nn.Parameter(p.data.to(device) if p.device != device else p.data.clone(),
                                         requires_grad=False)
                    for name, q in placed.items():
                        if q is p:
                            placed[name] = moved
                    m._parameters[leaf] = moved
        views.clear()
        release_freed_memory()
        if progress is not None:
            progress(done, total)
    for name, b in list(model.named_buffers()):
        owner, leaf = _owner(model, name)
        if b is not None and b.device != device:
            owner._buffers[leaf] = b.to(device)
    return done


def release_freed_memory() -> None:
    """Give the host memory of the tensors freed so far back to the system (glibc's ``malloc_trim``;
    nothing elsewhere). A unit's host tensors are below glibc's mmap threshold (it grows up to 32 MB)
    and come from its heap, which keeps them after they are freed: the XLA CPU client's buffers are
    allocated between them, so a load grew by twice the weights without this."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, leaf


def _nbytes(t, dtype: torch.dtype) -> int:
    return t.numel() * (dtype.itemsize if t.dtype.is_floating_point else t.dtype.itemsize)


# ------------------------------------------------------------------------------------- fingerprints

class Fingerprint:
    """sha256 over tensors' names, dtypes, shapes and bytes, whatever order they are added in (each
    tensor is hashed on its own, one at a time; the digests are combined in name order)."""

    def __init__(self):
        self._digests: dict[str, str] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().contiguous().cpu()
        h = hashlib.sha256(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy()))
        self._digests[name] = h.hexdigest()

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self._digests):
            h.update(f"{name}|{self._digests[name]}\n".encode())
        return h.hexdigest()[:32]
