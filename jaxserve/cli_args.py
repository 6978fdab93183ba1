"""The engine's command-line pieces shared by `jaxserve` (cli.py) and its benchmark
subcommands (bench/commands.py): a subcommand parser taking every engine flag, and the
EngineArgs those flags give. Its own module so the two command sets build on it instead
of on each other."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import fields
from typing import Any, Callable

from jaxserve.config import EngineArgs, field_kind

# the default of every engine flag: a flag the user did not give leaves the config
# file's value (or the field's default) in place
_UNSET: Any = object()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" like argparse's, except for engine flags: their default
    is the _UNSET sentinel and their help already states the real default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is _UNSET or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)



def add_cli_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per EngineArgs field, grouped; defaults are _UNSET so that a
    config file value is only overridden by flags the user actually gave."""
    groups: dict[str, Any] = {}
    for f in fields(EngineArgs):
        if f.name in skip:
            continue
        md = f.metadata
        g = groups.setdefault(md["group"], parser.add_argument_group(f"{md['group']} options"))
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f"{md['help']} (default: {default})"
        kind = field_kind(f)
        if kind == "bool":
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=_UNSET, help=help_text)
        elif kind == "list":
            item = str if "list[str]" in str(f.type) else int
            g.add_argument(flag, dest=f.name, type=item, nargs="+", default=_UNSET,
                           help=help_text)
        elif kind == "dict":
            g.add_argument(flag, dest=f.name, type=_json_object, default=_UNSET, metavar="JSON",
                           help=help_text)
        else:
            conv: Callable = {"int": int, "float": float, "str": str}[kind]
            g.add_argument(flag, dest=f.name, type=conv, default=_UNSET, help=help_text,
                           choices=[c for c in md["choices"] if c is not None] if md.get("choices") else None)


def _json_object(text: str) -> dict:
    """argparse type of a JSON-object flag (a plain message on bad input)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def engine_args_from_cli(ns: argparse.Namespace, **extra: Any) -> EngineArgs:
    given = {f.name: getattr(ns, f.name) for f in fields(EngineArgs)
             if getattr(ns, f.name, _UNSET) is not _UNSET}
    given.update({k: v for k, v in extra.items() if v is not None})
    return EngineArgs.from_sources(getattr(ns, "config", None), **given)



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
