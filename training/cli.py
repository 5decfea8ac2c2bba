"""train.py's command line: RunConfig's fields as argparse flags, and one-line errors.

Each flag's help, default, type and choices come from core.config.RunConfig; `--backend`'s choices
and the backends' one-line summaries from the registry (backends/__init__.py), which names them
without importing any backend. DeepSpeed's own flags (`--deepspeed`, `--deepspeed_config`,
`--local_rank` from its launcher) are RunConfig fields too, so parsing never imports DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
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


EXIT_BAD_INPUT = 2


def tell_torch_elastic(line: str, when: float | None = None) -> bool:
    """Under torchrun (and `accelerate launch`), write `line` to this rank's torch elastic error file,
    which the launcher prints as the failure's root cause (the earliest `when` among the ranks');
    False where there is none."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    try:
        with open(error_file, "w") as f:  # the layout torch elastic's own record() writes
            json.dump({"message": {"message": line, "extraInfo": {
                "py_callstack": line, "timestamp": str(int(time.time() if when is None else when))}}}, f)
    except OSError:
        return False
    return True


def report_bad_input(line: str) -> int:
    """Tell the user about bad input once, under whichever launcher; the exit code to use (2).

    Plain python and DeepSpeed's launcher: rank 0 prints the line. torchrun (and `accelerate
    launch`, which runs it): rank 0 writes it to torch elastic's error file, which the launcher
    prints as the root cause of the failure, so printing it too would say it twice; the other
    ranks, which would fail the same way, wait to be stopped by the launcher once it sees rank 0
    exit, so that it reports one failure, not one per rank."""
    rank = int(os.environ.get("RANK", "0"))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if rank == 0:
        if not tell_torch_elastic(line):
            print(line, file=sys.stderr, flush=True)
    elif error_file:
        # The launcher stops this rank as soon as rank 0 exits; rank 0 may still be a while getting
        # to the same error on a busy machine, and an exit here first would hide its line.
        time.sleep(60)
    return EXIT_BAD_INPUT


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump), reported once, exit code 2."""

    def error(self, message: str):
        sys.exit(report_bad_input(f"{self.prog}: error: {message}"))


# The tools' shared names for one idea (issue 41): a spelling a tool used before, and the name now.
RENAMED_FLAGS = {"--ranks_per_node": "--gpus_per_node", "--gpus": "--world"}


def refuse_renamed(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """A flag under a name the tools no longer use: one line naming the new one (before parsing, since
    the tools pass unknown flags on to train.py's parser, which would only call it unknown)."""
    for token in sys.argv[1:] if argv is None else argv:
        if token == "--":
            break
        name = str(token).split("=", 1)[0]
        if name in RENAMED_FLAGS:
            parser.error(f"{name} is now {RENAMED_FLAGS[name]}, the name every tool uses for it")


class _RaisingParser(OneLineParser):
    def error(self, message: str):
        raise ConfigError(message)


def build_parser(prog: str = "train.py", description: str | None = None, examples: str | None = None,
                 parser_class: type[argparse.ArgumentParser] = OneLineParser) -> argparse.ArgumentParser:
    width = max(len(name) for name in BACKEND_SUMMARIES) + 2
    epilog = "backends:\n" + "".join(f"  {name:<{width}}{summary}\n" for name, summary in BACKEND_SUMMARIES.items())
    # No abbreviations (--save_d for --save_dir): a flag is spelled one way, as records, sweep keys
    # and simulation.fake_world's checks read it, and a new flag cannot make an old launch ambiguous.
    parser = parser_class(prog=prog, description=textwrap.fill(description) if description else None,
                          formatter_class=HelpFormatter, epilog=epilog + (f"\n{examples}" if examples else ""),
                          allow_abbrev=False)
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
            if meta.get("repeat"):  # given again adds to it (RunConfig joins the list)
                kwargs["action"] = "append"
        group.add_argument(f"--{f.name}", *meta.get("aliases", ()), **kwargs)
    return parser


def _field_type(f):
    base = str(f.type).replace(" | None", "")
    return {"int": int, "float": float, "str": str}[base]


def config_from_argv(argv: list[str]) -> RunConfig:
    """The RunConfig of a train.py command line; ConfigError (not an exit) for a bad one."""
    return RunConfig(**vars(build_parser(parser_class=_RaisingParser).parse_args(argv)))


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> RunConfig:
    """Parse `argv` into a RunConfig; a bad value exits with one line on stderr and code 2."""
    parser = parser or build_parser()
    ns = parser.parse_args(argv)
    try:
        return RunConfig(**vars(ns))
    except ConfigError as e:
        sys.exit(report_bad_input(f"{parser.prog}: error: {e}"))
