"""The README's zoo table is the zoo: one row per ``conf/model`` option, naming what its family takes
(its modalities, and their precomputed embeddings) and the components its file composes
(``/encoder@encoder: ...`` and so on in its defaults list)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from mmzoo.config import CONF_DIR, options

README = Path(__file__).resolve().parents[1] / "README.md"


def _zoo_table() -> dict[str, list[str]]:
    """``model=`` -> its row's other cells, from the README's first table."""
    rows, inside = {}, False
    for line in README.read_text().splitlines():
        if line.startswith("| `model=` |"):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[re.match(r"`([^`]+)`", cells[0]).group(1)] = cells[1:]
    return rows


def _zoo_rows() -> dict[str, list[str]]:
    """``model=`` -> the first backticked name of its encoder, adapter and LM cells."""
    names = {n: [re.match(r"`([^`]+)`", c) for c in cells[1:]] for n, cells in _zoo_table().items()}
    return {n: [m.group(1) if m else "" for m in found] for n, found in names.items()}


def _composed(name: str) -> list[str]:
    """The encoder, adapter and LM options ``conf/model/<name>.yaml`` puts in its defaults list."""
    defaults = yaml.safe_load((Path(CONF_DIR) / "model" / f"{name}.yaml").read_text())["defaults"]
    chosen = {next(iter(d)).split("@")[0].strip("/"): next(iter(d.values())) for d in defaults if isinstance(d, dict)}
    return [chosen.get(group, "") for group in ("encoder", "adapter", "lm")]


def test_the_zoo_table_lists_every_model_and_its_components():
    rows = _zoo_rows()
    assert sorted(rows) == options("model"), "the README's zoo table and conf/model/ differ"
    for name, cells in rows.items():
        assert cells == _composed(name), (name, cells)


def test_the_zoo_table_says_what_each_family_takes():
    from mmzoo.config import family_class

    for name, cells in _zoo_table().items():
        kinds = family_class(name).modalities
        assert cells[0] == ", ".join([f"{kind}s" for kind in kinds] + ["embeds"]), (name, cells[0])
