"""Where mmzoo's configs live, the resolvers they use, and composing them into a pipeline config.

The zoo is Hydra's config search path: mmzoo's own ``conf/`` (shipped inside the installed
package; the repository's ``conf/`` in a source checkout) plus whatever a user adds:
``--config-dir DIR`` or ``hydra.searchpath`` on the command line, ``config_dir=`` in the Python
API. A family or recipe in a user's directory is then found by both.

Resolvers (registered on import):

* ``${hf:path}`` / ``${hf:path,default}``: a value of the run's checkpoint's ``config.json``, read
  with transformers' ``AutoConfig`` (``text_config.hidden_size``, ``vision_config.depth``), so a
  family file takes its sizes from the checkpoint instead of typing them twice.
* ``${mmzoo.asset:name}``: a file shipped in ``mmzoo/assets`` (the embedded demo checkpoint).
* ``${mmzoo.feature_width:width,layers}``: ``width`` times the number of selected layers (an int
  selects one): the input width of a projector reading concatenated hidden states.

Choices made from the checkpoint (:func:`auto_overrides`), unless given: the model family from
``config.json``'s ``architectures`` (each ``conf/model`` file lists the ones it serves), and
component options a family names under ``from_checkpoint`` (Llava's LM from
``text_config.model_type``: ``lm@model.lm=qwen2`` for a Qwen2 text model).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from mmzoo.errors import MmzooError
from mmzoo.paths import ASSETS

_PACKAGE = Path(__file__).resolve().parent
# a wheel carries conf/ as mmzoo/conf (pyproject.toml maps it); a source checkout has it beside mmzoo/
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf").is_dir() else _PACKAGE.parent / "conf"


# ----------------------------------------------------------------------------- checkpoints

@lru_cache(maxsize=32)
def _read_config(path: str, mtime: float):
    from transformers import AutoConfig

    root = Path(path)
    cfg_path = root / "config.json"
    raw = read_json_object(cfg_path)
    check_config_json(raw, cfg_path)
    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' config classes raise anything on a bad value
        raise MmzooError(f"{cfg_path}: transformers cannot read this config ({_reason(e)})") from None
    return config, raw["architectures"][0], raw


def read_config(checkpoint: str | Path):
    """``(transformers config, first architecture)`` of a checkpoint directory, with errors that
    name the directory (missing, not a directory, no or bad config.json) or the file, the field and
    the value (:func:`check_config_json`)."""
    config, arch, _ = _read_checkpoint_config(checkpoint)
    return config, arch


def read_config_json(checkpoint: str | Path) -> dict:
    """The checked ``config.json`` of a checkpoint directory as it is in the file (a dict: do not
    change it), for what transformers' config classes hide (which keys the file sets)."""
    return _read_checkpoint_config(checkpoint)[2]


def _read_checkpoint_config(checkpoint: str | Path):
    root = Path(checkpoint)
    if not root.exists():
        raise MmzooError(f"checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise MmzooError(f"checkpoint {root} is not a directory")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise MmzooError(f"checkpoint {root} has no config.json")
    return _read_config(str(root.resolve()), cfg_path.stat().st_mtime)


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object (a checkpoint's config.json, generation_config.json, ...)."""
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise MmzooError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise MmzooError(f"{path} is not a JSON object (it holds a {type(raw).__name__})")
    return raw


def _reason(e: BaseException) -> str:
    """The line of a third-party exception that says what is wrong: transformers' config
    validation puts it last (``Validation error for field 'x':\n    TypeError: ...``)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    line = lines[-1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    return re.sub(r"^[A-Za-z]*(Error|Exception): ", "", line)[:300]


# ----------------------------------------------------------------------------- config.json values

# What mmzoo reads from a checkpoint's config.json (the ${hf:...} paths of conf/model and the
# families' own), by key, wherever it stands: at the top (Qwen2-VL's hub layout is flat) or in a
# sub-config. Each is refused here, naming the file, the field and the value, before transformers'
# config classes see it (they raise a traceback or take it silently: a negative rope_theta, a
# string for a boolean).
SUBCONFIGS = ("text_config", "vision_config", "audio_config")
_POSITIVE_INT = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",  # LMs, CLIP
    "embed_dim", "depth", "num_heads", "in_channels", "patch_size", "temporal_patch_size",  # Qwen2-VL's ViT
    "spatial_merge_size", "out_hidden_size", "window_size",  # Qwen2.5-VL's ViT
    "image_size", "num_channels", "image_seq_length",
    "num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",  # Whisper
    "max_source_positions"})
_OPTIONAL_POSITIVE_INT = frozenset({"num_key_value_heads", "head_dim"})  # null: transformers derives it
# Past any model's size (vocabularies reach 262144, widths 16384, MLPs 53248), and small enough that
# what is built from the sizes before the weights are checked (rotary tables) stays small.
MAX_SIZE = 1 << 20
_POSITIVE_NUMBER = frozenset({"rms_norm_eps", "layer_norm_eps", "rope_theta", "mlp_ratio", "tokens_per_second",
                              "downsample_ratio"})
# sizes transformers' InternVL config writes as a [height, width] pair (CLIP's as one integer)
_SIZE_PAIR = frozenset({"image_size", "patch_size"})
_TOKEN_ID = frozenset({"image_token_id", "image_token_index", "video_token_id", "audio_token_index"})
_BOOL = frozenset({"tie_word_embeddings", "use_sliding_window", "multimodal_projector_bias",
                   # InternViT's
                   "attention_bias", "use_qk_norm", "use_mean_pooling", "use_absolute_position_embeddings"})
_STRING = frozenset({"model_type", "hidden_act", "projector_hidden_act", "activation_function",
                     "vision_feature_select_strategy", "norm_type"})
_ROPE = ("rope_parameters", "rope_scaling")
DTYPE_NAMES = frozenset({"auto", "float32", "float16", "bfloat16", "float64", "float", "half", "double",
                         "float8_e4m3fn", "float8_e5m2"})


def check_config_json(raw: dict, path: Path) -> None:
    """Refuse a config.json whose values mmzoo reads have the wrong type or range, or do not fit
    together (heads dividing the width, GQA groups, M-RoPE sections): one :class:`MmzooError`
    naming ``path``, the field and the value."""
    archs = raw.get("architectures")
    if not archs:
        raise MmzooError(f"{path} names no architectures")
    if not isinstance(archs, list) or not all(isinstance(a, str) and a for a in archs):
        raise MmzooError(f"{path}: architectures={_show(archs)} must be a list of model class names")
    for key in ("dtype", "torch_dtype"):
        value = raw.get(key)
        if value is not None and not (isinstance(value, str) and value in DTYPE_NAMES):
            raise MmzooError(f"{path}: {key}={_show(value)} is not a torch dtype; expected one of "
                             f"{sorted(DTYPE_NAMES)}")
    if "vision_feature_layer" in raw:
        layer = raw["vision_feature_layer"]
        layers = layer if isinstance(layer, list) else [layer]
        if not layers or not all(_is_int(i) for i in layers):
            raise MmzooError(f"{path}: vision_feature_layer={_show(layer)} must be a layer index (an integer) "
                             f"or a non-empty list of them")
    _check_section(raw, "", path)
    for name in SUBCONFIGS:
        if name in raw:
            if not isinstance(raw[name], dict):
                raise MmzooError(f"{path}: {name} must be an object of the {name.split('_')[0]} model's settings, "
                                 f"got {_show(raw[name])}")
            _check_section(raw[name], f"{name}.", path)


def _check_section(d: dict, prefix: str, path: Path) -> None:
    """The values of one (sub)config, and how they fit together."""
    def bad(key: str, what: str):
        return MmzooError(f"{path}: {prefix}{key}={_show(d[key])} {what}")

    for key, value in d.items():
        if key in _SIZE_PAIR and isinstance(value, list):
            if not (len(value) == 2 and all(_is_int(v) and 0 < v <= MAX_SIZE for v in value)):
                raise bad(key, "must be a positive integer or a [height, width] pair of them")
            continue
        if key in _POSITIVE_INT and not (_is_int(value) and value > 0):
            raise bad(key, "must be a positive integer")
        if key in _OPTIONAL_POSITIVE_INT and value is not None and not (_is_int(value) and value > 0):
            raise bad(key, "must be a positive integer (or null)")
        if (key in _POSITIVE_INT or key in _OPTIONAL_POSITIVE_INT) and value is not None and value > MAX_SIZE:
            raise bad(key, f"is larger than any model's (mmzoo takes at most {MAX_SIZE})")
        if key in _POSITIVE_NUMBER and not _positive_number(value):
            raise bad(key, "must be a positive finite number")
        if key in _TOKEN_ID and not (_is_int(value) and value >= 0):
            raise bad(key, "must be a token id (an integer >= 0)")
        if key in _BOOL and not isinstance(value, bool):
            raise bad(key, "must be true or false")
        if key in _STRING and not (isinstance(value, str) and value):
            raise bad(key, "must be a non-empty string")
        if key == "eos_token_id" and value is not None:
            ids = value if isinstance(value, list) else [value]
            if not ids or not all(_is_int(i) and i >= 0 for i in ids):
                raise bad(key, "must be a token id (an integer >= 0) or a non-empty list of them")
    heads, kv, width = d.get("num_attention_heads"), d.get("num_key_value_heads"), d.get("hidden_size")
    head_dim = d.get("head_dim")
    if heads and kv and heads % kv:
        raise MmzooError(f"{path}: {prefix}num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    if width and heads and head_dim is None and width % heads:
        raise MmzooError(f"{path}: {prefix}hidden_size={width} is not a multiple of num_attention_heads={heads} "
                         f"(and no head_dim is given)")
    for dim, n in (("embed_dim", "num_heads"), ("d_model", "encoder_attention_heads"), ("image_size", "patch_size")):
        a, b = (v if isinstance(v, list) else [v, v] for v in (d.get(dim), d.get(n)))
        if all(a) and all(b) and any(x % y for x, y in zip(a, b)):
            raise MmzooError(f"{path}: {prefix}{dim}={_show(d[dim])} is not a multiple of {n}={_show(d[n])}")
    rope_head = head_dim or (width // heads if width and heads else None)
    for rope in _ROPE:
        params = d.get(rope)
        if rope not in d or params is None:
            continue
        if not isinstance(params, dict):
            raise MmzooError(f"{path}: {prefix}{rope}={_show(params)} must be an object (rope_theta, rope_type, ...)")
        where = f"{prefix}{rope}."
        for key in ("rope_type", "type"):
            if key in params and not (isinstance(params[key], str) and params[key]):
                raise MmzooError(f"{path}: {where}{key}={_show(params[key])} must be a non-empty string")
        if "rope_theta" in params and not _positive_number(params["rope_theta"]):
            raise MmzooError(f"{path}: {where}rope_theta={_show(params['rope_theta'])} must be a positive finite "
                             f"number")
        if "mrope_section" in params:
            sections = params["mrope_section"]
            if not (isinstance(sections, list) and len(sections) == 3 and all(_is_int(s) and s > 0 for s in sections)):
                raise MmzooError(f"{path}: {where}mrope_section={_show(sections)} must be 3 positive integers "
                                 f"(the rotary pairs of the t, h, w position axes)")
            if rope_head and sum(sections) * 2 != rope_head:
                raise MmzooError(f"{path}: {where}mrope_section={sections} sums to {sum(sections)}, but head_dim/2 = "
                                 f"{rope_head / 2:g}" + ("" if head_dim else f" (hidden_size={width} / "
                                                          f"num_attention_heads={heads} / 2)"))
    if prefix in ("", "text_config.") and heads and rope_head and rope_head % 2:
        raise MmzooError(f"{path}: {prefix}head_dim={rope_head}" + ("" if head_dim else f" (hidden_size={width} / "
                         f"num_attention_heads={heads})") + " is odd; rotary embeddings rotate pairs of channels")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _show(value: Any) -> str:
    """A config value as the file has it (JSON), cut to a readable length."""
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ----------------------------------------------------------------------------- resolvers

_MISSING = object()


def _lookup(obj: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(obj, dict):
            obj = obj.get(part, _MISSING)
        else:
            obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def _plain(value: Any) -> Any:
    """A config value OmegaConf can hold (and ``OmegaConf.resolve`` write back): lists and dicts as
    OmegaConf containers, transformers sub-configs as dicts."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, (list, tuple, dict)):
        return OmegaConf.create(list(value) if isinstance(value, tuple) else value)
    return value


def _hf(path: str, *default: Any, _root_: DictConfig, _node_) -> Any:
    key = _node_._get_full_key(None)
    checkpoint = _root_.get("checkpoint") if "checkpoint" in _root_ else None
    if checkpoint is None:
        raise MmzooError(f"{key} is read from the checkpoint's config.json (${{hf:{path}}}) but no checkpoint "
                         f"is given: pass checkpoint=DIR, or set {key} yourself")
    config, arch = read_config(checkpoint)
    value = _lookup(config, path)
    if value is _MISSING or (value is None and default):
        if default:
            return _plain(default[0])
        name = _root_.model.get("name", "?") if "model" in _root_ else "?"
        raise MmzooError(f"{checkpoint}/config.json ({arch}) has no {path}, which {key} reads; is model={name} "
                         f"the family of this checkpoint?")
    return _plain(value)


def _asset(name: str) -> str:
    path = ASSETS / name
    if not path.exists():
        raise MmzooError(f"mmzoo asset {name!r} is missing from {ASSETS}")
    return str(path)


def _feature_width(width: int, layers: Any) -> int:
    return int(width) * (len(layers) if isinstance(layers, (list, tuple, ListConfig)) else 1)


def _len(items: Any, *, _node_) -> int:
    """The length of a list (Qwen3-VL's DeepStack levels: ``len(deepstack_visual_indexes)``)."""
    if not isinstance(items, (list, tuple, ListConfig)):
        raise MmzooError(f"{_node_._get_full_key(None)}: {items!r} is not a list")
    return len(items)


def _reciprocal(ratio: Any, *, _node_) -> int:
    """``1 / ratio`` as an integer (InternVL's ``downsample_ratio`` 0.5 -> the pixel shuffle's 2)."""
    k = round(1 / ratio) if _positive_number(ratio) else 0
    if k < 1 or not math.isclose(k * ratio, 1.0, rel_tol=1e-9):
        raise MmzooError(f"{_node_._get_full_key(None)}: {ratio!r} is not 1 / k for a positive integer k")
    return k


def register_resolvers() -> None:
    """Register mmzoo's resolvers (idempotent; done when this module is imported)."""
    for name, fn in (("hf", _hf), ("mmzoo.asset", _asset), ("mmzoo.feature_width", _feature_width),
                     ("mmzoo.reciprocal", _reciprocal), ("mmzoo.len", _len)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


# ----------------------------------------------------------------------------- the search path

def _dirs(config_dir) -> list[Path]:
    if config_dir is None:
        return []
    dirs = [Path(config_dir)] if isinstance(config_dir, (str, Path)) else [Path(d) for d in config_dir]
    for d in dirs:
        if not d.is_dir():
            raise MmzooError(f"config_dir {d} is not a directory")
    return [d.resolve() for d in dirs]


@contextlib.contextmanager
def zoo(config_dir=None) -> Iterator[None]:
    """Hydra initialized on mmzoo's conf/ plus ``config_dir`` (a directory or a list), searched as
    ``--config-dir`` is on the command line; any Hydra state around it is restored afterwards (so
    the API also works inside a ``@hydra.main`` app, or a test that initialized Hydra).

    The one use of Hydra's private modules in mmzoo: the public ``initialize_config_dir`` takes one
    directory, and ``hydra.searchpath`` appends after conf/ where ``--config-dir`` prepends (a
    user's file of a zoo name must win, as on the command line)."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton

    dirs = _dirs(config_dir)
    saved = Singleton._instances.pop(GlobalHydra, None)
    try:
        search_path = create_config_search_path(str(CONF_DIR))
        for d in dirs:  # what hydra.main does with --config-dir
            search_path.prepend(provider="command-line", path=f"file://{d}", anchor=SearchPathQuery(provider="schema"))
        Hydra.create_main_hydra2(task_name="mmzoo", config_search_path=search_path)
        yield
    finally:
        Singleton._instances.pop(GlobalHydra, None)
        if saved is not None:
            Singleton._instances[GlobalHydra] = saved


def options(group: str, *, config_dir=None) -> list[str]:
    """The option names of a config group on the search path (``conf/<group>/*.yaml`` and the
    user's directories)."""
    from hydra.core.global_hydra import GlobalHydra

    with zoo(config_dir):
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


def _compose(config_name: str, overrides: list[str], config_dir=None) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra.errors import HydraException

    with zoo(config_dir):
        try:
            return hydra_compose(config_name=config_name, overrides=overrides)
        except HydraException as e:
            raise MmzooError(str(e).splitlines()[0]) from None


def override_keys(overrides: list[str]) -> set[str]:
    """The keys a list of Hydra overrides sets (``model``, ``lm@model.lm``, ``checkpoint``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {o.get_key_element().lstrip("+~") for o in parsed}


def auto_overrides(cfg: DictConfig, given: set[str], *, config_dir=None, verbose: bool = False) -> list[str]:
    """The choices a composed config should take from its checkpoint, as overrides to add.

    * ``model=<name>``: when ``model`` is not among ``given``, the config's model lists
      architectures and the checkpoint's is not one of them, the one model option that lists it.
    * ``<group>@model.<group>=<value>``: for each ``model.from_checkpoint`` entry
      ``<group>: <config.json path>`` not in ``given`` (Llava: ``lm: text_config.model_type``).
    """
    checkpoint = OmegaConf.select(cfg, "checkpoint")
    if not isinstance(checkpoint, str) or not (Path(checkpoint) / "config.json").is_file():
        return []
    try:
        config, arch = read_config(checkpoint)
    except MmzooError:
        return []  # reported where the checkpoint is loaded
    out = []
    model = cfg.get("model")
    if "model" not in given and model is not None and model.get("architectures") and arch not in model.architectures:
        found = [name for name in options("model", config_dir=config_dir)
                 if arch in (_model_node(name, config_dir).get("architectures") or [])]
        if len(found) == 1:
            out.append(f"model={found[0]}")
            model = _model_node(found[0], config_dir)
            if verbose:
                print(f"mmzoo: {checkpoint} is a {arch} checkpoint: model={found[0]}", file=sys.stderr)
    if model is None or arch not in (model.get("architectures") or []):
        return out  # component choices follow only a checkpoint of this family
    for group, path in (model.get("from_checkpoint") or {}).items():
        key = f"{group}@model.{group}"
        if key in given:
            continue
        value = _lookup(config, str(path))
        if value is _MISSING or value is None:
            continue
        if str(value) not in options(group, config_dir=config_dir):
            raise MmzooError(f"{checkpoint}/config.json: {path}={value!r} has no {group} component "
                             f"(conf/{group}/{value}.yaml); the zoo has {options(group, config_dir=config_dir)}")
        out.append(f"{key}={value}")
    return out


def _model_node(name: str, config_dir) -> DictConfig:
    return _compose("infer", [f"model={name}"], config_dir).model


def family_class(name: str, *, config_dir=None) -> type:
    """The :class:`~mmzoo.models.Family` subclass of ``conf/model/<name>.yaml`` (its ``family._target_``)."""
    from hydra.utils import get_class

    if name not in options("model", config_dir=config_dir):
        raise MmzooError(f"model={name} is not in the zoo; it has {options('model', config_dir=config_dir)}")
    return get_class(_model_node(name, config_dir).family._target_)


def _with_values(cfg: DictConfig, values: dict | None) -> DictConfig:
    if values:
        with open_dict(cfg):
            cfg.merge_with(values)
    return cfg


def compose(overrides: list[str] | tuple = (), config_name: str = "infer", *, config_dir=None,
            values: dict | None = None, verbose: bool = False) -> DictConfig:
    """Compose ``config_name`` (``infer``, ``encode``, ``bench`` or a recipe on the search path) with
    Hydra overrides, then ``values`` merged in (Python values: paths need no quoting), and the
    choices the checkpoint implies (:func:`auto_overrides`)."""
    overrides = list(overrides)
    cfg = _with_values(_compose(config_name, overrides, config_dir), values)
    given = override_keys(overrides) | set(values or {})
    extra = auto_overrides(cfg, given, config_dir=config_dir, verbose=verbose)
    return _with_values(_compose(config_name, overrides + extra, config_dir), values) if extra else cfg


# ----------------------------------------------------------------------------- instantiating

def instantiate_part(node: DictConfig, where: str, **kwargs):
    """``hydra.utils.instantiate(node)``, with bad input reported as one :class:`MmzooError` naming
    ``where`` (``model.lm``, ``executor``)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf.errors import OmegaConfBaseException

    from mmzoo.errors import find_mmzoo_error

    try:
        return instantiate(node, **kwargs)
    except (InstantiationException, OmegaConfBaseException, ValueError, TypeError) as e:
        inner = find_mmzoo_error(e)
        if inner is not None:
            raise MmzooError(str(inner)) from None
        cause = e.__cause__ or e
        raise MmzooError(f"{where}: {str(cause).splitlines()[0]}") from None


def build_option(group: str, name: str, *, config_dir=None, **fields):
    """Instantiate the option ``name`` of ``group`` (``attention``, ``executor``, ``mesh``), with
    keyword overrides of its fields."""
    if name not in options(group, config_dir=config_dir):
        raise MmzooError(f"{group}={name!r} is not an option; choose one of {options(group, config_dir=config_dir)}")
    node = _compose("infer", [f"{group}={name}"], config_dir)[group]
    return instantiate_part(OmegaConf.merge(node, fields) if fields else node, group)
