"""What a run reads and writes on disk, checked before anything starts.

The output directories must be directories we can write; `--init_from` must be an export of this
model; `--resume` must find a checkpoint it can continue (complete, of this backend, model and
world) or, without one, must not be about to destroy a record it cannot continue; a record
has one writer at a time; and a checkpoint directory belongs to one run, written by one process
at a time. Every problem is a ConfigError (one line, exit code 2, nothing written).

A checkpoint or an export is read only after its signed manifest (training/manifest.py) says this
user's suite wrote it as it is, or the user trusts it (--trust_checkpoint). Every rank checks it (and
so refuses it as rank 0 does); its files are hashed once per machine.
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from core.owned import TORCH_FORMAT, check_out, is_record
from core.records import read_summary
from gptlite.errors import ConfigError
from training import checkpoint, manifest
from training.locks import FileLock, LockHeld


def writable_dir(name: str, path: str) -> None:
    """`path` is a directory we can write into, or can be created as one."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{name}: {path} exists and is not a directory")
    existing = p
    while not existing.exists():
        existing = existing.parent
    try:  # a real write: permission bits alone say nothing for root, or on a read-only mount
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{name}: {path} is not writable (creating a file in {existing} failed: {e.strerror})") from None


FILE_SUFFIXES = (".json", ".pt", ".pth", ".bin", ".md", ".png")


def writable_out(flag: str, path: str, writes: str | None = None) -> None:
    """A tool's --out: a directory that can be written, and not inside what a run owns, its record or
    its checkpoint directory (core/owned.py). `writes`: the file the tool writes in it, for the one
    line that refuses a file's name (an existing file, or a name with a file's suffix: --out was a
    file in fake_world and export before it named a directory in every tool)."""
    check_out(flag, path)
    if writes and (Path(path).is_file() or Path(path).suffix in FILE_SUFFIXES):
        raise ConfigError(f"{flag} {path}: {flag} names a directory (this tool writes {writes} in it); "
                          f"give the directory, e.g. {flag} {Path(path).parent}")
    writable_dir(flag, path)


def init_weights(path: str, workload, trust: bool = False) -> dict:
    """The export in `path` (python -m training.export), its signature checked (`trust`:
    --trust_checkpoint), and checked against this run's model."""
    manifest.verify(Path(path).parent, f"init_from: {path}", trust, only=Path(path).name)
    try:  # weights-only, signed or trusted
        exported = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - not a torch file, truncated, or pickled code: all bad input
        raise ConfigError(f"init_from: {path} is not a file written by python -m training.export "
                          f"({type(e).__name__})") from None
    if not isinstance(exported, dict) or not isinstance(exported.get("model"), dict) or "step" not in exported:
        raise ConfigError(f"init_from: {path} is not an export of python -m training.export (it needs 'model' and "
                          "'step'; a plain state dict has neither)")
    expected = {k: tuple(v.shape) for k, v in workload.meta().state_dict().items()}
    found = {k: tuple(v.shape) for k, v in exported["model"].items() if isinstance(v, torch.Tensor)}
    if found != expected:
        wrong = sorted(set(expected) ^ set(found)) or sorted(k for k in expected if expected[k] != found.get(k))
        raise ConfigError(f"init_from: {path} holds another model than this run's (first difference: {wrong[0]}: "
                          f"{found.get(wrong[0])} here, {expected.get(wrong[0])} for this run)")
    return exported


@dataclass(frozen=True)
class Resume:
    directory: Path
    meta: dict
    shapes_checked: bool = True  # False: a checkpoint whose parameter shapes could not be read up front
    verified: bool = True  # False: loaded on --trust_checkpoint, without a manifest signed by this user

    @property
    def start_step(self) -> int:
        return self.meta["step"] + 1


def resume_point(cfg, world_size: int, global_batch: int, workload, record_dir: Path | None,
                 checkpoint_format: str) -> Resume | None:
    """Where `--resume` continues from: a checkpoint it can continue, or None to start afresh
    (only when no record would be lost: none exists, or it is the same run's unfinished attempt
    that died before its first checkpoint)."""
    found = inspect(Path(cfg.save_dir), cfg.trust_checkpoint)
    summary = read_summary(record_dir / "summary.json") if record_dir is not None else None
    if found is None:
        if summary is None:
            return None
        if summary.status == "ok":
            raise ConfigError(f"resume: {record_dir} is a finished run and --save_dir {cfg.save_dir} holds no "
                              "checkpoint to continue it from; check --save_dir")
        recorded = _recorded_save_dir(record_dir)
        if recorded is None or Path(recorded).resolve() != Path(cfg.save_dir).resolve():
            raise ConfigError(f"resume: --save_dir {cfg.save_dir} holds no checkpoint, and {record_dir} was written "
                              f"with --save_dir {recorded}; resuming would start it over. Check --save_dir")
        difference = _setting_difference(recorded_config(record_dir), cfg, global_batch, workload)
        if difference:
            raise ConfigError(f"resume: {record_dir} was recorded with other settings ({difference}) and --save_dir "
                              f"{cfg.save_dir} holds no checkpoint of it; starting over would replace it with another "
                              "run: give this run another --run_name, or resume with the record's settings")
        return None  # the previous attempt of this run stopped before its first checkpoint
    meta = found.meta
    where = f"resume: the checkpoint {found.directory}"
    for key, ours in (("backend", cfg.backend), ("format", checkpoint_format), ("global_batch", global_batch)):
        if meta.get(key) != ours:
            raise ConfigError(f"{where} has {key} {meta.get(key)!r}, this run {ours!r}; start a new run, or move "
                              "between backends with python -m training.export and --init_from")
    # Checkpoints from before models had names are GPT-lite's.
    written = {"name": "gptlite", **meta["model"]} if "model" in meta else None
    if written is not None and written != workload.description:
        raise ConfigError(f"{where} is of another model ({_model_difference(written, workload.description)})")
    # The same name and settings, but the model's code may have changed since (a model file edited).
    shapes = checkpoint.written_shapes(found.directory, meta)
    if shapes is not None:
        ours = checkpoint.param_shapes(workload.meta())
        if shapes != ours:
            first = (sorted(set(shapes) ^ set(ours)) or sorted(k for k in ours if shapes[k] != ours[k]))[0]
            raise ConfigError(f"{where} holds other parameters than this run's model (first difference: {first}: "
                              f"{shapes.get(first)} there, {ours.get(first)} here): the model's code changed since it "
                              "was written; start a new run")
    if checkpoint_format != TORCH_FORMAT and meta.get("world_size") != world_size:
        raise ConfigError(f"{where} was written by {meta.get('world_size')} ranks; a {checkpoint_format} checkpoint "
                          f"resumes on the same number (this run has {world_size})")
    if summary is not None:  # continued into its record: one record, one run's settings
        difference = _setting_difference(recorded_config(record_dir), cfg, global_batch, None,
                                          free=RESUME_MAY_CHANGE)
        if difference:
            raise ConfigError(f"{where} continues {record_dir}, recorded with other settings ({difference}); a record "
                              "holds one run's settings: resume with them, or start a new run from the checkpoint's "
                              f"weights (python -m training.export {cfg.save_dir} --out DIR, then --init_from DIR/model.pt)")
    if found.start_step >= cfg.steps:
        state = " (its record is finished)" if summary is not None and summary.status == "ok" else ""
        raise ConfigError(f"{where} is at step {meta['step']}: with --steps {cfg.steps} there is nothing left to "
                          f"train{state}; ask for more --steps")
    return Resume(found.directory, meta, shapes_checked=shapes is not None, verified=found.verified)


def inspect(save_dir: Path, trust: bool = False) -> Resume | None:
    """The latest complete checkpoint under `save_dir`, checked against its manifest (`trust`:
    --trust_checkpoint) and readable; None if there is none."""
    if not save_dir.exists():
        return None
    if not save_dir.is_dir():
        raise ConfigError(f"resume: --save_dir {save_dir} is not a directory")
    pointer = save_dir / checkpoint.LATEST
    leftovers = sorted(p.name for p in save_dir.glob("step_*"))
    if not pointer.is_file():
        if leftovers:
            raise ConfigError(f"resume: --save_dir {save_dir} has checkpoints ({leftovers[-1]}) but no '{checkpoint.LATEST}' "
                              "file naming the complete one; restore it or pass the directory to training.export")
        return None
    directory = save_dir / pointer.read_text().strip()
    if not (directory / "meta.json").is_file():
        raise ConfigError(f"resume: '{checkpoint.LATEST}' in {save_dir} names {directory.name}, which has no "
                          "readable meta.json (a missing or damaged checkpoint)")
    where = f"resume: the checkpoint {directory}"
    # Before anything in it is read beyond JSON: signed by this user, every file as written.
    verified = manifest.verify(directory, where, trust)
    meta = checkpoint.checked_meta(directory, where)
    if not verified:  # trusted without a manifest: at least whole torch files
        for f in sorted(directory.rglob("*.pt")):
            if not _complete_torch_file(f):
                raise ConfigError(f"{where} is damaged: {f.relative_to(directory)} is truncated or not a torch file")
    return Resume(directory, meta, verified=verified)


def _complete_torch_file(path: Path) -> bool:
    """torch.save writes a zip archive: a truncated or overwritten file fails its checksum test."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip() is None
    except (OSError, zipfile.BadZipFile):
        return False


def recorded_run_id(record_dir: Path | None) -> str | None:
    """The id of the run that wrote the record (config.json), which its resumed attempts keep."""
    if record_dir is None:
        return None
    try:
        run_id = json.loads((record_dir / "config.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) else None


def outside_records(save_dir: str, record_dir: Path | None) -> None:
    """`save_dir` is not inside a run record (this run's, or any other's: a directory with a run's
    summary.json, or a run's config.json while it runs: core.owned.is_record): a record is replaced as
    a whole (--overwrite, --resume starting over, a sweep's retry), and checkpoints in it would go with it."""
    path = Path(save_dir).resolve()
    ours = record_dir.resolve() if record_dir is not None else None
    for ancestor in (path, *path.parents):
        if ancestor == ours or read_summary(ancestor / "summary.json") is not None or is_record(ancestor):
            raise ConfigError(f"save_dir: {save_dir} is inside the run record {ancestor}, which is replaced as a whole "
                              "(--overwrite, a sweep's retry) with everything in it; keep checkpoints outside records")


def replaceable(record_dir: Path) -> None:
    """A record about to be replaced (--overwrite, or --resume starting it over) holds no
    checkpoints: they would be deleted with it (a --save_dir inside a record, from before that was
    refused, or a record directory that is a --save_dir)."""
    for meta in sorted(record_dir.rglob("meta.json")):
        if meta.parent.name.startswith("step_"):
            raise ConfigError(f"run_name: {record_dir} holds checkpoints ({meta.parent}), which replacing the record "
                              "would delete; move them out of it first, or choose another --run_name")


def own_save_dir(save_dir: str, run_id: str, run_name: str | None, record_dir: Path | None) -> None:
    """`save_dir` may take this run's checkpoints: it holds none, or only this run's (a resumed
    attempt of the same record, by its run id). Another run's checkpoints are never written
    among, rotated or replaced, --overwrite or not: that run may still want them."""
    found = checkpoint.steps(save_dir)
    if not found:
        return  # nothing to lose: a new or emptied directory
    how = ("choose another --save_dir; to start from those weights: python -m training.export "
           f"{save_dir} --out DIR, then --init_from DIR/model.pt")
    owner = checkpoint.owner(save_dir)
    if owner is not None:
        if owner.get("run_id") == run_id:
            return
        theirs = owner.get("record")
        gone = theirs is not None and not Path(theirs).exists()
        if record_dir is not None and theirs == str(record_dir.resolve()) and not gone:
            whose = (f"an earlier run of {record_dir} (a run that starts it over, --overwrite too, does not replace "
                     "them; --resume continues it)")
        else:
            whose = f"the run {theirs}" + (" (its record is gone)" if gone else "")
        raise ConfigError(f"save_dir: {save_dir} holds the checkpoints of {whose}; one run per checkpoint directory: "
                          f"{how}")
    # Checkpoints from before directories had owners name their run by its record's name only.
    metas = [checkpoint.read_meta(p) or {} for p in found]
    names = sorted({meta["run_name"] for meta in metas if isinstance(meta.get("run_name"), str)})
    resumed = checkpoint.latest(save_dir)
    if record_dir is not None and resumed is not None and resumed[1].get("run_name") == run_name \
            and (record_dir / "config.json").exists():
        return  # this record's own checkpoints, resumed: the first checkpoint it writes claims the directory
    if not names:
        raise ConfigError(f"save_dir: {save_dir} holds checkpoints ({found[-1].name}) whose meta.json names no run "
                          f"(damaged, or written by another tool); one run per checkpoint directory: {how}")
    raise ConfigError(f"save_dir: {save_dir} holds checkpoints of the run {', '.join(names)} ({found[-1].name}); "
                      f"one run per checkpoint directory: --resume --run_name {names[-1]} continues it, or {how}")


# RunConfig fields that do not define a run: where it is recorded, how much it says, how long it
# waits for a collective, when it saves, whether its inputs are trusted, and --steps (a resume may
# ask for more).
NOT_THE_RUN = ("steps", "resume", "overwrite", "quiet", "log_every", "dry_run", "local_rank", "runs_dir", "run_name",
               "dist_timeout_s", "save_dir", "save_every", "keep_checkpoints", "trust_checkpoint", "trust_data",
               "overwrite_cache")


# What a resume from a checkpoint may change besides: how the global batch is split (a "torch"
# checkpoint resumes on another world size), and --init_from (where the run's first weights came
# from; a resume cannot pass it). The checkpoint's own checks cover the model.
RESUME_MAY_CHANGE = ("micro_batch", "grad_accum", "init_from")


def _setting_difference(recorded: dict | None, cfg, global_batch: int, workload, free: tuple = ()) -> str | None:
    """How this run differs from the one recorded (config.json): its settings but `free`, global
    batch, and (with `workload`) its model, description and size (a model file may have been
    edited); None if it is the same."""
    recorded = recorded or {}
    skip = (*NOT_THE_RUN, *free)
    before = {k: v for k, v in (recorded.get("run") or {}).items() if k not in skip}
    now = {k: v for k, v in cfg.to_dict().items() if k not in skip}
    for key in sorted(set(before) & set(now)):  # a setting the record's code did not have yet is its default
        if before[key] != now[key]:
            return f"--{key} {before[key]!r} there, {now[key]!r} here"
    model = (("model", workload.description), ("n_params", workload.n_params)) if workload is not None else ()
    for key, ours in (("global_batch", global_batch), *model):
        if recorded.get(key) != ours:
            return f"{key} {recorded.get(key)!r} there, {ours!r} here"
    return None


def recorded_config(record_dir: Path) -> dict | None:
    """A record's config.json, or None where there is none (or it does not read)."""
    try:
        config = json.loads((record_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _recorded_save_dir(record_dir: Path) -> str | None:
    try:
        return json.loads((record_dir / "config.json").read_text())["run"]["save_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _model_difference(theirs: dict, ours: dict) -> str:
    for key in ours:
        if theirs.get(key) != ours[key]:
            return f"{key} {theirs.get(key)!r} there, {ours[key]!r} here"
    return "different"


class SaveDirLock(FileLock):
    """One writer per checkpoint directory: an exclusive lock on save_dir/owner.lock, held until exit."""

    def __init__(self, save_dir: str):
        try:
            super().__init__(Path(save_dir) / checkpoint.LOCK)
        except LockHeld as e:
            raise LockHeld(f"save_dir: {save_dir} is being written by {e.holder}; one run per checkpoint directory: "
                           "wait for it to finish, or choose another --save_dir", e.holder) from None


class NVMeLock(FileLock):
    """One run per NVMe swap directory: DeepSpeed deletes each rank's swap folder there as it
    starts, which would pull another live run's parameters from under it."""

    def __init__(self, nvme_path: str):
        try:
            super().__init__(Path(nvme_path) / "gptlite.lock")
        except LockHeld as e:
            raise LockHeld(f"nvme_path: {nvme_path} is being used by {e.holder}; DeepSpeed clears each rank's swap "
                           "folder there as it starts, so two runs cannot share it: wait for it to finish, or choose "
                           "another --nvme_path", e.holder) from None
