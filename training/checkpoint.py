"""Training checkpoints: everything needed for a resumed run to continue exactly.

    save_dir/
      step_00000009/          the state after optimizer step 9 (a resumed run starts at step 10)
        meta.json             step, backend, format, world size, run
        model/                the backend's own format: "torch" (state.pt: model, optimizer,
                              LR schedule, grad scaler), "dcp" (torch.distributed.checkpoint,
                              sharded, plus extra.pt) or "deepspeed" (engine.save_checkpoint)
        rng/rank<k>.pt        each rank's torch RNG states (dropout)
      latest                  the name of the newest complete checkpoint

The data position needs no saving: the batch of a step is a pure function of (seed, step).
A checkpoint is written into `.step_<N>.partial/` and renamed into place once every rank has
finished writing it, then `latest` is replaced; a run killed while saving leaves the previous
checkpoint as the latest.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from core.records import atomic_write_json, atomic_write_text

LATEST = "latest"


def name_of(step: int) -> str:
    return f"step_{step:08d}"


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
    meta = directory / "meta.json"
    if not meta.is_file():
        return None
    return directory, json.loads(meta.read_text())


def save(backend, save_dir: str | Path, step: int, rank: int, meta: dict, keep: int = 0) -> Path:
    """Write the checkpoint of `step` (collective: every rank calls it); keep the newest `keep`."""
    save_dir = Path(save_dir)
    final = save_dir / name_of(step)
    partial = save_dir / f".{final.name}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
        (partial / "rng").mkdir(parents=True)
    _barrier()
    backend.save_checkpoint(partial / "model")
    torch.save(rng_state(), partial / "rng" / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        atomic_write_json(partial / "meta.json", {"step": step, "format": backend.checkpoint_format, **meta})
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        atomic_write_text(save_dir / LATEST, final.name + "\n")
        if keep:
            for old in sorted(save_dir.glob("step_*"))[:-keep]:
                shutil.rmtree(old)
    _barrier()
    return final


def load(backend, directory: Path, rank: int) -> None:
    """Restore the backend's state and this rank's RNG from a checkpoint directory."""
    backend.load_checkpoint(directory / "model")
    rng = directory / "rng" / f"rank{rank}.pt"
    if rng.exists():  # absent when the world size changed; the RNG then starts from the seed
        set_rng_state(torch.load(rng))
