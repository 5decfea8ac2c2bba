"""Write docs/cli.md, every command's --help, from the parsers themselves.

    python tools/cli_reference.py          # regenerate docs/cli.md
    python tools/cli_reference.py --check  # exit 1 when docs/cli.md is not what the parsers say

tests/test_cli_reference.py fails when the committed page is stale. The help is formatted at a fixed
width (COLUMNS=100), whatever the terminal.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "cli.md"
WIDTH = "100"
# (the command as typed, the module whose main(argv) parses it): train.py's parser is built below.
TOOLS = [
    ("python train.py", None),
    ("python sweep.py", "sweep"),
    ("python -m analysis.report", "analysis.report"),
    ("python -m analysis.claims", "analysis.claims"),
    ("python -m analysis.table", "analysis.table"),
    ("python -m analysis.compact", "analysis.compact"),
    ("python -m analysis.estimate", "analysis.estimate"),
    ("python -m analysis.project", "analysis.project"),
    ("python -m analysis.plan", "analysis.plan"),
    ("python -m training.fake_world", "training.fake_world"),
    ("python -m training.export", "training.export"),
]


def help_of(module: str | None) -> str:
    if module is None:
        import train
        from training.cli import build_parser

        return build_parser(description=train.DESCRIPTION, examples=train.EXAMPLES).format_help()
    import importlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            importlib.import_module(module).main(["--help"])
        except SystemExit:
            pass
    return out.getvalue()


def page() -> str:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parts = ["# Command-line reference\n",
                 "Every command's `--help`, generated from its parser by `python tools/cli_reference.py` "
                 "(tests/test_cli_reference.py fails when this page is stale). The commands themselves: "
                 "[the README](../README.md).\n"]
        parts += ["- [`" + command + "`](#" + command.replace(" ", "-").replace(".", "").lower() + ")" for command, _ in TOOLS]
        parts.append("")
        for command, module in TOOLS:
            parts += [f"## {command}\n", "```", help_of(module).rstrip(), "```\n"]
        return "\n".join(parts)
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = page()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(REPO)} is stale: run python tools/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(PAGE.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
