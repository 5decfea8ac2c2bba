"""Sweeps: a YAML matrix of runs, each launched the way users launch it, one at a time.

A spec (sweeps/*.yaml) names a matrix over backend configurations, activation checkpointing,
micro-batch, precision, world size and preset, plus train.py flags common to every run. Each run
goes through its backend's real launcher (torchrun for torch backends, deepspeed's launcher for
DeepSpeed, plain python for `single`) on a free port, with a per-run timeout, and leaves its
record in the sweep's directory. A failed, out-of-memory or timed-out run is recorded with that
status and the sweep goes on; running the same spec again skips runs already done.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.config import PRECISIONS, RunConfig
from core.configfile import load_yaml
from core.records import atomic_write_json, read_summary
from core.summary import FINISHED, RunSummary
from gptlite.errors import ConfigError
from gptlite.model import PRESETS
from training.launch import REPO, launch_command, launch_env, launcher_for

RETRYABLE = ("failed", "timeout")
# Flags the sweep sets itself for every run; a spec cannot set them in train_args.
SWEEP_OWNED = {"backend", "fsdp_config", "deepspeed_config", "runs_dir", "run_name", "overwrite", "quiet",
               "dry_run", "local_rank", "preset", "micro_batch", "precision", "ckpt_interval", "ckpt_impl", "steps",
               "ckpt_offload", "offload_activations", "activation_loading_horizon"}


def _non_empty(name: str, values: list) -> None:
    if not values:
        raise ConfigError(f"matrix.{name} must list at least one value")


@dataclass
class Matrix:
    # "single", "ddp", "fsdp", "fsdp2", or a config file: fsdp_configs/*.yaml, ds_configs/*.json
    backend: list[str]
    ckpt_interval: list[int] = field(default_factory=lambda: [0])
    ckpt_impl: list[str] = field(default_factory=lambda: ["torch_nonreentrant"])
    micro_batch: list[int] = field(default_factory=lambda: [8])
    precision: list[str] = field(default_factory=lambda: ["fp32"])
    world_size: list[int] = field(default_factory=lambda: [2])
    preset: list[str] = field(default_factory=lambda: ["tiny"])
    # What happens to the checkpointed blocks' saved inputs: "none" (kept in place), "torch"
    # (--ckpt_offload: torch's offload, fetched on demand) or "prefetch<H>" (--offload_activations
    # with --activation_loading_horizon H). Only with ckpt_interval > 0.
    activation_offload: list[str] = field(default_factory=lambda: ["none"])

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _non_empty(f.name, getattr(self, f.name))
        for value in self.activation_offload:
            offload_flags(value)
        for entry in self.backend:
            backend_of(entry)
        for name, allowed in (("precision", PRECISIONS), ("preset", tuple(PRESETS))):
            for value in getattr(self, name):
                if value not in allowed:
                    raise ConfigError(f"matrix.{name} values must be among {', '.join(allowed)} (got {value!r})")
        for name in ("ckpt_interval", "micro_batch", "world_size"):
            minimum = 0 if name == "ckpt_interval" else 1
            for value in getattr(self, name):
                if value < minimum:
                    raise ConfigError(f"matrix.{name} values must be >= {minimum} (got {value})")


def offload_flags(value: str) -> dict:
    """train.py flags of a matrix.activation_offload value."""
    if value == "none":
        return {}
    if value == "torch":
        return {"ckpt_offload": True}
    horizon = value.removeprefix("prefetch")
    if value.startswith("prefetch") and horizon.isdigit():
        return {"offload_activations": True, "activation_loading_horizon": int(horizon)}
    raise ConfigError(f"matrix.activation_offload values must be none, torch or prefetch<H> such as prefetch2 "
                      f"(got {value!r})")


@dataclass
class SweepSpec:
    name: str
    matrix: Matrix
    steps: int = 20
    timeout_s: float = 900.0
    runs_dir: str | None = None  # default: runs/sweeps/<name>
    train_args: dict = field(default_factory=dict)  # train.py flags for every run, e.g. {dropout: 0.0}
    env: dict = field(default_factory=dict)  # environment variables for every run

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ConfigError(f"name must be a plain name (got {self.name!r})")
        if self.steps < 1 or self.timeout_s <= 0:
            raise ConfigError("steps must be >= 1 and timeout_s > 0")
        known = {f.name for f in dataclasses.fields(RunConfig)}
        for key in self.train_args:
            if key not in known:
                raise ConfigError(f"train_args: unknown train.py flag '{key}'")
            if key in SWEEP_OWNED:
                raise ConfigError(f"train_args: '{key}' is set by the sweep (the matrix or the spec's own keys)")

    @property
    def directory(self) -> Path:
        return Path(self.runs_dir) if self.runs_dir else REPO / "runs" / "sweeps" / self.name


def load_spec(path: str) -> SweepSpec:
    return load_yaml(path, SweepSpec, flag="sweep spec")


def backend_of(entry: str) -> tuple[str, str | None, str]:
    """(backend name, config file or None, short label) of a matrix.backend entry."""
    from backends import BACKEND_NAMES

    if entry in BACKEND_NAMES:
        if entry == "deepspeed":
            raise ConfigError("matrix.backend: deepspeed needs a config file (ds_configs/*.json)")
        return entry, None, entry
    path = Path(entry) if Path(entry).is_absolute() else REPO / entry
    if not path.is_file():
        raise ConfigError(f"matrix.backend: '{entry}' is neither a backend ({', '.join(BACKEND_NAMES)}) nor an existing "
                          "config file")
    if path.suffix == ".json":
        return "deepspeed", entry, f"deepspeed.{path.stem}"
    if path.suffix in (".yaml", ".yml"):
        from backends import fsdp_config

        backend = fsdp_config.load(str(path)).backend
        return backend, entry, f"{backend}.{path.stem}"
    raise ConfigError(f"matrix.backend: '{entry}' must be a .json (DeepSpeed) or .yaml (FSDP) file")


@dataclass(frozen=True)
class PlannedRun:
    name: str
    backend: str
    config_file: str | None
    world_size: int
    flags: tuple[tuple[str, object], ...]  # train.py flags, in order
    env: tuple[tuple[str, str], ...] = ()
    # The run's coordinates in the matrix (label, ckpt, world, preset, precision), micro-batch left
    # out: the runs of one configuration share it (the largest-batch search groups by it).
    config_key: str = ""

    def argv(self, runs_dir: Path) -> list[str]:
        args = ["--runs_dir", str(runs_dir), "--run_name", self.name, "--overwrite", "--quiet"]
        if self.config_file:
            args += ["--deepspeed_config" if self.backend == "deepspeed" else "--fsdp_config", self.config_file]
        else:
            args += ["--backend", self.backend]
        for key, value in self.flags:
            if value is True:
                args.append(f"--{key}")
            elif value is not False and value is not None:
                args += [f"--{key}", str(value)]
        return args

    def command(self, runs_dir: Path) -> list[str]:
        """The launch command, as a user would type it (with a free port)."""
        return [*launch_command(launcher_for(self.backend), self.world_size), *self.argv(runs_dir)]

    def with_flags(self, name: str, **flags) -> "PlannedRun":
        merged = dict(self.flags)
        merged.update(flags)
        return dataclasses.replace(self, name=name, flags=tuple(merged.items()))


def expand(spec: SweepSpec) -> tuple[list[PlannedRun], list[str]]:
    """The runs of the matrix, and the combinations left out (with why)."""
    m = spec.matrix
    runs: dict[str, PlannedRun] = {}
    skipped: list[str] = []
    for entry, interval, impl, offload, micro, precision, world, preset in itertools.product(
            m.backend, m.ckpt_interval, m.ckpt_impl, m.activation_offload, m.micro_batch, m.precision, m.world_size,
            m.preset):
        backend, config_file, label = backend_of(entry)
        if backend == "single":
            world = 1  # one process by definition
        if not interval:
            impl, offload = "none", "none"  # nothing checkpointed: nothing to offload
        elif impl.startswith("deepspeed") and backend != "deepspeed":
            skipped.append(f"{label} with ckpt_impl {impl}: needs the deepspeed backend")
            continue
        ckpt = f"ckpt{interval}-{impl}" if interval else "ckpt0"
        if offload != "none":
            ckpt += f"-offload_{offload}"
        key = f"{label}-w{world}-{preset}-{precision}-{ckpt}"
        name = f"{label}-w{world}-{preset}-mb{micro}-{precision}-{ckpt}"
        flags = {"preset": preset, "micro_batch": micro, "precision": precision, "steps": spec.steps,
                 "ckpt_interval": interval, **({"ckpt_impl": impl} if interval else {}), **offload_flags(offload),
                 **spec.train_args}
        if config_file and backend == "deepspeed":
            from backends import deepspeed_config, deepspeed_plan

            config = deepspeed_config.read(str(REPO / config_file))
            if "nvme" in (deepspeed_plan.offload_device(config, "offload_optimizer"),
                          deepspeed_plan.offload_device(config, "offload_param")):
                flags.setdefault("nvme_path", str(spec.directory / ".nvme" / name))
        runs.setdefault(name, PlannedRun(name, backend, config_file, world, tuple(flags.items()),
                                         tuple((k, str(v)) for k, v in spec.env.items()), key))
    return list(runs.values()), list(dict.fromkeys(skipped))


@dataclass
class Outcome:
    run: PlannedRun
    summary: RunSummary
    seconds: float
    skipped: bool = False

    @property
    def status(self) -> str:
        return self.summary.status

    def line(self) -> str:
        s = self.summary
        if self.skipped:
            return f"{self.run.name}: {self.status} (already done)"
        if self.status != "ok":
            return f"{self.run.name}: {self.status} after {self.seconds:.0f} s | {s.error or ''}"
        rate = f"{s.samples_per_s:.1f} samples/s" if s.samples_per_s else "not timed"
        peak = f"peak {s.mem_peak_bytes / 2**20:.1f} MiB" if s.mem_peak_bytes else "peak n/a"
        return f"{self.run.name}: ok | {rate} | {peak} | loss {s.final_loss or 0:.4f} | {self.seconds:.0f} s"


class Runner:
    """Launches planned runs one at a time into `directory`."""

    def __init__(self, directory: Path, timeout_s: float, retry_failed: bool = False):
        self.directory = Path(directory)
        self.timeout_s = timeout_s
        self.retry_failed = retry_failed

    def run(self, planned: PlannedRun) -> Outcome:
        existing = read_summary(self.directory / planned.name / "summary.json")
        if existing is not None and existing.status in FINISHED and not (
                self.retry_failed and existing.status in RETRYABLE):
            return Outcome(planned, existing, 0.0, True)
        self.directory.mkdir(parents=True, exist_ok=True)
        log_dir = self.directory / ".logs"
        log_dir.mkdir(exist_ok=True)
        log = log_dir / f"{planned.name}.log"
        started = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(planned.command(self.directory), cwd=REPO, env=launch_env(dict(planned.env)),
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
        seconds = time.monotonic() - started
        return Outcome(planned, self._settle(planned, proc.returncode, timed_out, log, seconds), seconds)

    def _settle(self, planned: PlannedRun, returncode: int, timed_out: bool, log: Path, seconds: float) -> RunSummary:
        """The run's final summary; written here when the run could not write one itself."""
        path = self.directory / planned.name / "summary.json"
        summary = read_summary(path) or RunSummary(run_name=planned.name, backend=planned.backend,
                                                   world_size=planned.world_size, wall_time_s=seconds)
        if timed_out:
            summary = summary.ended("timeout", f"timed out after {self.timeout_s:g} s (sweep timeout_s)",
                                    summary.wall_time_s or seconds)
        elif summary.status == "running":
            summary = summary.ended("failed", f"exit code {returncode}: {_last_line(log)}", summary.wall_time_s or seconds)
        elif summary.status == "ok" and returncode != 0:
            summary = summary.ended("failed", f"exit code {returncode} after the record was written: "
                                              f"{_last_line(log)}")
        else:
            return summary
        atomic_write_json(path, summary.to_dict())
        return summary


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["no output"])[-1][:500]
