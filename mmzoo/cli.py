"""What every command-line entry point shares: Hydra's CLI on mmzoo's config tree, the choices a
checkpoint implies, and the error contract (bad input: one ``error:`` line, exit status 1).

An entry point is ``run(cfg)`` (a plain function, importable and testable) plus::

    main = hydra_main(run, "infer")
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from omegaconf import DictConfig

from mmzoo.errors import MmzooError


def cli(fn: Callable[[DictConfig], object], cfg: DictConfig) -> None:
    """Run ``fn(cfg)``; bad input is one ``error:`` line and exit status 1 (``debug=true``: traceback)."""
    from mmzoo.errors import find_mmzoo_error

    try:
        fn(cfg)
    except Exception as e:  # a resolver's or a builder's MmzooError arrives wrapped by OmegaConf / Hydra
        inner = find_mmzoo_error(e)
        if cfg.get("debug"):
            raise
        if inner is None and isinstance(e, OSError):  # disk full, no permission: the file and the reason
            where = f"{e.filename}: " if e.filename else ""
            print(f"error: {where}{e.strerror or e}", file=sys.stderr)
            sys.exit(1)
        if inner is None:
            raise
        print(f"error: {inner}", file=sys.stderr)
        sys.exit(1)


def add_checkpoint_choices(argv: list[str], config_name: str) -> list[str]:
    """``argv`` plus the overrides the checkpoint implies (:func:`mmzoo.config.auto_overrides`: the
    model from config.json's architectures, Llava's LM from ``text_config.model_type``), so that
    ``--cfg job`` prints, and the run builds, the pipeline for that checkpoint. Arguments Hydra
    cannot parse are left for Hydra to report (nothing added)."""
    from mmzoo import config

    try:
        args, unknown = _hydra_args().parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit):
        return argv
    if unknown or args.help or args.hydra_help or args.version or args.info or args.shell_completion:
        return argv
    try:
        overrides = list(args.overrides)
        cfg = config._compose(args.config_name or config_name, overrides, args.config_dir)
        keys = config.override_keys(overrides)
    except Exception:  # noqa: BLE001 - a bad override or config: Hydra's own run reports it
        return argv
    try:
        extra = config.auto_overrides(cfg, keys, config_dir=args.config_dir, verbose=args.cfg is None)
    except MmzooError as e:  # the checkpoint names a component the zoo lacks
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    # beside the user's overrides: argparse takes the positional overrides as one run, so they may
    # not be split by a flag (``--cfg job checkpoint=D`` must stay one run with the choices added)
    at = argv.index(overrides[0]) if overrides else len(argv)
    return argv[:at] + extra + argv[at:]


def _hydra_args() -> argparse.ArgumentParser:
    """A parser of the command line ``hydra.main`` takes (its documented flags; ``--help`` lists
    them), to read the overrides before Hydra composes them; Hydra itself parses it again."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("overrides", nargs="*")
    for flags in (("--help", "-h"), ("--hydra-help",), ("--version",), ("--resolve",), ("--run", "-r"),
                  ("--multirun", "-m")):
        parser.add_argument(*flags, action="store_true")
    for flags in (("--cfg", "-c"), ("--package", "-p"), ("--config-path", "-cp"), ("--config-name", "-cn"),
                  ("--config-dir", "-cd"), ("--experimental-rerun",)):
        parser.add_argument(*flags)
    parser.add_argument("--info", "-i", nargs="?", const="all")
    parser.add_argument("--shell-completion", "-sc", action="store_true")
    return parser


def hydra_main(task: Callable[[DictConfig], object], config_name: str, *, config_dir=None) -> Callable[[], None]:
    """The ``main()`` of an entry point: Hydra's CLI (overrides, ``--cfg``, ``--config-dir``,
    ``--help``) over mmzoo's conf/, running ``task`` under :func:`cli`. ``config_dir``: a directory
    searched too (a recipe script's own folder), as if given with ``--config-dir``."""
    import hydra

    from mmzoo.config import CONF_DIR

    def main() -> None:
        if config_dir is not None:
            sys.argv[1:1] = ["--config-dir", str(config_dir)]
        sys.argv[1:] = add_checkpoint_choices(sys.argv[1:], config_name)
        hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=config_name)(
            lambda cfg: cli(task, cfg))()

    return main
