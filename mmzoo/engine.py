"""A composed config -> an :class:`Engine`: the pipeline's modules built, its weights loaded, an executor set up.

:func:`build` is the one path from a config to an engine (the CLI's ``run(cfg)`` and
:func:`load` both end there): the family node and the three components are instantiated from
``cfg.model`` (each module with its own attention backend), composed into a
:class:`~mmzoo.models.MultimodalLM`, loaded strictly from the checkpoint (or left at a seeded
random init when ``weights=random``), and handed to the executor.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import queue
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from mmzoo import _weights
from mmzoo import config as _config
from mmzoo import embeds_file
from mmzoo.config import instantiate_part, read_config
from mmzoo.encoders import Encoder
from mmzoo.errors import MmzooError
from mmzoo.executor import Drain, Executor, generate
from mmzoo.limits import Limits, check_request, prompt_chars_bound
from mmzoo.lms.decoder import layer_windows
from mmzoo.models import Family, MultimodalLM, Tower
from mmzoo.models._prompt import media_from_messages
from mmzoo.structured import Grammars
from mmzoo.types import DTYPES, Prepared, Request, Result, StreamOutput

COMPONENTS = ("encoder", "adapter", "lm")


class Engine:
    """A loaded pipeline: processor + family + modules + executor. Build one with :func:`mmzoo.load`.

    Attributes:
        cfg: the composed config it was built from (``OmegaConf.to_yaml(engine.cfg)``).
        family: the model family (:class:`~mmzoo.models.Family`): request preparation.
        config: the checkpoint's transformers config.
        model: the :class:`~mmzoo.models.MultimodalLM` (the executor's: placed and laid out by it).
    """

    def __init__(self, *, cfg: DictConfig, family, config, processor, model, executor: Executor, checkpoint: Path,
                 eos_token_ids: list[int], towers_fingerprint: str | Callable[[], str], dtype: str,
                 allow_fingerprint_mismatch: bool = False):
        self.cfg, self.family, self.config, self.processor = cfg, family, config, processor
        self.model, self.executor, self.checkpoint = model, executor, checkpoint
        self.eos_token_ids = eos_token_ids
        self.grammars = Grammars(processor.tokenizer, vocab_size=model.lm.vocab_size, eos_token_ids=eos_token_ids)
        self._fingerprint, self.dtype = towers_fingerprint, dtype
        self.allow_fingerprint_mismatch = allow_fingerprint_mismatch
        self._lock = threading.RLock()  # one request stream at a time: the cache and compiled steps are shared
        self._stream_lock = threading.Lock()
        self._streams = None  # the EngineLoop of stream(), made on first use
        # host preparation runs in any number of threads at once (a server's handlers), each on a copy of
        # the processor taken from this pool (a tokenizer must not be used by two threads at once)
        self._processors: queue.SimpleQueue = queue.SimpleQueue()
        self.limits = Limits.from_config(cfg.get("limits"))
        self.max_prompt_chars = prompt_chars_bound(processor.tokenizer, executor.max_model_len) \
            if self.limits.max_prompt_chars == "auto" else self.limits.max_prompt_chars

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def towers_fingerprint(self) -> str:
        """The encoder towers' weights' fingerprint (:class:`mmzoo._weights.Fingerprint`), which an
        embeddings file carries: computed from the checkpoint's files the first time it is asked for
        (only embeddings files need it, and hashing a real tower's bytes takes seconds)."""
        if callable(self._fingerprint):
            self._fingerprint = self._fingerprint()
        return self._fingerprint

    @property
    def hidden_size(self) -> int:
        return self.model.lm.dim

    def prepare(self, request: Request) -> Prepared:
        """Validate and prepare one request on the host (nothing runs on the device): the family's
        checks, then the engine's own (token ids inside the vocabulary, the prompt and
        ``max_new_tokens`` within ``max_model_len``)."""
        if request.embeds is not None:
            request = self._with_embeds_file(request)
        run_dtype = DTYPES[self.dtype]
        for name in ("image_embeds", "video_embeds", "audio_embeds", "inputs_embeds"):
            value = getattr(request, name)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != run_dtype:
                request = replace(request, **{name: cast_note(value, run_dtype, name)})
        request = media_from_messages(request)  # parts that carry their image, video or audio
        if not self.model.towers and (request.images or request.videos or request.audios):
            raise MmzooError("this engine was loaded without its encoder towers (towers=False); raw media need them")
        check_request(request, self.limits, max_prompt_chars=self.max_prompt_chars)
        max_len = self.executor.max_model_len
        if request.max_new_tokens >= max_len:
            raise MmzooError(f"max_new_tokens={request.max_new_tokens} can never be reached: max_model_len={max_len} "
                             f"holds the prompt and the generated tokens together")
        top = self.executor.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(request, name)
            if k is not None and (k > top or top == 0):
                raise MmzooError(f"{name}={k} is more than this engine computes: executor.max_logprobs="
                                 f"{top}" + (" (log-probabilities are off)" if top == 0 else ""))
        if request.n > self.executor.max_batch:
            raise MmzooError(f"n={request.n} samples need {request.n} KV-cache slots at once; executor.max_batch="
                             f"{self.executor.max_batch}")
        if request.prompt_logprobs is not None and not self.executor.score_prompts:
            raise MmzooError(f"prompt_logprobs={request.prompt_logprobs}: this engine does not score prompts "
                             f"(executor.score_prompts=false)")
        if request.prompt_logprobs is not None and request.inputs_embeds is not None:
            raise MmzooError("prompt_logprobs needs the prompt's token ids; inputs_embeds has none")
        guide = None
        if request.structured_outputs is not None:
            if not self.executor.structured_outputs:
                raise MmzooError("structured_outputs: this engine does not constrain outputs "
                                 "(executor.structured_outputs=false)")
            guide = functools.partial(self.grammars.matcher, self.grammars.compile(request.structured_outputs))
        vocab = self.model.lm.vocab_size
        for name in ("prompt_token_ids", "stop_token_ids"):
            ids = getattr(request, name) or []
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise MmzooError(f"{name} holds {len(bad)} ids outside the vocabulary (size {vocab}), e.g. {bad[0]}")
        with self._processor() as processor:
            prepared = self.family.prepare(request, processor, hidden_size=self.hidden_size)
        if len(prepared.input_ids) >= max_len:
            raise MmzooError(f"the prompt is {len(prepared.input_ids)} tokens (media placeholders included); "
                             f"max_model_len={max_len} leaves no room to generate")
        prepared.guide = guide
        return prepared

    @contextlib.contextmanager
    def _processor(self):
        """A processor this thread alone uses until the block ends (a copy, made when none is free)."""
        try:
            processor = self._processors.get_nowait()
        except queue.Empty:
            processor = copy.deepcopy(self.processor)
        try:
            yield processor
        finally:
            self._processors.put(processor)

    def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids (no chat template), within the prompt limit; safe from any thread."""
        if self.max_prompt_chars and len(text) > self.max_prompt_chars:
            check_request(Request(prompt=text), self.limits, max_prompt_chars=self.max_prompt_chars)
        with self._processor() as processor:
            return processor.tokenizer(text)["input_ids"]

    def _with_embeds_file(self, request: Request) -> Request:
        tensors, meta = embeds_file.read(request.embeds)
        if meta.get("model") != self.name:
            raise MmzooError(f"embeds file {request.embeds} was made by model={meta.get('model')}, not {self.name}")
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
        with self._lock:
            return self._encode(images=images, videos=videos, audios=audios)

    def _encode(self, *, images, videos, audios) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for kind, items in (("image", images), ("video", videos), ("audio", audios)):
            if not items:
                continue
            prepared = self.prepare(Request(**{f"{kind}s": list(items)}))
            self.executor.warm_for([prepared], self._dummy_media(), generate=False)
            rows = torch.cat([self.executor.encode_media(item) for item in prepared.media])  # item order = row order
            used = prepared.mm_index[prepared.mm_index >= 0]  # the tower rows the prompt reads, in order
            if not np.array_equal(used, np.arange(rows.shape[0])):
                rows = rows[torch.as_tensor(used)]
            out[f"{kind}_embeds"] = rows
            if kind in prepared.grids:
                out[f"{kind}_grid_thw"] = torch.as_tensor(prepared.grids[kind])
            if kind in prepared.lengths:
                out[f"{kind}_lengths"] = torch.as_tensor(prepared.lengths[kind])
            out.update({name: torch.as_tensor(value) for name, value in prepared.extras.items()})
        return out

    def embeds_metadata(self) -> dict[str, str]:
        from mmzoo import __version__

        return {"model": self.name, "fingerprint": self.towers_fingerprint,
                "lm_hidden_size": str(self.hidden_size), "dtype": self.dtype, "mmzoo_version": __version__,
                "checkpoint": str(self.checkpoint)}

    def decode(self, token_ids: list[int]) -> str:
        return self.processor.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompt: str | Request | dict | list[str | Request | dict] = "", *,
                 on_result: Callable[[Result], None] | None = None, drain: Drain | None = None,
                 **fields: Any) -> Result | list[Result]:
        """Generate for one request (returns a :class:`Result`) or a list of them (returns a list).

        A request is a :class:`Request`, a dict of its fields (the ``requests=`` file's schema) or a
        prompt string; ``fields`` (``images=``, ``max_new_tokens=``, ``temperature=``, any Request
        field) apply to every request given as a string or dict, as the command line's do to a
        requests file. A single bad request raises :class:`MmzooError`; in a list it gets a result
        with ``error`` set and the others still run.

        Safe to call from several threads: calls on one engine run one after the other (the KV
        cache and the compiled steps are the engine's). ``drain`` (:class:`~mmzoo.executor.Drain`),
        once set, admits no more requests: the running ones finish (within its timeout) and the
        rest come back with ``finish_reason="abort"``.
        """
        single = not isinstance(prompt, list)
        reqs: list[Request | Result] = []
        for i, item in enumerate([prompt] if single else prompt):
            try:
                reqs.append(self._request(item, fields, default_id=i))
            except MmzooError as e:
                if single:
                    raise
                reqs.append(Result(id=_id_of(item, i), prompt=str(_field_of(item, "prompt", "")), error=str(e)))
        with self._lock:
            prepared, failed = [], {}
            for i, req in enumerate(reqs):
                if isinstance(req, Result):  # refused by the schema above
                    failed[i] = req
                else:
                    try:
                        prepared.append(self.prepare(req))
                    except MmzooError as e:
                        if single:
                            raise
                        failed[i] = Result(id=req.id, prompt=req.prompt, error=str(e))
                if i in failed and on_result:
                    on_result(failed[i])
            self.executor.warm_for(prepared, self._dummy_media())
            ran = iter(generate(self.executor, prepared, decode_text=self.decode, on_result=on_result, drain=drain))
            results = [failed[i] if i in failed else next(ran) for i in range(len(reqs))]
        if single and results[0].error:
            raise MmzooError(results[0].error)
        return results[0] if single else results

    def stream(self, prompt: str | Request | dict = "", **fields: Any) -> Iterator[StreamOutput]:
        """Generate for one request (as :meth:`generate` takes it), yielding a :class:`StreamOutput`
        per token as it is decoded: the text it adds (held back while a stop string could still
        match, or inside a multi-byte character: the server's rule), its id and its logprobs entry;
        the last has ``finished`` and the :class:`Result`.

        Streams share one engine loop thread (:class:`~mmzoo.engine_loop.EngineLoop`): several
        iterated together, from one thread or many, are batched together as a server's requests
        are. Leaving the loop early (``break``) frees the request's slot. While streams run, the
        engine's :meth:`generate` waits for them to finish."""
        from mmzoo.engine_loop import EngineLoop, QueueStream
        from mmzoo.text import TextStream

        request = self._request(prompt, fields, default_id=0)
        if request.n != 1:
            raise MmzooError(f"n={request.n}: stream() yields one sequence; generate() returns n samples")
        prepared = self.prepare(request)
        if self.executor.warms_per_run:
            with self._lock:
                self.executor.warm_for([prepared], self._dummy_media())
        with self._stream_lock:
            if self._streams is None:
                self._streams = EngineLoop(self, idle_exit=True)
        stream = self._streams.submit(prepared, QueueStream())
        text, done = TextStream(self.decode, request.stop), False
        try:
            while True:
                item = stream.get()
                if item is None:
                    break
                token, logprob = item  # the loop ends the sequence at a stop string's match
                yield StreamOutput(text=text.push(token), token_ids=[token],
                                   logprobs=None if logprob is None else [logprob])
            done = True
            result = stream.result
            if result.error and not result.token_ids:
                raise MmzooError(result.error)
            yield StreamOutput(text=text.flush(), finished=True, result=result)
        finally:
            if not done:  # the caller left the loop: free the slot now
                self._streams.cancel(stream)

    def warm(self, requests: list[str | Request | dict], **fields: Any) -> float:
        """Compile now the graphs ``requests`` (as :meth:`generate` takes them) can hit, without
        running them (``warmup=needed``; with ``all`` everything is compiled already), so that a
        later :meth:`generate` of them compiles nothing: a benchmark's untimed priming. Requests
        that cannot run are skipped. Returns the seconds spent."""
        prepared = []
        for i, item in enumerate(requests):
            try:
                prepared.append(self.prepare(self._request(item, fields, default_id=i)))
            except MmzooError:
                continue
        with self._lock:
            return self.executor.warm_for(prepared, self._dummy_media())

    def _dummy_media(self):
        """Zero tower inputs of a given row count (for compiling a tower), or None without towers."""
        return (lambda tower, rows: self.family.dummy_media(rows)) if self.model.towers else None

    @staticmethod
    def _request(item: Any, fields: dict, *, default_id: int) -> Request:
        """One request from what the API was given (see :meth:`generate`)."""
        if isinstance(item, Request):
            if fields:
                raise MmzooError(f"give {sorted(fields)} inside the Request, not beside it")
            return item
        if isinstance(item, str):
            return Request.parse({"id": default_id, **fields, "prompt": item}, where=f"request {default_id}")
        if isinstance(item, Mapping):
            return Request.parse({"id": default_id, **fields, **item}, where=f"request {_id_of(item, default_id)}")
        raise MmzooError(f"request {default_id}: a Request, a dict of its fields or a prompt string, "
                         f"not {type(item).__name__}")


def _field_of(item: Any, name: str, default: Any) -> Any:
    if isinstance(item, Request):
        return getattr(item, name)
    return item.get(name, default) if isinstance(item, Mapping) else default


def _id_of(item: Any, index: int) -> Any:
    value = _field_of(item, "id", None)
    return value if isinstance(value, (int, str)) and not isinstance(value, bool) else index


def cast_note(t: torch.Tensor, dtype: torch.dtype, field: str) -> torch.Tensor:
    """``t`` in the run dtype, saying so when it was not."""
    if t.dtype != dtype:
        print(f"mmzoo: note: {field} is {str(t.dtype).replace('torch.', '')}; cast to "
              f"{str(dtype).replace('torch.', '')}", file=sys.stderr)
        t = t.to(dtype)
    return t


def _check_layer_windows(config, lm, source: str, name: str) -> None:
    """The LM's layers attend as the checkpoint's ``layer_types`` and ``sliding_window`` say: a
    conf file that does not pass them (``lm.layer_types``, ``lm.sliding_window``) would build full
    attention where the checkpoint slides."""
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None) or []
    n = min(len(kinds), len(lm.layers))  # a depth set by hand (model.lm.num_layers) is the loader's to check
    want = layer_windows(len(kinds), kinds, getattr(text, "sliding_window", None))[:n]
    got = [layer.attn.sliding_window for layer in lm.layers[:n]]
    if want != got:
        raise MmzooError(f"{source}: the text model's layers attend with sliding windows {want} (layer_types, "
                         f"sliding_window), but model={name}'s LM was built with {got}: its conf passes "
                         f"lm.layer_types and lm.sliding_window from the checkpoint")


def _eos_ids(checkpoint: Path, config, tokenizer, *, vocab_size: int) -> list[int]:
    """The ids generation stops at: generation_config.json's ``eos_token_id``, else config.json's,
    else the tokenizer's; each must be a token id of the LM's ``vocab_size`` rows."""
    import json

    eos: Any = None
    path = checkpoint / "generation_config.json"
    if path.is_file():
        eos, where = _config.read_json_object(path).get("eos_token_id"), f"{path}: eos_token_id"
    if eos is None:
        eos, where = getattr(config, "eos_token_id", None), f"{checkpoint}/config.json: eos_token_id"
    if eos is None:
        eos, where = tokenizer.eos_token_id, f"the tokenizer's eos_token ({tokenizer.eos_token!r}) id"
    if eos is None:
        return []
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    bad = [e for e in ids if not (isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab_size)]
    if bad or not ids:
        which = f"; {json.dumps(bad[0])} is not" if bad and len(ids) > 1 else ""
        raise MmzooError(f"{where}={json.dumps(eos)} must be a token id of the vocabulary (0 to {vocab_size - 1}) "
                         f"or a non-empty list of them{which}")
    return ids


def backends_of(module: torch.nn.Module) -> list[str]:
    """The attention backends a module's layers use (names, in order of first use)."""
    from mmzoo.layers import Attention

    names: list[str] = []
    for m in module.modules():
        if isinstance(m, Attention) and m.attn_fn.name not in names:
            names.append(m.attn_fn.name)
    return names


def describe(cfg: DictConfig, model: MultimodalLM) -> str:
    """``encoder=qwen2_vl_vit(pallas) adapter=PatchMerger lm=qwen2(sdpa)``: each module's builder and backend."""
    parts = []
    for name in COMPONENTS:
        module = model.lm if name == "lm" else next((getattr(t, name) for t in model.towers.values()), None)
        if module is None:
            continue
        target = str(cfg.model[name].get("_target_", "?")).rsplit(".", 1)[-1]
        backends = backends_of(module)
        parts.append(f"{name}={target}" + (f"({','.join(backends)})" if backends else ""))
    return " ".join(parts)


def build_model(cfg: DictConfig, *, attention=None, towers: bool = True, empty: bool = False):
    """``(family, MultimodalLM)`` from ``cfg.model``: the family node and the components instantiated
    (random init, seeded by ``cfg.init_seed``; ``empty``: parameters on the meta device, for the
    checkpoint to fill), each LM/encoder with its configured backend unless ``attention`` (a
    backend object) replaces the pipeline-wide one."""
    mcfg = cfg.model
    family = instantiate_part(mcfg.family, "model.family")
    torch.manual_seed(int(cfg.get("init_seed", 0)))
    parts = {}
    with _weights.parameters_on_meta() if empty else contextlib.nullcontext():
        for name in COMPONENTS:
            if name != "lm" and not towers:
                continue
            node = mcfg[name]
            # the pipeline's backend object goes to the components whose attention is the pipeline's
            # (``attention: ${attention}``: the very node of the root's ``attention``)
            uses_pipeline = "attention" in node and node.attention is cfg.get("attention")
            kwargs = {"attention": attention} if attention is not None and uses_pipeline else {}
            parts[name] = instantiate_part(node, f"model.{name}", **kwargs)
    if towers and not isinstance(parts["encoder"], Encoder):  # the contract the executor reads (rows, rotary input)
        raise MmzooError(f"model.encoder builds a {type(parts['encoder']).__name__}, not an mmzoo.encoders.Encoder "
                         f"(derive it from Encoder: the executor reads its rows_per_item and rotary_input)")
    lm = parts["lm"]
    axes = lm.rotary.num_axes
    if family.position_axes != axes:
        raise MmzooError(f"model.family gives {family.position_axes}-axis positions but model.lm's rotary reads {axes} "
                         f"(an M-RoPE LM needs mrope_section; a 1-D RoPE LM a family without M-RoPE)")
    levels = family.deepstack_levels
    taps = len(getattr(parts.get("adapter"), "deepstack", None) or ()) if towers else levels
    if taps != levels:
        raise MmzooError(f"model.adapter gives {taps} DeepStack levels per row but model.family takes {levels} "
                         f"(deepstack_taps and deepstack_levels must agree)")
    tower = {family.tower: Tower(encoder=parts["encoder"], adapter=parts["adapter"])} if towers else {}
    return family, MultimodalLM(lm=lm, towers=tower, bidirectional_token=family.bidirectional_token,
                                deepstack_levels=levels)


def memory_plan(exe: Executor, model: MultimodalLM, dtype: str) -> dict[str, int]:
    """Bytes ``exe.setup`` will allocate for ``model`` (built, parameters possibly on the meta
    device; ``exe`` resolved) in ``dtype``: ``weights`` (as the executor lays them out),
    ``kv_cache``, ``media``."""
    size = DTYPES[dtype].itemsize
    lm = model.lm
    weights = sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in model.parameters())
    weights += exe.layout_extra_params(model) * size
    kv = 2 * lm.num_layers * exe.max_batch * lm.num_kv_heads * exe.max_model_len * lm.head_dim * size
    return {"weights": weights, "kv_cache": kv, "media": exe.buckets.media_rows * model.media_width * size}


def check_memory(exe: Executor, model: MultimodalLM, dtype: str, *, verbose: bool = False) -> dict[str, int]:
    """The memory ``exe.setup`` will allocate for ``model`` in ``dtype`` (:func:`memory_plan`),
    printed when ``verbose``; a plan larger than the memory available to the executor's device is
    refused before anything is allocated, naming what to lower."""
    plan = memory_plan(exe, model, dtype)
    need = sum(plan.values())
    free = exe.memory_available()
    kv = (f"KV cache {_gb(plan['kv_cache'])} (max_batch={exe.max_batch} x max_model_len={exe.max_model_len} "
          f"x {model.lm.num_layers} layers)")
    line = (f"weights {_gb(plan['weights'])} ({dtype}) + {kv} + media buffer {_gb(plan['media'])} = {_gb(need)}"
            + (f"; {_gb(free)} available" if free is not None else ""))
    if verbose:
        print(f"mmzoo: memory plan: {line}", file=sys.stderr)
    if free is not None and need > free:
        lower = ["dtype=bfloat16 (half the weights and the KV cache)"] if dtype == "float32" else []
        lower.append(f"executor.max_model_len (now {exe.max_model_len}) or executor.max_batch (now {exe.max_batch}) "
                     f"for the KV cache")
        raise MmzooError(f"the model does not fit: it needs {_gb(need)} ({line.split(' = ')[0]}) but {_gb(free)} "
                         f"of memory is available; lower {', or '.join(lower)}")
    return plan


def _towers_fingerprint(state: dict) -> str:
    """The fingerprint of the tower tensors of ``state`` (the checkpoint's, under the composition's
    names: tensors or lazy ones, read one at a time)."""
    fp = _weights.Fingerprint()
    for key, t in state.items():
        if key.startswith("towers."):
            fp.add(key, _weights.load(t))
    return fp.hexdigest()


def _random_fingerprint(cfg: DictConfig) -> str:
    """The fingerprint of seeded random towers: their init seed and their resolved configs decide them."""
    import hashlib

    parts = [OmegaConf.to_yaml(cfg.model[name], resolve=True) for name in ("encoder", "adapter")]
    text = f"random|{cfg.get('init_seed', 0)}|" + "|".join(parts)
    return "random-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class _LoadReport:
    """Says what the loader is doing: a line per quarter of the weights placed, then the total."""

    def __init__(self, checkpoint: Path | None, verbose: bool):
        self.checkpoint, self.verbose, self.next, self.bytes = checkpoint, verbose, 0.25, 0
        self.t0 = time.perf_counter()

    def progress(self, done: int, total: int) -> None:
        self.bytes = done
        if self.verbose and self.checkpoint is not None and total >= 1e9 and done / total >= self.next and done < total:
            print(f"mmzoo: loading weights: {_gb(done)} of {_gb(total)} placed "
                  f"({time.perf_counter() - self.t0:.1f} s)", file=sys.stderr, flush=True)
            while done / total >= self.next:
                self.next += 0.25

    def done(self, secs: float, dtype: str) -> None:
        if self.verbose:
            what = f"from {self.checkpoint}" if self.checkpoint is not None else "(weights=random)"
            print(f"mmzoo: placed {_gb(self.bytes)} of weights ({dtype}) {what} in {secs:.1f} s",
                  file=sys.stderr, flush=True)


def build(cfg: DictConfig, *, executor: Executor | None = None, attention=None, towers: bool = True,
          allow_fingerprint_mismatch: bool | None = None, verbose: bool = False) -> Engine:
    """An :class:`Engine` from a composed config (:func:`mmzoo.config.compose`).

    Args:
        cfg: the composed config (``infer`` or a recipe): ``checkpoint``, ``weights``, ``model``,
            ``attention``, ``executor``, ``mesh``, ``dtype``.
        executor: an executor object to use instead of ``cfg.executor``.
        attention: a backend object for every module that takes the pipeline's backend.
        towers: build and load the encoder towers; False serves precomputed embeddings and text only
            (the tower weights are only hashed, to check embeddings files against them).
        allow_fingerprint_mismatch: accept embeddings files made by other encoder weights (warns);
            None: ``cfg.allow_fingerprint_mismatch``.
    """
    from hydra.utils import get_class

    from mmzoo.checkpoint import read_processor
    from mmzoo.executor import mesh_option

    name = cfg.model.get("name", "?")
    checkpoint = cfg.get("checkpoint")
    weights = cfg.get("weights", "checkpoint")
    if weights not in ("checkpoint", "random"):
        raise MmzooError(f"weights={weights!r}: choose checkpoint (load them) or random (a seeded random init)")
    if checkpoint is None:
        raise MmzooError(f"model={name} has no embedded default checkpoint: give checkpoint=DIR (its config.json, "
                         f"tokenizer and processor{', and weights' if weights == 'checkpoint' else ''})")
    checkpoint = Path(checkpoint)
    hf_config, arch = read_config(checkpoint)
    archs = list(cfg.model.get("architectures") or [])
    if weights == "checkpoint" and archs and arch not in archs:
        zoo = {n: list(_config._model_node(n, None).get("architectures") or []) for n in _config.options("model")}
        if not any(arch in a for a in zoo.values()):
            listed = ", ".join(f"{n} ({' '.join(a)})" for n, a in zoo.items())
            raise MmzooError(f"config.json architecture {arch!r} is not supported; the zoo has {listed}")
        raise MmzooError(f"{checkpoint}/config.json is a {arch} checkpoint, which model={name} does not support "
                         f"(it takes {', '.join(archs)})")
    try:  # the family's own checkpoint: what the family relies on in it is checked before anything is built
        family_class = get_class(cfg.model.family._target_) if arch in archs else None
    except Exception:  # noqa: BLE001 - a bad family node: build_model's instantiate_part names it
        family_class = None
    if isinstance(family_class, type) and issubclass(family_class, Family):
        family_class.check_config(hf_config, _config.read_config_json(checkpoint), f"{checkpoint}/config.json")
    dtype = str(cfg.get("dtype", "float32"))
    if dtype not in DTYPES:
        raise MmzooError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    family, model = build_model(cfg, attention=attention, towers=towers, empty=weights == "checkpoint")
    _check_layer_windows(hf_config, model.lm, f"{checkpoint}/config.json", name)
    processor = read_processor(checkpoint)
    family.check_processor(processor, vocab_size=model.lm.vocab_size, source=checkpoint)
    eos = _eos_ids(checkpoint, hf_config, processor.tokenizer, vocab_size=model.lm.vocab_size)
    exe = executor if executor is not None else instantiate_part(cfg.executor, "executor")
    if verbose:
        print(f"mmzoo: model={name} {describe(cfg, model)} executor={exe.describe()} dtype={dtype}", file=sys.stderr)
        if exe.name == "xla" and dtype == "bfloat16" and os.environ.get("PJRT_DEVICE") == "CPU":
            print("mmzoo: note: XLA's CPU client has no fast bfloat16 matrix product (a bf16 model decodes about "
                  "10x slower than in float32 there); on a CPU, executor=eager runs bfloat16 at full speed",
                  file=sys.stderr)
    state = None
    if weights == "checkpoint":
        state = family.convert_weights(_weights.checkpoint_tensors(checkpoint))  # headers only: nothing read yet
        if model.lm.tie_word_embeddings:
            state.pop("lm.lm_head.weight", None)  # the embedding is the head
        tower_state = {k: state.pop(k) for k in [k for k in state if k.startswith("towers.")] if not towers}
        _weights.check_names(_weights.parameter_shapes(model), state, source=str(checkpoint),
                             optional=set(_weights.tied_aliases(model)), floating=_weights.floating_names(model))
        fingerprint = functools.partial(_towers_fingerprint, {**tower_state, **state})
    else:
        fingerprint = _random_fingerprint(cfg)
        print(f"mmzoo: weights=random: the modules keep their seeded random init (init_seed="
              f"{cfg.get('init_seed', 0)}); {checkpoint} gives only the config, tokenizer and processor", file=sys.stderr)
    mesh = mesh_option(cfg.get("mesh"))
    if mesh is not None and mesh.spmd:  # validated against the modules before anything is placed
        exe.use_mesh(mesh, model, plan=family.tp_plan)
        if verbose:
            print(f"mmzoo: {exe.sharding.describe()}", file=sys.stderr)
    exe.resolve(model, family)  # every size policy and auto option, decided once
    if verbose:
        print(f"mmzoo: executor: {exe.resolved()}", file=sys.stderr)
    check_memory(exe, model, dtype, verbose=verbose)
    t0 = time.perf_counter()
    report = _LoadReport(checkpoint if weights == "checkpoint" else None, verbose)
    exe.setup(model, dtype=dtype, eos_token_ids=eos, take_ownership=True,  # built for this executor alone
              weights=state, progress=report.progress)
    report.done(time.perf_counter() - t0, dtype)
    if exe.do_warmup:
        secs = exe.warmup(lambda tower, rows: family.dummy_media(rows))
        if verbose:
            print(f"mmzoo: warmup compiled {exe.compiled_graphs()} graphs in {secs:.1f} s", file=sys.stderr)
    if allow_fingerprint_mismatch is None:
        allow_fingerprint_mismatch = bool(cfg.get("allow_fingerprint_mismatch", False))
    return Engine(cfg=cfg, family=family, config=hf_config, processor=processor, model=exe.model, executor=exe,
                  checkpoint=checkpoint, eos_token_ids=eos, towers_fingerprint=fingerprint, dtype=dtype,
                  allow_fingerprint_mismatch=allow_fingerprint_mismatch)


def load(checkpoint: str | Path | None = None, *, model: str | None = None, executor: str | Executor = "xla",
         attention: str | Any = "sdpa", dtype: str = "float32", towers: bool = True,
         allow_fingerprint_mismatch: bool = False, verbose: bool = False, mesh=None, config_dir=None,
         warmup: str | bool = "all", overrides: list[str] | tuple = (), **executor_kwargs) -> Engine:
    """Load a Hugging Face checkpoint directory into an :class:`Engine`.

    The pipeline is composed from the same config tree as ``python -m mmzoo.infer`` (the zoo's
    ``conf/`` plus ``config_dir``), so ``load(d, model="mine", config_dir="myconf")`` builds what
    ``python -m mmzoo.infer --config-dir myconf model=mine checkpoint=d`` builds.

    Args:
        checkpoint: the directory (config.json, safetensors weights, tokenizer and processor files);
            None for the model's embedded default.
        model: a ``conf/model`` option (e.g. ``"qwen2_vl"``); None: from config.json's architectures.
        executor: ``"xla"``, ``"eager"`` or an :class:`~mmzoo.executor.Executor`.
        attention: ``"sdpa"``, ``"pallas"``, ``"eager"`` or a backend object, for every module that
            takes the pipeline's backend (``overrides=["model.encoder.attention=pallas"]`` sets one).
        dtype: ``"float32"`` or ``"bfloat16"``.
        towers: build and load the encoder towers; False serves precomputed embeddings and text only.
        allow_fingerprint_mismatch: accept embeddings files made by other encoder weights (warns).
        mesh: split the model over a device mesh with torch_xla SPMD (``executor="xla"``): a
            ``conf/mesh`` name (``"tp"``, ``"dp_tp"``), ``{"data": d, "model": m}`` or a
            :class:`~mmzoo.executor.MeshSpec`; None or ``"single"``: one device, no SPMD.
        config_dir: a directory (or list) of the user's own configs, searched with mmzoo's.
        warmup: when the XLA executor compiles (``executor.compile.warmup``): ``"all"``, every
            bucket at load, as a server; ``"needed"``, before each ``generate``, only the graphs
            its requests hit; ``"none"``.
        overrides: more Hydra overrides (``"model.lm.num_layers=2"``, ``"weights=random"``).
        executor_kwargs: overrides of the executor config: ``max_model_len=``, ``max_batch=``, and
            the XLA executor's groups as dicts (``buckets={"prefill": [64, 128]}``,
            ``layout={"transpose_keys": False}``, ``compile={"on_recompile": "error"}``;
            ``conf/executor/xla.yaml``).
    """
    from mmzoo.executor import MeshSpec

    args = list(overrides)
    if model is not None:
        args.append(f"model={model}")
    if isinstance(attention, str):
        args.append(f"attention={attention}")
    if isinstance(executor, str):
        args.append(f"executor={executor}")
    if isinstance(mesh, str):
        args.append(f"mesh={mesh}")
    values: dict[str, Any] = {"dtype": dtype, "warmup": warmup}
    if checkpoint is not None:
        values["checkpoint"] = str(checkpoint)
    if executor_kwargs:
        if not isinstance(executor, str):
            raise MmzooError(f"executor options {sorted(executor_kwargs)} need executor= a name; configure the "
                             f"{type(executor).__name__} object itself")
        values["executor"] = executor_kwargs
    if mesh is not None and not isinstance(mesh, str):
        values["mesh"] = {"data": mesh.data, "model": mesh.model} if isinstance(mesh, MeshSpec) else dict(mesh)
    cfg = _config.compose(args, config_dir=config_dir, values=values, verbose=verbose)
    return build(cfg, executor=None if isinstance(executor, str) else executor,
                 attention=None if isinstance(attention, str) else attention, towers=towers,
                 allow_fingerprint_mismatch=allow_fingerprint_mismatch, verbose=verbose)
