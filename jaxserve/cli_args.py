"""The engine's command-line pieces shared by `jaxserve` (cli.py) and its benchmark
subcommands (bench/commands.py): a subcommand parser taking every engine flag, and the
EngineArgs those flags give. Its own module so the two command sets build on it instead
of on each other."""
from __future__ import annotations

import argparse
from typing import Any

from jaxserve.config import EngineArgs, HelpFormatter, add_cli_args, engine_args_from_cli


def engine_parser(sub: Any, name: str, help: str, *, model_positional: bool = True,
                  skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """A subcommand of `sub` with the engine's flags (and MODEL, unless skipped)."""
    p = sub.add_parser(name, help=help, description=help,
                       formatter_class=HelpFormatter)
    if model_positional:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="HF dir, .gguf file or orbax dir (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--config", default=None, help="YAML file of settings (keys = flag names in "
                                                  "snake_case); flags override it")
    add_cli_args(p, skip=skip)
    return p


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of a parsed engine subcommand (--config file, then flags)."""
    return engine_args_from_cli(ns, model=getattr(ns, "model_pos", None))
