"""``mmzoo.load``: a checkpoint directory -> an :class:`Engine` with ``.generate()``."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmzoo import _embeds_file, _registry
from mmzoo.executor._loop import DTYPES
from mmzoo.executor._sharding import mesh_option
from mmzoo.models._embeds import cast_note
from mmzoo._weights import load_strict, read_safetensors
from mmzoo.errors import MmzooError
from mmzoo.executor import Executor, Result
from mmzoo.models._types import Prepared, Request


def read_config(checkpoint: str | Path):
    """transformers' config object of a checkpoint directory, with clear errors for a bad directory."""
    from transformers import AutoConfig

    root = Path(checkpoint)
    if not root.exists():
        raise MmzooError(f"checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise MmzooError(f"checkpoint {root} is not a directory")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise MmzooError(f"checkpoint {root} has no config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise MmzooError(f"{cfg_path} is not valid JSON ({e})") from None
    archs = raw.get("architectures") or []
    if not archs:
        raise MmzooError(f"{cfg_path} names no architectures")
    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except (ValueError, KeyError) as e:
        raise MmzooError(f"{cfg_path}: transformers cannot read this config ({str(e).splitlines()[0]})") from None
    return config, archs[0]


class Engine:
    """A loaded model: processor + modules + executor. Build one with :func:`mmzoo.load`."""

    def __init__(self, *, family, config, processor, model, executor: Executor, checkpoint: Path,
                 eos_token_ids: list[int], towers_fingerprint: str, dtype: str,
                 allow_fingerprint_mismatch: bool = False):
        self.family, self.config, self.processor = family, config, processor
        self.model, self.executor, self.checkpoint = model, executor, checkpoint
        self.eos_token_ids = eos_token_ids
        self.towers_fingerprint, self.dtype = towers_fingerprint, dtype
        self.allow_fingerprint_mismatch = allow_fingerprint_mismatch

    @property
    def hidden_size(self) -> int:
        return self.model.lm.dim

    def prepare(self, request: Request) -> Prepared:
        """Validate and prepare one request on the host (nothing runs on the device)."""
        if request.embeds is not None:
            request = self._with_embeds_file(request)
        run_dtype = DTYPES[self.dtype]
        for name in ("image_embeds", "video_embeds", "audio_embeds", "inputs_embeds"):
            value = getattr(request, name)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != run_dtype:
                request = replace(request, **{name: cast_note(value, run_dtype, name)})
        if not self.model.towers and (request.images or request.videos or getattr(request, "audios", None)):
            raise MmzooError("this engine was loaded without its encoder towers (towers=False); raw media need them")
        return self.family.prepare(self.processor, self.config, request)

    def _with_embeds_file(self, request: Request) -> Request:
        tensors, meta = _embeds_file.read(request.embeds)
        if meta.get("model") != self.family.name:
            raise MmzooError(f"embeds file {request.embeds} was made by model={meta.get('model')}, not {self.family.name}")
        if int(meta.get("lm_hidden_size", -1)) != self.hidden_size:
            raise MmzooError(f"embeds file {request.embeds} has LM hidden size {meta.get('lm_hidden_size')} but this "
                             f"LM's is {self.hidden_size}")
        if meta.get("fingerprint") != self.towers_fingerprint:
            msg = (f"embeds file {request.embeds} was made by encoder weights {meta.get('fingerprint')} "
                   f"(checkpoint {meta.get('checkpoint')}), but {self.checkpoint} has {self.towers_fingerprint}")
            if not self.allow_fingerprint_mismatch:
                raise MmzooError(msg + "; pass allow_fingerprint_mismatch=true to use them anyway")
            print(f"mmzoo: warning: {msg}", file=sys.stderr)
        clash = [f for f in tensors if getattr(request, f) is not None]
        raw = [f"{kind}s" for kind in ("image", "video", "audio")
               if getattr(request, f"{kind}s") and f"{kind}_embeds" in tensors]
        if clash or raw:
            raise MmzooError(f"request gives both embeds={request.embeds} and {clash or raw} for the same inputs")
        return replace(request, embeds=None, **tensors)

    @torch.no_grad()
    def encode(self, *, images: list | None = None, videos: list | None = None,
               audios: list | None = None) -> dict[str, torch.Tensor]:
        """Run only the towers: ``image_embeds`` (+ ``image_grid_thw``), ``video_embeds`` (+ grid),
        ``audio_embeds`` (+ ``audio_lengths``, each clip's rows), the rows in placeholder order."""
        out: dict[str, torch.Tensor] = {}
        for kind, items in (("image", images), ("video", videos), ("audio", audios)):
            if not items:
                continue
            prepared = self.family.prepare(self.processor, self.config, Request(**{f"{kind}s": list(items)}))
            rows = torch.cat([self.executor.encode_media(item) for item in prepared.media])  # item order = row order
            used = prepared.mm_index[prepared.mm_index >= 0]  # the tower rows the prompt reads, in order
            if not np.array_equal(used, np.arange(rows.shape[0])):
                rows = rows[torch.as_tensor(used)]
            out[f"{kind}_embeds"] = rows
            if kind in prepared.grids:
                out[f"{kind}_grid_thw"] = torch.as_tensor(prepared.grids[kind])
            if kind in prepared.lengths:
                out[f"{kind}_lengths"] = torch.as_tensor(prepared.lengths[kind])
        return out

    def embeds_metadata(self) -> dict[str, str]:
        from mmzoo import __version__

        return {"model": self.family.name, "fingerprint": self.towers_fingerprint,
                "lm_hidden_size": str(self.hidden_size), "dtype": self.dtype, "mmzoo_version": __version__,
                "checkpoint": str(self.checkpoint)}

    def decode(self, token_ids: list[int]) -> str:
        return self.processor.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompt: str | Request | list[Request | dict], *, images: list | None = None,
                 videos: list | None = None, audios: list | None = None, max_new_tokens: int = 32,
                 ignore_eos: bool = False,
                 on_result=None) -> Result | list[Result]:
        """Generate for one prompt (returns a :class:`Result`) or for many requests (returns a list).

        A request that fails validation gets a result with ``error`` set; the others still run.
        """
        single = not isinstance(prompt, list)
        if single:
            reqs = [prompt if isinstance(prompt, Request) else
                    Request(prompt=prompt, images=list(images or []), videos=list(videos or []),
                            audios=list(audios or []), max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, id=0)]
        else:
            reqs = [r if isinstance(r, Request) else Request(**{"id": i, **r}) for i, r in enumerate(prompt)]
        prepared, failed = [], {}
        for i, req in enumerate(reqs):
            try:
                prepared.append(self.prepare(req))
            except MmzooError as e:
                if single:
                    raise
                failed[i] = Result(id=req.id, prompt=req.prompt, error=str(e))
                if on_result:
                    on_result(failed[i])
        ran = iter(self.executor.generate(prepared, decode_text=self.decode, on_result=on_result))
        results = [failed[i] if i in failed else next(ran) for i in range(len(reqs))]
        if single and results[0].error:
            raise MmzooError(results[0].error)
        return results[0] if single else results


def _eos_ids(checkpoint: Path, config, tokenizer) -> list[int]:
    from transformers import GenerationConfig

    eos: Any = None
    if (checkpoint / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(str(checkpoint), local_files_only=True).eos_token_id
    if eos is None:
        eos = getattr(config, "eos_token_id", None) or tokenizer.eos_token_id
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]


def load(checkpoint: str | Path | None = None, *, model: str | Any | None = None, executor: str | Executor = "xla",
         attention: str | Any = "sdpa", dtype: str = "float32", towers: bool = True,
         allow_fingerprint_mismatch: bool = False, verbose: bool = False, mesh=None, **executor_kwargs) -> Engine:
    """Load a Hugging Face checkpoint directory into an :class:`Engine`.

    Args:
        checkpoint: the directory (config.json, safetensors weights, tokenizer and processor files);
            None for the model family's embedded default.
        model: a ``conf/model`` name (e.g. ``"qwen2_vl"``) or family object; None: from config.json.
        executor: ``"xla"``, ``"eager"`` or an :class:`~mmzoo.executor.Executor`.
        attention: ``"sdpa"``, ``"pallas"``, ``"eager"`` or a backend object.
        dtype: ``"float32"`` or ``"bfloat16"``.
        towers: build and load the encoder towers; False serves precomputed embeddings and text only
            (the tower weights are only hashed, to check embeddings files against them).
        allow_fingerprint_mismatch: accept embeddings files made by other encoder weights (warns).
        mesh: split the model over a device mesh with torch_xla SPMD (``executor="xla"``): a
            ``conf/mesh`` name (``"tp"``, ``"dp_tp"``), ``{"data": d, "model": m}`` or a
            :class:`~mmzoo.executor.MeshSpec`; None or ``"single"``: one device, no SPMD.
        executor_kwargs: overrides of the executor config (``max_model_len=``, ``max_batch=``, ...).
    """
    from transformers import AutoProcessor

    family = _registry.build_option("model", model) if isinstance(model, str) else model
    if checkpoint is None:
        if family is None:
            raise MmzooError("give a checkpoint directory, or a model name to use its embedded default")
        checkpoint = family.default_checkpoint()
    checkpoint = Path(checkpoint)
    config, arch = read_config(checkpoint)
    if family is None:
        family = _registry.family_for(arch)
    elif arch not in family.architectures:
        raise MmzooError(f"{checkpoint}/config.json is a {arch} checkpoint, which model={family.name} does not "
                         f"support (it takes {', '.join(family.architectures)})")
    attn = _registry.build_option("attention", attention) if isinstance(attention, str) else attention
    exe = _registry.build_option("executor", executor, **executor_kwargs) if isinstance(executor, str) else executor
    if hasattr(family, "encoder_buckets") and hasattr(exe, "encoder_buckets"):  # towers whose rows are whole items
        sizes = family.encoder_buckets(config, max_model_len=exe.max_model_len, max_media_rows=exe.max_media_rows())
        for tower, buckets in sizes.items():
            exe.encoder_buckets.setdefault(tower, sorted(int(n) for n in buckets))  # the executor config wins
    modules = family.build(config, attn)
    weights = family.convert_weights(read_safetensors(checkpoint), config)
    tower_weights = {k: v for k, v in weights.items() if k.startswith("towers.")}
    fingerprint = _embeds_file.fingerprint(tower_weights)
    if not towers:
        modules.towers = torch.nn.ModuleDict()
        weights = {k: v for k, v in weights.items() if not k.startswith("towers.")}
    load_strict(modules, weights, source=str(checkpoint))
    mesh = mesh_option(mesh)
    if mesh is not None and mesh.spmd:  # validated against the modules before anything is placed
        if not hasattr(exe, "use_mesh"):
            raise MmzooError(f"mesh {mesh} needs executor=xla; the {exe.name} executor runs on one device")
        exe.use_mesh(mesh, modules)
        if verbose:
            print(f"mmzoo: {exe.sharding.describe()}", file=sys.stderr)
    processor = AutoProcessor.from_pretrained(str(checkpoint), local_files_only=True)
    eos = _eos_ids(checkpoint, config, processor.tokenizer)
    exe.setup(modules, dtype=dtype, eos_token_ids=eos)
    if getattr(exe, "do_warmup", False):
        secs = exe.warmup(lambda tower, rows: family.dummy_media(config, tower, rows))
        if verbose:
            print(f"mmzoo: warmup compiled {exe.compiled_graphs()} graphs in {secs:.1f} s", file=sys.stderr)
    return Engine(family=family, config=config, processor=processor, model=modules, executor=exe,
                  checkpoint=checkpoint, eos_token_ids=eos, towers_fingerprint=fingerprint, dtype=dtype,
                  allow_fingerprint_mismatch=allow_fingerprint_mismatch)
