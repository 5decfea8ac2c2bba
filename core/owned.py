"""What a run owns, that no tool writes into from outside: its record directory (core/records.py:
config.json, metrics.jsonl, summary.json, errors/) and its checkpoint directory (training/checkpoint.py:
a --save_dir with owner.json, owner.lock, latest and step_*/ checkpoints).

Every tool that writes a file or a directory a user names (--out of export, fake_world, plan, report,
claims, project) asks `check_out` first: a report written over a record's summary.json, or an export
over a checkpoint's `latest`, would silently destroy another run's work (issue 39).
"""

from __future__ import annotations

import json
from pathlib import Path

from gptlite.errors import ConfigError

# A checkpoint directory's layout (training/checkpoint.py writes it).
LATEST = "latest"  # the name of the newest complete checkpoint
OWNER = "owner.json"  # the run the checkpoints belong to
LOCK = "owner.lock"  # held by the run writing into the directory
STEP_PREFIX = "step_"  # step_00000009/: a checkpoint; .step_00000009.partial/: one being written
META = "meta.json"  # in each checkpoint
# Its `format` (Backend.checkpoint_format): how the backend wrote model/. A format's name, stored in
# checkpoints, not a backend's (DeepSpeed's engine files keep theirs whatever the backends are called).
TORCH_FORMAT, DCP_FORMAT, DEEPSPEED_FORMAT = "torch", "dcp", "deepspeed"
CHECKPOINT_FORMATS = (TORCH_FORMAT, DCP_FORMAT, DEEPSPEED_FORMAT)


def is_record(directory: Path) -> bool:
    """A run's record: its config.json is a run's (it names the run and the schema)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "schema_version" in config and "run" in config


def is_checkpoint_dir(directory: Path) -> bool:
    """A --save_dir (owned, locked, or with a `latest` and checkpoints) or one checkpoint in it."""
    if (directory / OWNER).is_file() or (directory / LOCK).exists():
        return True
    if (directory / LATEST).is_file() and any(p.is_dir() for p in directory.glob(f"{STEP_PREFIX}*")):
        return True
    return directory.name.startswith((STEP_PREFIX, "." + STEP_PREFIX)) and (directory / META).is_file()


def owner_of(path: str | Path) -> str | None:
    """'the record D' or 'the checkpoint directory D' where `path` (a file or a directory, existing
    or to be created) is, or is inside, what a run owns; None elsewhere."""
    p = Path(path).resolve()
    for directory in (p, *p.parents):
        if not directory.is_dir():
            continue
        if is_record(directory):
            return f"the record {directory}"
        if is_checkpoint_dir(directory):
            return f"the checkpoint directory {directory}"
    return None


def check_out(flag: str, path: str | Path) -> None:
    """ConfigError (one line, naming `flag`) where writing `path` would write into a run's record or
    checkpoint directory."""
    owner = owner_of(path)
    if owner is not None:
        raise ConfigError(f"{flag}: {path} is in {owner}, which belongs to its run; nothing writes into a "
                          "record or a checkpoint directory from outside: name a path elsewhere")
