"""Configs ship with the package: a wheel built from the repository carries conf/ as mmzoo/conf,
and an installed (non-editable) mmzoo run from another directory finds every config there."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_carries_every_config_and_an_install_finds_them(tmp_path):
    wheels = tmp_path / "wheels"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    (wheel,) = wheels.glob("mmzoo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    confs = {str(f.relative_to(ROOT / "conf")) for f in (ROOT / "conf").rglob("*.yaml")}
    assert confs and {f"mmzoo/conf/{c}" for c in confs} <= names
    assert "mmzoo/assets/qwen2_vl_shapes/model.safetensors" in names
    modules = {str(f.relative_to(ROOT)) for f in (ROOT / "mmzoo").rglob("*.py") if "__pycache__" not in f.parts}
    assert modules and sorted(modules - names) == []  # every module ships (mmzoo.serve too)
    target = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(target)}  # ahead of the editable install
    p = subprocess.run([sys.executable, "-c", "import mmzoo.config as c; print(c.CONF_DIR); print(c.options('model'))"],
                       cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    conf_dir, models = p.stdout.splitlines()
    assert Path(conf_dir) == target / "mmzoo" / "conf"
    assert all(m in models for m in ("qwen2_vl", "llava", "qwen2_audio"))
    p = subprocess.run([sys.executable, "-m", "mmzoo.infer", "--cfg", "job", "--resolve"], cwd=elsewhere, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert cfg["checkpoint"] == str(target / "mmzoo" / "assets" / "qwen2_vl_shapes")
    assert cfg["model"]["encoder"]["_target_"] == "mmzoo.encoders.qwen2_vl_vit"
