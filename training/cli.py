"""train.py's command line: RunConfig's fields as argparse flags, and one-line errors.

Each flag's help, default, type and choices come from core.config.RunConfig; `--backend`'s choices
and the backends' one-line summaries from the registry (backends/__init__.py), which names them
without importing any backend. DeepSpeed's own flags (`--deepspeed`, `--deepspeed_config`,
`--local_rank` from its launcher) are RunConfig fields too, so parsing never imports DeepSpeed.
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import fields

from backends import BACKEND_SUMMARIES
from core.config import RunConfig
from gptlite.errors import ConfigError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults, except where there is none to show (None, False)."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = "train.py", description: str | None = None,
                 examples: str | None = None) -> argparse.ArgumentParser:
    width = max(len(name) for name in BACKEND_SUMMARIES) + 2
    epilog = "backends:\n" + "".join(f"  {name:<{width}}{summary}\n" for name, summary in BACKEND_SUMMARIES.items())
    parser = OneLineParser(prog=prog, description=textwrap.fill(description) if description else None,
                           formatter_class=HelpFormatter, epilog=epilog + (f"\n{examples}" if examples else ""))
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(RunConfig):
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        kwargs = {"help": meta["help"], "default": f.default, "dest": f.name}
        if isinstance(f.default, bool):
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _field_type(f)
            choices = tuple(BACKEND_SUMMARIES) if f.name == "backend" else meta.get("choices")
            if choices:
                kwargs["choices"] = choices
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
        group.add_argument(f"--{f.name}", *meta.get("aliases", ()), **kwargs)
    return parser


def _field_type(f):
    base = str(f.type).replace(" | None", "")
    return {"int": int, "float": float, "str": str}[base]


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> RunConfig:
    """Parse `argv` into a RunConfig; a bad value exits with one line on stderr and code 2."""
    parser = parser or build_parser()
    ns = parser.parse_args(argv)
    try:
        return RunConfig(**vars(ns))
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
