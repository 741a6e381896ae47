"""The zoo is the files in ``conf/``: anything that lists models or backends reads them."""

from __future__ import annotations

from pathlib import Path

from hydra.utils import instantiate
from omegaconf import OmegaConf

from mmzoo.errors import MmzooError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def options(group: str) -> list[str]:
    """The option names of a config group (``conf/<group>/*.yaml``)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def option_config(group: str, name: str):
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        raise MmzooError(f"{group}={name!r} is not an option; choose one of {options(group)}")
    return OmegaConf.load(path)


def build_option(group: str, name: str, **overrides):
    """Instantiate ``conf/<group>/<name>.yaml``, with keyword overrides of its fields."""
    cfg = option_config(group, name)
    return instantiate(OmegaConf.merge(cfg, overrides) if overrides else cfg)


def family_for(architecture: str):
    """The model family (``conf/model/*.yaml``) whose checkpoints have this ``architectures`` entry."""
    for name in options("model"):
        family = build_option("model", name)
        if architecture in family.architectures:
            return family
    raise MmzooError(f"config.json architecture {architecture!r} is not supported; "
                     f"the zoo has {options('model')} ({', '.join(supported_architectures())})")


def supported_architectures() -> list[str]:
    return [a for name in options("model") for a in build_option("model", name).architectures]
