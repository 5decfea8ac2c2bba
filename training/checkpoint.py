"""Training checkpoints: everything needed for a resumed run to continue exactly.

    save_dir/
      owner.json              the run these checkpoints belong to: its id and record, and each
                              kept checkpoint's signed manifest (training/manifest.py)
      owner.lock              held by the run writing into the directory (training/preflight.py)
      step_00000009/          the state after optimizer step 9 (a resumed run starts at step 10)
        meta.json             step, backend, format, world size, run (its id, record and name),
                              the model's parameter names and shapes
        model/                the backend's own format: "torch" (state.pt: model, optimizer,
                              LR schedule, grad scaler), "dcp" (torch.distributed.checkpoint,
                              sharded, plus extra.pt) or DeepSpeed's (engine.save_checkpoint)
        rng/rank<k>.pt        each rank's torch RNG states (dropout)
        manifest.json         every file's size and SHA-256, signed with this user's key
                              (training/manifest.py): checked before anything in it is loaded
      latest                  the name of the newest complete checkpoint

The data position needs no saving: the batch of a step is a pure function of (seed, step).
A checkpoint is written into `.step_<N>.partial/` and renamed into place once every rank has
finished writing it (its manifest written last, inside it, so that the two appear together),
then `latest` is replaced; a run killed while saving leaves the previous checkpoint as the latest.

A checkpoint directory belongs to one run (a record and its resumed attempts, by the run id in
its config.json): training/preflight.py refuses any other run into it before anything starts,
and rotation (`keep`) deletes only checkpoints this run wrote, never the one `latest` names.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from core.owned import CHECKPOINT_FORMATS, LATEST, LOCK, OWNER, STEP_PREFIX  # the layout (core/owned.py): checkpoint.LATEST, ...
from core.records import atomic_write_json, atomic_write_text
from gptlite.errors import ConfigError
from training import manifest



def name_of(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest(save_dir: str | Path) -> tuple[Path, dict] | None:
    """The newest complete checkpoint under save_dir and its meta.json, or None."""
    pointer = Path(save_dir) / LATEST
    if not pointer.is_file():
        return None
    directory = Path(save_dir) / pointer.read_text().strip()
    meta = read_meta(directory)
    return None if meta is None else (directory, meta)


def param_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """The names and shapes of a model's state (meta.json's "params"), from its structure (the meta
    device): what a resumed run's model must have for the checkpoint to load."""
    return {name: list(value.shape) for name, value in model.state_dict().items()}


WRAPPER_PARTS = {"module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_offload_wrapped_module"}


def plain_name(name: str) -> str:
    """A parameter's name in the bare model, the wrappers' parts dropped (GPT-lite has no submodule called
    `module`): the names a checkpoint's meta.json records and an export writes."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def written_shapes(directory: Path, meta: dict) -> dict[str, list[int]] | None:
    """The parameter names and shapes a checkpoint holds: recorded in its meta.json, or for a
    checkpoint from before they were, read from the "torch" and "dcp" formats' own files (without
    loading the tensors); None where neither can say (DeepSpeed's engine format). DCP's metadata is
    a pickle: only for a checkpoint its manifest verified, or one the user trusts."""
    if isinstance(meta.get("params"), dict):
        return meta["params"]
    try:
        if meta.get("format") == "torch":
            state = torch.load(directory / "model" / "state.pt", map_location="cpu", mmap=True, weights_only=True)
            return {plain_name(k): list(v.shape) for k, v in state["model"].items()}
        if meta.get("format") == "dcp":
            from torch.distributed.checkpoint import FileSystemReader

            stored = FileSystemReader(str(directory / "model" / "dcp")).read_metadata().state_dict_metadata
            return {plain_name(k.removeprefix("model.")): list(v.size) for k, v in stored.items()
                    if k.startswith("model.") and hasattr(v, "size")}
    except Exception:  # noqa: BLE001 - unreadable here: the load will say
        return None
    return None


def owner(save_dir: str | Path) -> dict | None:
    """Who the checkpoints under save_dir belong to ({"run_id", "record"}), or None if no run claimed them."""
    path = Path(save_dir) / OWNER
    if not path.exists():
        return None
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        found = None
    return found if isinstance(found, dict) else {"run_id": None, "record": f"unknown ({path} is unreadable)"}


def steps(save_dir: str | Path) -> list[Path]:
    """The complete checkpoints under save_dir, oldest first."""
    return sorted(p for p in Path(save_dir).glob("step_*") if p.is_dir() and _step_of(p) is not None)


def _step_of(directory: Path) -> int | None:
    number = directory.name.removeprefix("step_")
    return int(number) if number.isdigit() else None


def read_meta(directory: Path) -> dict | None:
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def checked_meta(directory: Path, where: str) -> dict:
    """The checkpoint's meta.json, with the fields every reader relies on checked; ConfigError (one
    line, starting with `where`, naming the field) for one that is not what save() writes."""
    path = directory / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {path} is not readable JSON ({type(e).__name__}; a missing or damaged "
                          "checkpoint)") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{where}: {path} holds a {type(meta).__name__}; a checkpoint's meta.json is an object "
                          "(step, format, backend, ...)")
    if not isinstance(meta.get("step"), int) or isinstance(meta.get("step"), bool) or meta["step"] < 0:
        raise ConfigError(f"{where}: {path}: step must be an integer >= 0 (got {meta.get('step')!r})")
    if meta.get("format") not in CHECKPOINT_FORMATS:
        raise ConfigError(f"{where}: {path}: format must be one of {', '.join(CHECKPOINT_FORMATS)} "
                          f"(got {meta.get('format')!r})")
    for key in ("model", "params"):  # absent from checkpoints older than these fields
        if key in meta and not isinstance(meta[key], dict):
            raise ConfigError(f"{where}: {path}: {key} must be an object (got {type(meta[key]).__name__})")
    return meta


def written_by(directory: Path, run_id: str, run_name: str | None) -> bool:
    """Whether the checkpoint in `directory` is this run's. Checkpoints from before runs had ids
    name their run by its record's name only."""
    meta = read_meta(directory)
    if meta is None:
        return False
    if "run_id" in meta:
        return meta["run_id"] == run_id
    return run_name is not None and meta.get("run_name") == run_name


class CheckpointNotWritten(Exception):
    """A checkpoint could not be written for want of space: said in one line (training/run.py)."""


def failure_chain(error: BaseException):
    """`error`, the exceptions it was raised from, and those a library gathered inside it
    (torch.distributed.checkpoint's CheckpointException carries each rank's own)."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]


def no_space(error: BaseException, directory: Path) -> str | None:
    """"no space left on device" (or the quota's words) where that is why writing into `directory`
    failed: an errno in the exception's chain, or, where the writer kept none (torch.save's zip writer
    says "unexpected pos"), the filesystem itself out of space or inodes."""
    chain = list(failure_chain(error))
    for e in chain:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return os.strerror(e.errno).lower()
    if any(not isinstance(e, Exception) and not hasattr(e, "failures") for e in chain):
        return None  # stopped (SIGTERM, Ctrl-C): not for want of space, however full the disk
    try:
        fs = os.statvfs(directory)
    except OSError:
        return None
    if fs.f_bavail * fs.f_frsize < FULL_BELOW_BYTES or (fs.f_files and not fs.f_favail):
        return os.strerror(errno.ENOSPC).lower()
    return None


# A filesystem with less free than this after a failed write is full: a writer fills what is left
# before it fails (its last write is partial), so a full disk reads a few blocks at most.
FULL_BELOW_BYTES = 2**20


def save(backend, save_dir: str | Path, step: int, rank: int, meta: dict, keep: int = 0) -> Path:
    """Write the checkpoint of `step` (collective: every rank calls it); keep this run's newest
    `keep`. `meta` names the run: run_id, record (its directory) and run_name. A save that fails
    leaves the previous checkpoint the latest and removes what it wrote; out of space, it raises
    CheckpointNotWritten saying so."""
    save_dir = Path(save_dir)
    final = save_dir / name_of(step)
    partial = save_dir / f".{final.name}.partial"
    try:
        return _save(backend, save_dir, step, rank, meta, keep, final, partial)
    except BaseException as e:
        full = no_space(e, save_dir)  # before the partial files go: they fill the disk
        free = shutil.disk_usage(save_dir).free if full and save_dir.is_dir() else 0
        shutil.rmtree(partial, ignore_errors=True)  # every rank: another may still have been writing into it
        if full is None:
            raise
        found = latest(save_dir)
        left = f"its partial files are left in {partial}" if partial.exists() else "its partial files were removed"
        raise CheckpointNotWritten(
            f"checkpoint of step {step} not written: {full} in {save_dir} ({free / 2**20:.1f} MiB free); {left}; "
            + (f"{found[0].name} is still the latest" if found else "there is no earlier checkpoint")) from e


def _save(backend, save_dir: Path, step: int, rank: int, meta: dict, keep: int, final: Path, partial: Path) -> Path:
    run_id, run_name = meta["run_id"], meta["run_name"]
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
        (partial / "rng").mkdir(parents=True)
    _barrier()
    backend.save_checkpoint(partial / "model")
    torch.save(rng_state(), partial / "rng" / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        if (owner(save_dir) or {}).get("run_id") != run_id:  # claimed with its first checkpoint
            atomic_write_json(save_dir / OWNER, {"run_id": run_id, "record": meta["record"]})
        atomic_write_json(partial / "meta.json", {"step": step, "format": backend.checkpoint_format, **meta})
        manifest.write(partial)  # every rank's files are complete (the barrier): signed, then put in place
        if final.exists():
            if not written_by(final, run_id, run_name):  # preflight keeps other runs out: never replace theirs
                raise RuntimeError(f"{final} was written by another run; not replacing it")
            shutil.rmtree(final)
        os.replace(partial, final)
        atomic_write_text(save_dir / LATEST, final.name + "\n")
        if keep:
            _rotate(save_dir, final, keep, run_id, run_name)
        _record_manifest(save_dir, run_id, meta["record"], final.name, final / manifest.MANIFEST)
    _barrier()
    return final


def _record_manifest(save_dir: Path, run_id: str, record: str, name: str, signed: Path) -> None:
    """The owner file keeps the signed manifest of each checkpoint of its run that is still there (rotated
    ones dropped): manifest.verify holds a checkpoint's own manifest.json to this copy, so neither can be
    replaced alone."""
    found = owner(save_dir) or {}
    kept = found.get("checkpoints") if found.get("run_id") == run_id and isinstance(found.get("checkpoints"), dict) else {}
    kept = {step: body for step, body in kept.items() if (save_dir / step).is_dir()}
    kept[name] = json.loads(signed.read_text())
    atomic_write_json(save_dir / OWNER, {"run_id": run_id, "record": record, "checkpoints": kept})


def _rotate(save_dir: Path, newest: Path, keep: int, run_id: str, run_name: str | None) -> None:
    """Delete this run's checkpoints older than `newest` beyond the newest `keep` (`newest` among
    them): another run's are not ours to delete, and a newer-numbered one left by a killed attempt
    of this run is replaced when this run gets there."""
    step = _step_of(newest)
    older = [p for p in steps(save_dir) if _step_of(p) < step and written_by(p, run_id, run_name)]
    for old in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old)


def load(backend, directory: Path, rank: int) -> None:
    """Restore the backend's state and this rank's RNG from a checkpoint directory."""
    backend.load_checkpoint(directory / "model")
    rng = directory / "rng" / f"rank{rank}.pt"
    if rng.exists():  # absent when the world size changed; the RNG then starts from the seed
        set_rng_state(torch.load(rng, weights_only=True))
