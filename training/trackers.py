"""Experiment trackers (--tracker): the run's metric lines, also in the tools users already open.

The record (metrics.jsonl, summary.json) stays the source of truth; a tracker gets the same lines as
they are written, on rank 0 only, so its scalars are the record's. One tracker run per record,
named as the record:
- tensorboard: torch's SummaryWriter, event files in the record's own directory, so
  `tensorboard --logdir RUNS_DIR` shows each record as a run of its name, laid over the others;
  the resolved configuration as hyperparameters (the HParams tab) and as text.
- wandb: a W&B run in the record's directory (`wandb/`), offline unless WANDB_MODE says otherwise
  (these machines often have no network); WANDB_PROJECT names the project (default gptlite). An
  offline run prints the `wandb sync` command that uploads it later.
- csv: metrics.csv in the record, one row per metric line, for a spreadsheet.

What can be checked before anything runs (`check`: the package is there, W&B's mode is one it has,
online W&B has a login) is refused in one line (ConfigError, exit 2, nothing recorded). A tracker
that fails to start after that fails the run, with its one-line error in the record.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import netrc
import os
from pathlib import Path

from core.records import RecordNotWritable
from gptlite.errors import ConfigError

# The scalars of a metric line (training/loop.py), as the tracker names them: the record's keys,
# grouped so that TensorBoard and W&B put the curves of one kind together.
STEP_SCALARS = {
    "loss": "train/loss",
    "val_loss": "train/val_loss",
    "lr": "train/lr",
    "samples_per_s": "speed/samples_per_s",
    "tokens_per_s": "speed/tokens_per_s",
    "step_time_s": "speed/step_time_s",
    "mem_rss_bytes": "memory/rss_bytes",
    "mem_allocated_bytes": "memory/allocated_bytes",
}
# The summary's scalars, logged once at the run's last step.
SUMMARY_SCALARS = ("samples_per_s", "tokens_per_s", "mfu", "hfu", "mem_peak_bytes", "final_loss", "val_loss")
CSV_COLUMNS = ("step", *STEP_SCALARS)
WANDB_MODES = ("offline", "online", "disabled", "dryrun", "run")
INSTALL = {"tensorboard": "tensorboard", "wandb": "wandb"}


def names(value: str | None) -> list[str]:
    return [n for n in (value or "").split(",") if n]


def check(value: str | None) -> None:
    """Refuse, in one line, a tracker that could not start: before any process group or record."""
    for name in names(value):
        package = INSTALL.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"tracker: {name} needs the {package} package, which is not installed "
                              f"(pip install {package}, or pip install -e '.[trackers]')")
    if "wandb" in names(value):
        mode = os.environ.get("WANDB_MODE", "offline")
        if mode not in WANDB_MODES:
            raise ConfigError(f"tracker: WANDB_MODE must be one of {', '.join(WANDB_MODES)} (got {mode!r})")
        if mode in ("online", "run") and not _wandb_login():
            raise ConfigError("tracker: wandb with WANDB_MODE=online needs a W&B login (wandb login, or WANDB_API_KEY); "
                              "without WANDB_MODE the run logs offline and prints the command that syncs it later")


def _wandb_login() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("//")[-1].split("/")[0]
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def flat(config: dict, prefix: str = "") -> dict:
    """A nested configuration as one level of `a.b` keys with plain values (what hyperparameters take)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif value is not None:
            out[name] = json.dumps(value, default=str)
    return out


def _scalars(line: dict) -> dict:
    """The finite numbers of a metric line, under the trackers' names."""
    return {STEP_SCALARS[k]: float(v) for k, v in line.items()
            if k in STEP_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoard:
    def __init__(self, directory: Path, run_name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.directory = directory
        self.writer = SummaryWriter(log_dir=str(directory))
        params = flat(config)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")
        # The HParams tab's entry for this run, in the run's own event file (SummaryWriter.add_hparams
        # would write it to a new sub-run of its own).
        for summary in hparams(params, {"hparams/samples_per_s": 0.0, "hparams/final_loss": 0.0}):
            self.writer.file_writer.add_summary(summary)

    def log(self, line: dict) -> None:
        for name, value in _scalars(line).items():
            self.writer.add_scalar(name, value, line["step"])

    def finish(self, step: int | None, summary: dict, status: str) -> None:
        for key, value in summary.items():
            if value is not None:
                self.writer.add_scalar(f"summary/{key}", float(value), step or 0)
        for key in ("samples_per_s", "final_loss"):
            if summary.get(key) is not None:
                self.writer.add_scalar(f"hparams/{key}", float(summary[key]), step or 0)
        self.writer.add_text("status", status, step or 0)
        self.writer.close()

    def where(self) -> str:
        return f"tensorboard --logdir {self.directory.parent}"


class WandB:
    def __init__(self, directory: Path, run_name: str, config: dict):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "gptlite"), name=run_name, dir=str(directory),
                              config=flat(config), reinit="finish_previous")
        self.offline = os.environ["WANDB_MODE"] in ("offline", "dryrun")
        self.run_dir = Path(self.run.dir).parent  # wandb/offline-run-<time>-<id>

    def log(self, line: dict) -> None:
        self.run.log(_scalars(line), step=line["step"])

    def finish(self, step: int | None, summary: dict, status: str) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})
        self.run.summary["status"] = status
        self.run.finish(exit_code=0 if status == "ok" else 1)

    def where(self) -> str:
        return f"wandb sync {self.run_dir}" if self.offline else str(self.run.url)


class CSV:
    def __init__(self, directory: Path, run_name: str, config: dict):
        self.path = directory / "metrics.csv"
        self.file = open(self.path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        self.writer.writeheader()

    def log(self, line: dict) -> None:
        self.writer.writerow({k: line.get(k) for k in CSV_COLUMNS})
        self.file.flush()

    def finish(self, step: int | None, summary: dict, status: str) -> None:
        self.file.close()

    def where(self) -> str:
        return str(self.path)


KINDS = {"tensorboard": TensorBoard, "wandb": WandB, "csv": CSV}


class Trackers:
    """The run's trackers (none: every call does nothing). Rank 0 starts them, after its record."""

    def __init__(self, value: str | None, directory: Path, run_name: str, config: dict):
        self.trackers = []
        self.directory = Path(directory)
        self.last_step: int | None = None
        for name in names(value):
            try:
                self.trackers.append(KINDS[name](Path(directory), run_name, config))
            except Exception as e:  # noqa: BLE001 - one line naming the tracker, in the record
                self.finish({}, "failed")
                raise ConfigError(f"tracker: {name} did not start: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}") from e

    def log(self, line: dict) -> None:
        self.last_step = line["step"]
        for tracker in self.trackers:
            try:
                tracker.log(line)
            except OSError as e:  # its files are in the record: the run fails as for the record's own
                raise RecordNotWritable(self.directory, e) from e

    def finish(self, summary: dict, status: str) -> list[str]:
        """Close every tracker; where to look at each (a command or a path), for the run's output."""
        where = []
        values = {k: summary.get(k) for k in SUMMARY_SCALARS}
        while self.trackers:
            tracker = self.trackers.pop(0)
            tracker.finish(self.last_step, values, status)
            where.append(tracker.where())
        return where
