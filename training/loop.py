"""The one training loop every backend runs through, and the run record it leaves.

Per step: this rank's micro-batches (backend.micro_step / forward / backward), then backend.step.
After each step the ranks exchange one small vector (loss, step time, memory), so every logged
number is global: the loss is the mean over the whole global batch, the step time the slowest
rank's, memory the largest rank's.

Timing: steps [warmup_steps, steps - mem_profile_steps) are timed; the last mem_profile_steps
steps run under torch.profiler for the memory breakdown and are not timed.
"""

from __future__ import annotations

import gc
import json
import math
import secrets
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends import get_backend
from backends.base import Backend
from gptlite.data import BatchLayout, CharDataset, DataError
from gptlite.model import ConfigError, GPTConfig, build_model, count_parameters
from training import checkpoint, flops
from training.config import RunConfig
from training.dist import (DistEnv, broadcast_object, destroy_process_group, gather_floats, set_cpu_threads,
                           stop_with_launcher, synchronize)
from training.environment import device_name, environment
from training.faults import Fault
from training.memory import AllocatorMeter, ProfiledWindow, current_rss_bytes, peak_rss_bytes, phase
from training.records import RunRecord

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class MemoryBudgetExceeded(MemoryError):
    """The measured peak went over --mem_budget_gb (recorded as status oom)."""


class Terminated(Exception):
    """The launcher asked this rank to stop (SIGTERM), e.g. because another rank failed."""


def _raise_terminated(signum, frame):
    raise Terminated(f"terminated by signal {signal.Signals(signum).name} (launchers stop every rank when one "
                     "fails or dies)")


def is_oom(error: BaseException) -> bool:
    return isinstance(error, (torch.OutOfMemoryError, MemoryError))


@dataclass
class Setup:
    """What a run resolved from its configuration before training starts."""

    cfg: RunConfig
    env: DistEnv
    backend_cls: type[Backend]
    data: CharDataset
    model_cfg: GPTConfig
    n_params: int
    fault: Fault | None = None  # an injected fault (GPTLITE_FAULT), for the fault tests
    layout: BatchLayout = field(init=False)

    def __post_init__(self):
        self.layout = BatchLayout(self.cfg.micro_batch, self.cfg.grad_accum, self.env.world_size, self.env.rank)

    def resolved(self) -> dict:
        return {
            "run": self.cfg.to_dict(),
            "model": self.model_cfg.to_dict(),
            "n_params": self.n_params,
            "world_size": self.env.world_size,
            "global_batch": self.layout.global_batch,
            "tokens_per_step": self.layout.global_batch * self.model_cfg.block_size,
            "data": {
                "source": self.data.source,
                "vocab_size": self.data.vocab_size,
                "train_tokens": len(self.data.splits["train"]),
                "val_tokens": len(self.data.splits["val"]),
            },
            "launcher": self.env.launcher,
        }


def resolve(cfg: RunConfig) -> Setup:
    """Everything that can be checked before any process group exists. Raises ConfigError/DataError."""
    env = DistEnv.from_environment(cfg.device)
    backend_cls = get_backend(cfg.backend)
    cfg = backend_cls.resolve(cfg, env)
    if cfg.init_from is not None and not Path(cfg.init_from).is_file():
        raise ConfigError(f"init_from: file not found: {cfg.init_from}")
    if (cfg.run_name is not None and not cfg.overwrite and not cfg.resume
            and (Path(cfg.runs_dir) / cfg.run_name).exists()):
        raise ConfigError(
            f"run_name: {Path(cfg.runs_dir) / cfg.run_name} already exists "
            "(choose another --run_name, pass --overwrite, or --resume it)")
    fault = Fault.from_environment(cfg.backend, env.rank)  # a malformed GPTLITE_FAULT is bad input
    data = CharDataset.load(cfg.data, cfg.model_config().block_size)
    model_cfg = cfg.model_config(vocab_size=data.vocab_size)
    with torch.device("meta"):  # count parameters without allocating them
        from gptlite.model import GPTLite

        n_params = count_parameters(GPTLite(model_cfg))
    return Setup(cfg, env, backend_cls, data, model_cfg, n_params, fault)


def main(cfg: RunConfig) -> int:
    try:
        setup = resolve(cfg)
    except (ConfigError, DataError) as e:
        if int(_env_rank()) == 0:
            print(f"train.py: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if cfg.dry_run:
        if setup.env.is_main:
            print(json.dumps(setup.resolved(), indent=2))
        return EXIT_OK
    return Trainer(setup).run()


def _env_rank() -> str:
    import os

    return os.environ.get("RANK", "0")


def accumulate_gradients(backend: Backend, micro_batches, grad_accum: int, device: torch.device,
                         window: ProfiledWindow | None = None) -> torch.Tensor:
    """Forward and backward over one step's micro-batches; this rank's mean loss (detached).

    Gradients are synchronised across ranks only on the last micro-step. Under a profiled
    window, the backend's tensors are noted after each forward and backward (memory categories).
    """
    loss_sum = torch.zeros((), device=device)
    for m, (x, y) in enumerate(micro_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with backend.micro_step(sync=m == grad_accum - 1):
            with phase("forward"):
                loss = backend.forward(x, y)
            if window is not None:
                window.snapshot(backend.memory_roles())
            with phase("backward"):
                backend.backward(loss)
            if window is not None:
                window.snapshot(backend.memory_roles())
        loss_sum += loss.detach().float()
    return loss_sum / grad_accum


class Trainer:
    def __init__(self, setup: Setup):
        self.s = setup
        self.cfg = setup.cfg
        self.env = setup.env
        self.device = setup.env.device
        self.record: RunRecord | None = None
        self.backend: Backend | None = None
        self.summary: dict = {}
        self.resume_from: tuple[Path, dict] | None = None
        self.start_step = 0

    # ----------------------------------------------------------------------------------- run
    def run(self) -> int:
        signal.signal(signal.SIGTERM, _raise_terminated)
        stop_with_launcher()
        started = time.time()
        try:
            threads = set_cpu_threads(self.env)
            if self.s.backend_cls.needs_process_group:
                self.s.backend_cls.init_distributed(self.env, self.cfg.dist_timeout_s)
            self.resume_from = checkpoint.latest(self.cfg.save_dir) if self.cfg.resume else None
            self.start_step = self.resume_from[1]["step"] + 1 if self.resume_from else 0
            self.record = self._create_record()
            self._train(threads, started)
            if torch.distributed.is_initialized():
                # Every rank finishes together: one rank tearing its process group down while
                # another still writes the record breaks gloo's connections under it.
                torch.distributed.barrier()
            return EXIT_OK
        except BaseException as e:  # noqa: BLE001 - every failure must be recorded
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the failure be written
            self._record_failure(e, started)
            if isinstance(e, KeyboardInterrupt):
                raise
            return EXIT_FAILED
        finally:
            # Release the backend (DDP's Reducer holds the process group) while the group is
            # still registered: if the Reducer dropped the group's last reference, gloo's
            # destructor would join its worker threads with the GIL held and can deadlock
            # (pytorch/pytorch#56297).
            if self.backend is not None:
                self.backend.teardown()
                self.backend = None
            gc.collect()
            destroy_process_group()

    def _create_record(self) -> RunRecord:
        name = self.cfg.run_name or (
            f"{self.cfg.backend}-{self.cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}")
        record = RunRecord(Path(self.cfg.runs_dir) / name)
        if self.env.is_main:
            if self.resume_from is not None and record.dir.exists():
                record.continue_after(self.start_step - 1)
            else:
                record.create(overwrite=self.cfg.overwrite or self.cfg.resume)
        # The broadcast also makes the other ranks wait until the directory exists.
        name = broadcast_object(name)
        return record if self.env.is_main else RunRecord(Path(self.cfg.runs_dir) / name)

    # ------------------------------------------------------------------------------ training
    def _train(self, threads: int, started: float) -> None:
        cfg, env, layout = self.cfg, self.env, self.s.layout
        # Each rank's own dropout stream, the same in every run of this configuration.
        torch.manual_seed(cfg.seed * 1000 + env.rank)
        model = build_model(self.s.model_cfg, cfg.seed)
        if cfg.init_from:
            exported = torch.load(cfg.init_from, map_location="cpu")
            model.load_state_dict(exported["model"])
            self.start_step = exported["step"] + 1
        self.backend = backend = self.s.backend_cls(cfg, env)
        backend.setup(model)
        if self.resume_from is not None:
            checkpoint.load(backend, self.resume_from[0], env.rank)
        start = self.start_step
        if start >= cfg.steps:
            raise ConfigError(f"steps {cfg.steps}: the run starts at step {start} (from "
                              f"{cfg.init_from or self.resume_from[0]}); ask for more steps")
        if env.is_main:
            self.record.write_config({
                **self.s.resolved(),
                "start_step": start,
                "resumed_from": str(self.resume_from[0]) if self.resume_from else None,
                "backend": backend.describe(),
                "threads_per_rank": threads,
                "environment": environment(self.device),
            })
            self.summary = self._base_summary()
            self.summary["model_state_estimate"] = backend.describe().get("model_state_estimate")
            self.record.write_summary({**self.summary, "status": "running"})

        if cfg.mem_budget_gb and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.mem_budget_gb * 2**30 / total), self.device)
        fault = self.s.fault
        timed_end = max(0, cfg.steps - cfg.mem_profile_steps)
        meter = AllocatorMeter(self.device)
        window = ProfiledWindow(self.device) if cfg.mem_profile_steps else None
        progress = _progress(cfg, env)
        timed_rates: list[float] = []
        final_loss = val_loss = None
        state_bytes = {}

        for step in range(start, cfg.steps):
            if fault is not None:
                fault.maybe_fire(step)
            if step == start + cfg.warmup_steps:
                meter.start()
            profiling = window is not None and step >= timed_end
            if profiling and step == timed_end:
                window.__enter__()
            if profiling:
                window.snapshot(backend.memory_roles())
            lr = backend.lr()
            if step == cfg.steps - 1:
                backend.watch_gathered_params()  # for model_state_bytes below
            synchronize(self.device)
            t0 = time.perf_counter()
            loss = accumulate_gradients(backend, layout.micro_batches(self.s.data, "train", cfg.seed, step),
                                        cfg.grad_accum, self.device, window if profiling else None)
            if step == cfg.steps - 1:
                state_bytes = backend.model_state_bytes()
            with phase("optimizer"):
                backend.step()
            if profiling:
                window.snapshot(backend.memory_roles())
            synchronize(self.device)
            dt = time.perf_counter() - t0
            timed = start + cfg.warmup_steps <= step < timed_end
            allocated = meter.sample() if timed else None

            ranks = gather_floats([loss.item(), dt, current_rss_bytes(), allocated or 0.0], self.device)
            final_loss = statistics.fmean(r[0] for r in ranks)
            if not math.isfinite(final_loss):
                raise FloatingPointError(f"loss is {final_loss} at step {step}")
            step_time = max(r[1] for r in ranks)
            rate = layout.global_batch / step_time
            if timed:
                timed_rates.append(rate)

            is_eval = (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step == cfg.steps - 1
            if window is not None and step == cfg.steps - 1:
                window.__exit__(None, None, None)
            if is_eval:
                val_loss = self._evaluate(backend)
            if env.is_main and (step % cfg.log_every == 0 or step == cfg.steps - 1 or is_eval):
                line = {
                    "step": step,
                    "loss": final_loss,
                    "lr": lr,
                    "step_time_s": step_time,
                    "samples_per_s": rate,
                    "tokens_per_s": rate * self.s.model_cfg.block_size,
                    "timed": timed,
                    "mem_rss_bytes": max(r[2] for r in ranks),
                    "mem_allocated_bytes": max(r[3] for r in ranks) if allocated is not None else None,
                }
                if is_eval:
                    line["val_loss"] = val_loss
                self.record.log(line)
                progress.update(step, line)
            if cfg.save_every and (step + 1) % cfg.save_every == 0:
                checkpoint.save(backend, cfg.save_dir, step, env.rank, {
                    "backend": cfg.backend, "world_size": env.world_size, "global_batch": layout.global_batch,
                    "run_name": self.record.dir.name}, keep=cfg.keep_checkpoints)

        progress.close()
        self._finish(final_loss, val_loss, timed_rates, meter, window, state_bytes, started)

    def _evaluate(self, backend: Backend) -> float:
        cfg, layout = self.cfg, self.s.layout
        total = torch.zeros((), device=self.device)
        with backend.eval_mode():
            for k in range(cfg.eval_batches):
                for x, y in layout.micro_batches(self.s.data, "val", cfg.seed, k):
                    total += backend.forward(x.to(self.device), y.to(self.device)).detach().float()
        local = total.item() / (cfg.eval_batches * cfg.grad_accum)
        return statistics.fmean(r[0] for r in gather_floats([local], self.device))

    # ------------------------------------------------------------------------------- summary
    def _base_summary(self) -> dict:
        cfg, layout = self.cfg, self.s.layout
        return {
            "run_name": self.record.dir.name,
            "backend": cfg.backend,
            "preset": cfg.preset,
            "attention": cfg.attention,
            "world_size": self.env.world_size,
            "micro_batch": cfg.micro_batch,
            "grad_accum": cfg.grad_accum,
            "global_batch": layout.global_batch,
            "precision": cfg.precision,
            "ckpt_interval": cfg.ckpt_interval,
            "n_params": self.s.n_params,
            "steps": cfg.steps,
            "device_name": device_name(self.device),
        }

    def _finish(self, final_loss, val_loss, timed_rates, meter, window, state_bytes, started) -> None:
        allocator = meter.stats()
        profiled = window.result() if window is not None else {}
        per_rank = [
            {"allocator": allocator, "profiled": profiled, "rss_peak": peak_rss_bytes(), "state": state_bytes}
        ]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            per_rank = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(per_rank, {
                "allocator": allocator, "profiled": profiled, "rss_peak": peak_rss_bytes(), "state": state_bytes})
        source = "cuda_allocator" if allocator else ("torch_profiler" if profiled else None)
        key = "allocator" if allocator else "profiled"
        peak = max(r[key]["peak_bytes"] for r in per_rank) if source else None
        budget = self.cfg.mem_budget_gb
        if budget and peak is not None and peak > budget * 2**30:
            # Every rank has every rank's peak here, so they all stop together.
            self.summary["mem_peak_bytes"] = peak
            raise MemoryBudgetExceeded(f"peak {peak / 2**30:.3f} GiB > --mem_budget_gb {budget:g}")
        if not self.env.is_main:
            return

        peak_rank = max(per_rank, key=lambda r: r[key].get("peak_bytes", 0)) if source else None
        samples_per_s = statistics.median(timed_rates) if timed_rates else None
        tokens_per_s = samples_per_s * self.s.model_cfg.block_size if samples_per_s else None
        states = {k: max(r["state"].get(k, 0) for r in per_rank)
                  for k in ("params", "params_gathered", "grads", "optimizer", "offloaded")}
        states["total"] = states["params"] + states["params_gathered"] + states["grads"] + states["optimizer"]
        summary = {
            **self.summary,
            "status": "ok",
            "timed_steps": len(timed_rates),
            "samples_per_s": samples_per_s,
            "tokens_per_s": tokens_per_s,
            "mfu": flops.mfu(tokens_per_s, self.s.model_cfg, self.s.n_params, self.summary["device_name"],
                             self.env.world_size),
            "mem_source": source,
            "mem_peak_bytes": peak,
            "mem_avg_bytes": max(r[key]["avg_bytes"] for r in per_rank) if source else None,
            "mem_reserved_peak_bytes": (
                max(r["allocator"]["reserved_peak_bytes"] for r in per_rank) if allocator else None),
            "mem_rss_peak_bytes": max(r["rss_peak"] for r in per_rank),
            "mem_breakdown": peak_rank["profiled"].get("breakdown") if peak_rank and profiled else None,
            "model_state_bytes": states,
            "final_loss": final_loss,
            "val_loss": val_loss,
            "wall_time_s": time.time() - started,
            "error": None,
        }
        self.record.flush()
        self.record.write_summary(summary)
        if not self.cfg.quiet:
            rate = f"{samples_per_s:.1f} samples/s" if samples_per_s else "not timed"
            print(f"{self.record.dir.name}: ok | loss {final_loss:.4f} | val {val_loss:.4f} | {rate} | "
                  f"record {self.record.dir}", flush=True)

    def _record_failure(self, error: BaseException, started: float) -> None:
        status = "oom" if is_oom(error) else "failed"
        message = f"{type(error).__name__}: {error}".strip()
        if isinstance(error, (MemoryBudgetExceeded, Terminated)):
            print(f"rank {self.env.rank}: {message}", file=sys.stderr)  # expected outcomes, no traceback
        else:
            traceback.print_exc()
        if self.record is None:
            return
        try:
            self.record.write_rank_error(self.env.rank, status, message)
            errors = self.record.rank_errors()
            cause = errors[0] if errors else {"rank": self.env.rank, "status": status, "error": message}
            if self.env.is_main and self.record.metrics:
                self.record.flush()
            # Every rank that gets here writes the failure, built from what is on disk (the
            # running summary, the earliest rank error), so the record says failed even when
            # rank 0 itself was killed; the writes are atomic and carry the same cause.
            summary = self.summary or self.record.read_summary() or {
                "run_name": self.record.dir.name, "backend": self.cfg.backend, "world_size": self.env.world_size}
            if self.env.rank and isinstance(error, Terminated) and summary.get("status") not in (None, "running"):
                return  # rank 0 already recorded the failure that made the launcher stop us
            self.record.write_summary({
                **summary,
                "status": "oom" if any(e["status"] == "oom" for e in errors) else cause["status"],
                "error": f"rank {cause['rank']}: {cause['error']}",
                "wall_time_s": time.time() - started,
            })
        except Exception:  # noqa: BLE001 - never mask the original error
            traceback.print_exc()


class _progress:
    """A tqdm bar on rank 0 when stdout is a terminal; plain lines when it is not; nothing if quiet."""

    def __init__(self, cfg: RunConfig, env: DistEnv):
        self.steps = cfg.steps
        self.enabled = env.is_main and not cfg.quiet
        self.bar = None
        if self.enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, unit="step", dynamic_ncols=True)

    def update(self, step: int, line: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step + 1
            self.bar.set_postfix(loss=f"{line['loss']:.4f}", sps=f"{line['samples_per_s']:.1f}", refresh=True)
            return
        val = f" | val {line['val_loss']:.4f}" if "val_loss" in line else ""
        print(f"step {step + 1}/{self.steps} | loss {line['loss']:.4f}{val} | lr {line['lr']:.2e} | "
              f"{line['step_time_s'] * 1e3:.0f} ms | {line['samples_per_s']:.1f} samples/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
