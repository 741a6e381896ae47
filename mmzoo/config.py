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
    try:
        raw = json.loads(cfg_path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise MmzooError(f"{cfg_path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise MmzooError(f"{cfg_path} is not a JSON object (it holds a {type(raw).__name__})")
    archs = raw.get("architectures") or []
    if not archs:
        raise MmzooError(f"{cfg_path} names no architectures")
    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise MmzooError(f"{cfg_path}: transformers cannot read this config ({str(e).splitlines()[0]})") from None
    return config, archs[0]


def read_config(checkpoint: str | Path):
    """``(transformers config, first architecture)`` of a checkpoint directory, with errors that
    name the directory (missing, not a directory, no or bad config.json)."""
    root = Path(checkpoint)
    if not root.exists():
        raise MmzooError(f"checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise MmzooError(f"checkpoint {root} is not a directory")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise MmzooError(f"checkpoint {root} has no config.json")
    return _read_config(str(root.resolve()), cfg_path.stat().st_mtime)


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


def register_resolvers() -> None:
    """Register mmzoo's resolvers (idempotent; done when this module is imported)."""
    for name, fn in (("hf", _hf), ("mmzoo.asset", _asset), ("mmzoo.feature_width", _feature_width)):
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
    the API also works inside a ``@hydra.main`` app, or a test that initialized Hydra)."""
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


def build_option(group: str, name: str, *, config_dir=None, **fields):
    """Instantiate the option ``name`` of ``group`` (``attention``, ``executor``, ``mesh``), with
    keyword overrides of its fields."""
    from hydra.utils import instantiate

    if name not in options(group, config_dir=config_dir):
        raise MmzooError(f"{group}={name!r} is not an option; choose one of {options(group, config_dir=config_dir)}")
    node = _compose("infer", [f"{group}={name}"], config_dir)[group]
    return instantiate(OmegaConf.merge(node, fields) if fields else node)
