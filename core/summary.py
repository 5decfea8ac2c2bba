"""A run's summary.json as a type: written by the loop, settled by the sweep, read by analysis.

Every field is always present (null where not known yet, as in a run that failed early), so
readers never guess which keys exist. runs/README.md documents each field; tests check that the
two agree. SCHEMA_VERSION changes when a field changes meaning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

SCHEMA_VERSION = 1
STATUSES = ("running", "ok", "failed", "oom", "timeout", "cancelled")
FINISHED = ("ok", "oom", "failed", "timeout", "cancelled")


@dataclass
class RunSummary:
    run_name: str
    status: str = "running"
    error: str | None = None
    # What ran.
    backend: str | None = None
    model: str | None = None  # --model: gptlite, hf:<type>, torchvision:<name>, or the user's file or module
    preset: str | None = None
    attention: str | None = None
    world_size: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    global_batch: int | None = None
    precision: str | None = None
    ckpt_interval: int | None = None
    ckpt_plan: str | None = None  # what each block did, where a plan (--ckpt_plan, --ckpt_policy auto) decided
    n_params: int | None = None
    steps: int | None = None
    device_name: str | None = None
    # Throughput.
    timed_steps: int | None = None
    samples_per_s: float | None = None
    # The spread of the timed steps' samples/s: their first and third quartiles (the median between).
    samples_per_s_p25: float | None = None
    samples_per_s_p75: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    # FLOPs of one sample's forward and backward (core/flops.sample_flops): model, counted, recomputed.
    flops_per_sample: dict | None = None
    # Memory.
    mem_source: str | None = None
    mem_peak_bytes: int | None = None
    mem_avg_bytes: float | None = None
    mem_reserved_peak_bytes: int | None = None
    mem_rss_peak_bytes: int | None = None
    mem_breakdown: dict | None = None
    mem_activation_peak_bytes: int | None = None
    model_state_bytes: dict | None = None
    model_state_estimate: dict | None = None
    # Communication: the collectives of the profiled step (core/comm.py), and the theory beside them.
    comm: dict | None = None
    # Compilation (--compile): rank 0's dynamo statistics over the run (backends/compile.py).
    compile: dict | None = None
    # Training.
    final_loss: float | None = None
    val_loss: float | None = None
    wall_time_s: float | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)} (got {self.status!r})")

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "RunSummary":
        """The summary in a summary.json (fields of other schema versions are left out)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def ended(self, status: str, error: str | None, wall_time_s: float | None = None) -> "RunSummary":
        """This summary with the run's end: its status, the error that caused it and the wall time."""
        return dataclasses.replace(self, status=status, error=error,
                                   wall_time_s=self.wall_time_s if wall_time_s is None else wall_time_s)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


def field_names() -> list[str]:
    return ["schema_version", *(f.name for f in fields(RunSummary))]
