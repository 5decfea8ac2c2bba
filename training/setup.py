"""What a run resolved before anything started (training/run.py prepare_run makes it; the step loop and the
run's life cycle read it): its own module, so that the loop (training/loop.py) reads it without
importing the life cycle that runs the loop."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from backends.base import Backend, Resolved
from core.config import RunConfig
from core.dist import DistEnv
from core.faults import Fault
from gptlite.data import BatchLayout
from models import Workload
from training import preflight
from training.locks import RecordLock


@dataclass
class Setup:
    """What a run resolved before anything started."""

    resolved: Resolved
    env: DistEnv
    workload: Workload  # the model and its data (models/)
    fault: Fault | None = None  # an injected fault (GPTLITE_FAULT), for the fault tests
    init: dict | None = None  # the --init_from export, read and checked once
    resume: preflight.Resume | None = None  # the checkpoint --resume continues
    lock: RecordLock | None = None  # held by rank 0 while it writes the record
    save_lock: preflight.SaveDirLock | None = None  # held by rank 0 while it writes into --save_dir
    nvme_locks: list = field(default_factory=list)  # held by rank 0 on the NVMe swap directories
    # Names the run in its record and its checkpoints; a resumed attempt keeps its record's.
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))
    layout: BatchLayout = field(init=False)

    def __post_init__(self):
        self.layout = BatchLayout(self.cfg.micro_batch, self.cfg.grad_accum, self.env.world_size, self.env.rank)

    @property
    def cfg(self) -> RunConfig:
        return self.resolved.cfg

    @property
    def backend_cls(self) -> type[Backend]:
        return self.resolved.backend

    @property
    def data(self):
        return self.workload.data

    @property
    def n_params(self) -> int:
        return self.workload.n_params

    def record(self) -> dict:
        """config.json's description of the run (the part known before training)."""
        return {
            "run": self.cfg.to_dict(),
            "plan": self.resolved.spec_record(),
            "model": self.workload.description,
            "n_params": self.n_params,
            "world_size": self.env.world_size,
            "ranks_per_node": self.env.local_world_size,
            "global_batch": self.layout.global_batch,
            "tokens_per_step": (self.layout.global_batch * self.workload.tokens_per_sample
                                if self.workload.tokens_per_sample else None),
            "data": self.data.describe(),
            "launcher": self.env.launcher,
        }
