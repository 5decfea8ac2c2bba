"""docs/cli.md is every command's --help as the parsers say it (tools/cli_reference.py writes it)."""

import dataclasses
import importlib.util

from conftest import REPO
from core.config import RunConfig


def _generator():
    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "tools" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_what_the_parsers_say():
    generated = _generator().page()
    assert (REPO / "docs" / "cli.md").read_text() == generated, \
        "docs/cli.md is stale: run python tools/cli_reference.py"


def test_every_train_py_flag_is_in_the_reference():
    text = (REPO / "docs" / "cli.md").read_text()
    train = text.split("## python train.py\n", 1)[1].split("\n## ", 1)[0]
    missing = [f.name for f in dataclasses.fields(RunConfig) if f"--{f.name}" not in train]
    assert not missing, missing
