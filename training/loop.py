"""The one step loop every backend runs through.

Per step: this rank's micro-batches (backend.micro_step / forward / backward), then backend.step.
After each step the ranks exchange one small vector (loss, step time, memory), so every logged
number is global: the loss is the mean over the whole global batch, the step time the slowest
rank's, memory the largest rank's.

Timing: steps [warmup_steps, steps - mem_profile_steps) are timed; the last mem_profile_steps
steps run inside the memory profile (core/memory_profile.py), entered as a context, so a step
that fails still closes it, and are not timed.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from backends.base import Backend
from backends.compile import mark_step
from core.dist import gather_floats, synchronize
from core.memory import AllocatorMeter, ModelStateMeter, current_rss_bytes, phase, storage_roles
from core.memory_profile import ProfiledWindow
from core.records import RunRecord
from training import checkpoint
from training.progress import Progress

if TYPE_CHECKING:
    from training.setup import Setup


def accumulate_gradients(backend: Backend, micro_batches, grad_accum: int, device: torch.device,
                         after_pass: Callable[[], None] | None = None,
                         weights: list[float] | None = None) -> torch.Tensor:
    """Forward and backward over one step's micro-batches; this rank's mean loss (detached).

    Gradients are synchronised across ranks only on the last micro-step. `after_pass` runs after
    each forward and each backward (the memory profile notes the backend's tensors there). `weights`:
    each micro-batch's loss weight (BatchLayout.micro_weights: padded samples), None for 1.
    """
    loss_sum = torch.zeros((), device=device)
    for m, (x, y) in enumerate(micro_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with backend.micro_step(sync=m == grad_accum - 1):
            if backend.cudagraphs and m == 0:  # one step a generation: its micro-steps' gradients accumulate
                mark_step()
            with phase("forward"):
                loss = backend.forward(x, y)
                if weights is not None:
                    loss = loss * weights[m]
            if after_pass is not None:
                after_pass()
            with phase("backward"):
                backend.backward(loss)
            if after_pass is not None:
                after_pass()
        loss_sum += loss.detach().float()
    return loss_sum / grad_accum


@dataclass
class LoopResult:
    """What the steps measured on this rank (training/results.py gathers it from every rank)."""

    final_loss: float | None = None
    val_loss: float | None = None
    timed_rates: list[float] = field(default_factory=list)
    allocator: dict = field(default_factory=dict)
    profiled: dict = field(default_factory=dict)
    state_bytes: dict = field(default_factory=dict)


class StepLoop:
    """Steps [start, cfg.steps) of one run: timing, memory, logging, evaluation, checkpoints."""

    def __init__(self, setup: "Setup", backend: Backend, record: RunRecord, start: int, trackers=None):
        self.s, self.cfg, self.env = setup, setup.cfg, setup.env
        self.backend, self.record, self.start = backend, record, start
        self.trackers = trackers  # training/trackers.Trackers on rank 0 with --tracker, else None
        self._data_roles: dict | None = None
        self.device = setup.env.device
        self.progress = Progress(self.cfg.steps, enabled=self.env.is_main and not self.cfg.quiet)

    def run(self) -> LoopResult:
        cfg, device = self.cfg, self.device
        result = LoopResult()
        # Everything built so far (libraries, model, backend) lives for the whole run: moved out of
        # the collector's generations, a full collection in a step no longer walks the harness's
        # few hundred thousand objects (about 3% of a small-preset CPU step otherwise).
        gc.freeze()
        timed_end = max(0, cfg.steps - cfg.mem_profile_steps)
        allocator = AllocatorMeter(device)
        states = ModelStateMeter(self.backend.accounting(), device)
        window = ProfiledWindow(device) if cfg.mem_profile_steps else None
        entered = False
        with contextlib.ExitStack() as profiling:
            profiling.callback(states.close)
            for step in range(self.start, cfg.steps):
                if self.s.fault is not None:
                    self.s.fault.maybe_fire(step)
                if step == self.start + cfg.warmup_steps:
                    allocator.start()
                profiled = window is not None and step >= timed_end
                if profiled and not entered:
                    entered = bool(profiling.enter_context(window))
                last = step == cfg.steps - 1
                line = self._step(step, states, window if profiled else None, last, result)
                timed = self.start + cfg.warmup_steps <= step < timed_end
                allocated = allocator.sample() if timed else None
                line = self._gather(step, line, allocated, timed, result)
                if last:
                    profiling.close()  # the memory profile ends with the last training step
                self._log_evaluate_save(step, line, last, result)
        self.progress.close()
        result.allocator = allocator.stats()
        result.profiled = window.result() if entered else {}
        return result

    def _step(self, step: int, states: ModelStateMeter, window: ProfiledWindow | None, last: bool,
              result: LoopResult) -> dict:
        backend, cfg = self.backend, self.cfg
        snapshot = (lambda: window.snapshot({**self.data_roles(), **states.roles()})) if window is not None else None
        if snapshot:
            snapshot()
            window.count_groups(start=True)
        lr = backend.lr()
        if last:
            states.watch_gathered()  # for model_state_bytes below
        synchronize(self.device)
        t0 = time.perf_counter()
        layout, data = self.s.layout, self.s.data
        loss = accumulate_gradients(backend, layout.micro_batches(data, "train", cfg.seed, step), cfg.grad_accum,
                                    self.device, snapshot, layout.micro_weights(data, "train", cfg.seed, step))
        if last:
            result.state_bytes = states.model_state_bytes()
        with phase("optimizer"):
            backend.step()
        if snapshot:
            window.count_groups(start=False)
            snapshot()
        synchronize(self.device)
        return {"loss": loss, "lr": lr, "dt": time.perf_counter() - t0}

    def data_roles(self) -> dict:
        """The storages of the tensors the dataset holds, as the memory profile's `data` role."""
        if self._data_roles is None:
            held = getattr(self.s.data, "held_tensors", None)
            self._data_roles = {ptr: ("data", size, where) for ptr, (_, size, where)
                                in storage_roles({"data": held() if held else []}).items()}
        return self._data_roles

    def _gather(self, step: int, line: dict, allocated: int | None, timed: bool, result: LoopResult) -> dict:
        ranks = gather_floats([line["loss"].item(), line["dt"], current_rss_bytes(), allocated or 0.0], self.device)
        loss = statistics.fmean(r[0] for r in ranks)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        result.final_loss = loss
        step_time = max(r[1] for r in ranks)
        rate = self.s.layout.global_batch / step_time
        if timed:
            result.timed_rates.append(rate)
        return {
            "step": step,
            "loss": loss,
            "lr": line["lr"],
            "step_time_s": step_time,
            "samples_per_s": rate,
            "tokens_per_s": rate * self.s.workload.tokens_per_sample if self.s.workload.tokens_per_sample else None,
            "timed": timed,
            "mem_rss_bytes": max(r[2] for r in ranks),
            "mem_allocated_bytes": max(r[3] for r in ranks) if allocated is not None else None,
        }

    def _log_evaluate_save(self, step: int, line: dict, last: bool, result: LoopResult) -> None:
        cfg, env = self.cfg, self.env
        is_eval = bool(cfg.eval_every and (step + 1) % cfg.eval_every == 0) or last
        if is_eval:
            result.val_loss = line["val_loss"] = self.evaluate()
            if not math.isfinite(result.val_loss):  # the same on every rank (gathered): all of them stop
                raise FloatingPointError(f"validation loss is {result.val_loss} after step {step}")
        if env.is_main and (step % cfg.log_every == 0 or is_eval or last):
            self.record.log(line)
            if self.trackers is not None:
                self.trackers.log(line)
            self.progress.update(step, line)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            checkpoint.save(self.backend, cfg.save_dir, step, env.rank, {
                "backend": cfg.backend, "world_size": env.world_size, "global_batch": self.s.layout.global_batch,
                "run_id": self.s.run_id, "record": str(self.record.dir.resolve()), "run_name": self.record.dir.name,
                "model": self.s.workload.description, "params": checkpoint.param_shapes(self.s.workload.meta())},
                keep=cfg.keep_checkpoints)

    def evaluate(self) -> float:
        """Mean validation loss over --eval_batches global batches (every rank its slice)."""
        cfg, layout, device = self.cfg, self.s.layout, self.device
        total = torch.zeros((), device=device)
        with self.backend.eval_mode():
            for k in range(cfg.eval_batches):
                weights = layout.micro_weights(self.s.data, "val", cfg.seed, k)
                for m, (x, y) in enumerate(layout.micro_batches(self.s.data, "val", cfg.seed, k)):
                    if self.backend.cudagraphs:
                        mark_step()
                    loss = self.backend.forward(x.to(device), y.to(device)).detach().float()
                    total += loss * weights[m] if weights is not None else loss
        local = total.item() / (cfg.eval_batches * cfg.grad_accum)
        return statistics.fmean(r[0] for r in gather_floats([local], device))
