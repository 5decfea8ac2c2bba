"""A prepared run's life (training/run.py prepare_run makes its Setup): `Run.execute` creates the
process group and the record, trains (training/loop.py), writes the summary (training/results.py), and
records any failure, from any rank, as the run's status; and how the process ends (exit_process).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import secrets
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

import models
from backends.activation_checkpointing import save_ops_for
from backends.base import Backend
from backends.compile import compile_stats
from core.blocks import find_blocks
from core.dist import broadcast_object, destroy_process_group, set_cpu_threads, stop_with_launcher
from core.environment import device_name, environment
from core.flops import planned_sample_flops, sample_flops
from core.memory_profile import LoadPeak
from core.peers import Peers
from core.records import SWEEP_KEY_ENV, SWEEP_KEY_FILE, Heartbeat, RecordNotWritable, RunRecord, atomic_write_text
from core.sdpa import apply_sdpa_kernel
from core.summary import RunSummary
from gptlite.data import DataError
from gptlite.errors import ConfigError
from training import checkpoint, trackers
from training.cli import tell_torch_elastic
from training.loop import StepLoop
from training.results import MemoryBudgetExceeded, finished_summary, gather_ranks
from training.setup import Setup

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


class Terminated(BaseException):
    """The launcher asked this rank to stop (SIGTERM), e.g. because another rank failed. A
    BaseException, as KeyboardInterrupt is: a stop request must not be taken for an error by an
    `except Exception` on the way (FLOP counting's, torch's fake-tensor dispatch logging its own
    traceback), which would swallow it and let the rank go on."""


def _raise_terminated(signum, frame):
    raise Terminated(f"terminated by signal {signal.Signals(signum).name} (launchers stop every rank when one "
                     "fails or dies)")


# How the CPU allocator words a failed allocation (c10's DefaultCPUAllocator raises a RuntimeError).
CPU_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def is_oom(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in CPU_OOM_MESSAGES)


# Failures that are outcomes of the settings or the machine, not faults of the code: one line, no
# traceback. FloatingPointError is the loop's non-finite loss (training/loop.py); torch itself never
# raises it. A ConfigError or DataError here is the user's model or data failing after the checks
# passed (a model file's get_model() that fails on its second call: models/user.py says which).
OUTCOMES = (MemoryBudgetExceeded, Terminated, FloatingPointError, ConfigError, DataError,
            checkpoint.CheckpointNotWritten, RecordNotWritable)
# How long a rank whose failure is not one of those (a broken connection, most often) waits for the
# kernel to say whether a rank of its machine died first (core/peers.py): the connection breaks as
# the dying process closes its sockets, a moment before it has ended.
PEER_WAIT_S = 1.0


def root_failure(error: BaseException, rank: int) -> tuple[BaseException, int]:
    """The failure behind `error`, and the rank it happened on: a stop (SIGTERM, Ctrl-C) that a
    library raised its own exception over, and the failure torch.distributed.checkpoint gathered into
    its CheckpointException (a rank stopped by SIGTERM while saving: this rank's own, else the lowest
    rank's), rather than the wrapper."""
    if isinstance(error, OUTCOMES):  # the suite's own, which says what happened
        return error, rank
    e, seen = error, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (Terminated, KeyboardInterrupt)):
            return e, rank
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            owner = rank if rank in failures else min(failures)
            inner = failures[owner][0] if isinstance(failures[owner], tuple) else failures[owner]
            if isinstance(inner, BaseException):
                return root_failure(inner, owner)
        e = e.__cause__ or e.__context__
    return error, rank


def describe_error(error: BaseException) -> str:
    """A record's `error`: `<ExceptionType>: <message>` on one line (the report's tables show it), with a
    message where the exception carries none. Of a message on several lines (dynamo's, NCCL's), the
    first; the whole of it is in the rank's log, with the traceback. An interrupt that a library
    wrapped in its own exception (Ctrl-C during a compile) is said as the interrupt it was."""
    cause, seen = error, set()
    while cause is not None and not isinstance(cause, KeyboardInterrupt) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, KeyboardInterrupt):
        return "KeyboardInterrupt: interrupted (Ctrl-C, or SIGINT from the launcher)"
    if isinstance(error, SystemExit):  # train.py's own exits do not pass here: a library's exit() in the step
        return (f"SystemExit: code {error.code}: the run was ended by an exit() inside its step (DeepSpeed's "
                "autotuner ends each experiment so, after its profiled steps)")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    more = " (more in the log)" if len(lines) > 1 else ""
    return f"{type(error).__name__}: {lines[0]}{more}" if lines else type(error).__name__


@dataclass
class _ProcessState:
    used_process_group: bool = False


_PROCESS = _ProcessState()


def exit_process(code: int) -> None:
    """End train.py with `code`. After a run that used a process group, skip the interpreter's
    finalization: libraries keep process groups of their own alive in module globals (DeepSpeed's
    data-parallel groups), and gloo tearing them down while Python finalizes can abort the process
    (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291) after the
    run has finished and written its record, turning a finished run into a launcher failure.
    Everything the run owns is closed by then; only stdio and logging are left to flush."""
    if not _PROCESS.used_process_group:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)



class Run:
    def __init__(self, setup: Setup):
        self.s, self.cfg, self.env = setup, setup.cfg, setup.env
        self.record: RunRecord | None = None
        self.backend: Backend | None = None
        self.summary: RunSummary | None = None
        self.trackers: trackers.Trackers | None = None
        self.peers: Peers | None = None  # the other ranks of this machine, watched (core/peers.py)
        self.heartbeat: Heartbeat | None = None  # rank 0's, in the record while it runs
        self.since = 0.0  # when this attempt created (or continued) its record: its errors are those since
        self.start_step = setup.resume.start_step if setup.resume else 0

    def execute(self) -> int:
        signal.signal(signal.SIGTERM, _raise_terminated)
        stop_with_launcher()
        started = time.time()
        try:
            threads = set_cpu_threads(self.env)
            if self.s.backend_cls.needs_process_group:
                self.s.backend_cls.init_distributed(self.env, self.cfg.dist_timeout_s)
                self.agree_on_plan()
                self.peers = Peers.watch(self.env.rank)
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
            # Ctrl-C: said in one line and recorded; the exit status a shell gives an interrupted command
            return EXIT_INTERRUPTED if isinstance(e, KeyboardInterrupt) else EXIT_FAILED
        finally:
            for watcher in (self.heartbeat, self.peers):
                if watcher is not None:
                    watcher.stop()
            # Release the backend (DDP's Reducer holds the process group) while the group is
            # still registered: if the Reducer dropped the group's last reference, gloo's
            # destructor would join its worker threads with the GIL held and can deadlock
            # (pytorch/pytorch#56297).
            if self.backend is not None:
                self.backend.teardown()
                self.backend = None
            gc.collect()
            _PROCESS.used_process_group |= torch.distributed.is_initialized()
            destroy_process_group()

    def agree_on_plan(self) -> None:
        """--ckpt_policy auto: every rank runs rank 0's plan (a measured cost is rank 0's alone)."""
        if self.cfg.ckpt_policy != "auto" or not torch.distributed.is_initialized():
            return
        plan = [self.cfg.ckpt_plan]
        torch.distributed.broadcast_object_list(plan, src=0)
        if plan[0] != self.cfg.ckpt_plan:
            self.s.resolved = dataclasses.replace(self.s.resolved, cfg=dataclasses.replace(self.cfg, ckpt_plan=plan[0]))
            self.cfg = self.s.cfg

    def _create_record(self) -> RunRecord:
        size = self.cfg.preset if self.cfg.model == "gptlite" else models.model_label(self.cfg.model)
        name = self.cfg.run_name or (
            f"{self.cfg.backend}-{size}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}")
        record = RunRecord(Path(self.cfg.runs_dir) / name)
        since = time.time()  # errors/ of this attempt: a resumed record keeps those of the attempts before
        if self.env.is_main:
            if self.s.resume is not None and record.dir.exists():
                record.continue_after(self.start_step - 1)
            else:
                record.create(overwrite=self.cfg.overwrite or self.cfg.resume)
            key = os.environ.get(SWEEP_KEY_ENV)
            if key is not None:  # launched by a sweep: its key goes into the record, by the record's one writer
                atomic_write_text(record.dir / SWEEP_KEY_FILE, key)
        # The broadcast also makes the other ranks wait until the directory exists.
        name, self.since = broadcast_object((name, since))
        return record if self.env.is_main else RunRecord(Path(self.cfg.runs_dir) / name)

    def _train(self, threads: int, started: float) -> None:
        cfg, env = self.cfg, self.env
        # Each rank's own dropout stream, the same in every run of this configuration.
        torch.manual_seed(cfg.seed * 1000 + env.rank)
        apply_sdpa_kernel(cfg.sdpa_kernel)
        self.backend = backend = self.s.resolved.build(env)
        model = backend.build_model(self.s.workload, cfg.seed)  # a checkpoint: loaded as the backend can
        if self.s.init is not None:
            model.load_state_dict(self.s.init["model"])
            self.start_step = self.s.init["step"] + 1
        backend.setup(model)
        loading = checkpoint_loading(backend) if self.s.workload.pretrained is not None else None
        if self.s.resume is not None:
            checkpoint.load(backend, self.s.resume.directory, env.rank)
        start = self.start_step
        description = backend.describe()
        self.summary = self._base_summary(description.get("model_state_estimate"))
        if env.is_main:
            config = {
                **self.s.record(), "run_id": self.s.run_id, "start_step": start,
                "resumed_from": str(self.s.resume.directory) if self.s.resume else None,
                "backend": description, "threads_per_rank": threads, "environment": environment(env.device),
                **({"checkpoint_load": loading} if loading is not None else {})}
            self.record.write_config(config)
            self.heartbeat = Heartbeat(self.record.dir)  # first: a summary that says running has one beside it
            self.record.write_summary(self.summary)
            self.trackers = trackers.Trackers(cfg.tracker, self.record.dir, self.record.dir.name, config)
        if cfg.mem_budget_gb and env.device.type == "cuda":
            total = torch.cuda.get_device_properties(env.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.mem_budget_gb * 2**30 / total), env.device)

        result = StepLoop(self.s, backend, self.record, start, self.trackers).run()
        # The budget is checked before rank 0 counts FLOPs (seconds on a large model): the other
        # ranks fail at once over it and the launcher stops rank 0 in the middle of the count.
        theory = backend.comm_theory(self.s.n_params, self.s.workload.n_trainable, self.s.workload.buffer_bytes)
        summary = finished_summary(self.summary, result, gather_ranks(result), self.s.workload, env.world_size,
                                   cfg.mem_budget_gb, started, theory,
                                   self._sample_flops if env.is_main else None)  # rank 0 writes the summary
        if cfg.compile:
            summary = dataclasses.replace(summary, compile=compile_stats())
        if env.is_main:
            self.record.flush()
            self.record.write_summary(summary)
            self._finish_trackers(summary.to_dict(), "ok")
            if not cfg.quiet:
                rate = f"{summary.samples_per_s:.1f} samples/s" if summary.samples_per_s else "not timed"
                print(f"{self.record.dir.name}: ok | loss {summary.final_loss:.4f} | val {summary.val_loss:.4f} | "
                      f"{rate} | record {self.record.dir}", flush=True)

    def _finish_trackers(self, summary: dict, status: str) -> None:
        """Close the trackers (after the record: a tracker's failure never changes it); say where to look."""
        if self.trackers is None:
            return
        where, self.trackers = self.trackers.finish(summary, status), None
        for line in where:
            print(f"{self.record.dir.name}: tracker: {line}", flush=True)

    def _sample_flops(self) -> dict | None:
        """FLOPs per sample (core/flops.py), or None, said once, for a model fake tensors cannot run:
        counting is a measurement beside the run, never a reason for it to fail. Counted on GPUs
        only: they are what MFU and HFU divide by a peak, and a CPU has none (core/flops.py); the
        count itself takes a second or more of a short CPU run (0.7 s of GPT-lite tiny's 1.3 s)."""
        if self.env.device.type != "cuda":
            return None
        try:
            if self.cfg.ckpt_plan is not None:
                choices = self.cfg.ckpt_choices(len(find_blocks(self.s.workload.meta(), self.cfg.block_class)))
                return planned_sample_flops(self.s.workload, self.cfg.block_class, choices,
                                            save_ops_for("selective", self.cfg.save_ops()))
            kept = save_ops_for(self.cfg.ckpt_policy, self.cfg.save_ops()) if self.cfg.ckpt_interval else None
            return sample_flops(self.s.workload, self.cfg.block_class, self.cfg.ckpt_interval, kept)
        except Exception as e:  # noqa: BLE001
            if self.env.is_main:
                print(f"note: FLOPs not counted ({type(e).__name__}: {e}); mfu and hfu left empty", file=sys.stderr)
            return None

    def _base_summary(self, model_state_estimate: dict | None) -> RunSummary:
        cfg, layout = self.cfg, self.s.layout
        return RunSummary(
            run_name=self.record.dir.name, backend=cfg.backend, model=cfg.model,
            preset=cfg.preset if cfg.model == "gptlite" else None,
            attention=cfg.attention if cfg.model == "gptlite" else None,
            world_size=self.env.world_size, micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum,
            global_batch=layout.global_batch, precision=cfg.precision, ckpt_interval=cfg.ckpt_interval,
            ckpt_plan=cfg.ckpt_plan,
            n_params=self.s.n_params, steps=cfg.steps, device_name=device_name(self.env.device),
            model_state_estimate=model_state_estimate)

    def _recorded_errors(self) -> list[dict]:
        """The ranks' errors this attempt recorded so far, earliest first (a resumed record keeps those
        of the attempts before); none where they cannot be read."""
        try:
            errors = self.record.rank_errors() if self.record is not None else []
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return [e for e in errors if isinstance(e.get("time"), (int, float)) and e["time"] >= self.since]

    def _recorded(self, rank: int) -> bool:
        return any(e.get("rank") == rank for e in self._recorded_errors())

    def _record_failure(self, error: BaseException, started: float) -> None:
        error, whose = root_failure(error, self.env.rank)
        status = "oom" if is_oom(error) else "failed"
        message = describe_error(error)
        own = isinstance(error, (*OUTCOMES, KeyboardInterrupt))
        # A rank of this machine that died of a signal records nothing itself: said here, as the cause.
        deaths = self.peers.ended(0.0 if own or isinstance(error, KeyboardInterrupt) else PEER_WAIT_S) \
            if self.peers is not None else []
        if self.record is not None:  # a rank that exited after recording its own error said it itself
            deaths = [d for d in deaths if d.killed or not self._recorded(d.rank)]
        # What another rank recorded before this one failed (its broken connection, most often, follows)
        causes = [f"rank {d.rank} {d.describe()}" for d in deaths] + [
            f"rank {e['rank']}: {e['error']}" for e in self._recorded_errors() if e.get("rank") != self.env.rank]
        # A rank that found the failure itself (a check, its data, its memory, its loss) says its own; one
        # stopped (SIGTERM) or cut off names what another rank said first, the cause.
        found_here = own and not isinstance(error, (Terminated, KeyboardInterrupt))
        if own or causes:  # one line, no traceback
            print(f"rank {self.env.rank}: " + (f"the cause: {causes[0]}; then here: " if causes and not found_here
                                                else "") + message, file=sys.stderr)
        else:
            traceback.print_exc()
        if self.record is None:
            return
        try:
            for death in deaths:  # written once, by the first survivor to see it
                if not self._recorded(death.rank):
                    self.record.write_rank_error(death.rank, "failed", death.describe(), at=max(death.time, self.since))
            if whose == self.env.rank or not self._recorded(whose):
                self.record.write_rank_error(whose, status, message)
            errors = self._recorded_errors()
            cause = errors[0] if errors else {"rank": whose, "status": status, "error": message}
            if self.env.is_main and self.record.metrics:
                self.record.flush()
            # Every rank that gets here writes the failure, built from what is on disk (the
            # running summary, the earliest rank error), so the record says failed even when
            # rank 0 itself was killed; the writes are atomic and carry the same cause.
            summary = self.summary or self.record.read_summary() or RunSummary(
                run_name=self.record.dir.name, backend=self.cfg.backend, world_size=self.env.world_size)
            on_disk = self.record.read_summary()
            if self.env.rank and isinstance(error, Terminated) and on_disk is not None and on_disk.status != "running":
                return  # rank 0 already recorded the failure that made the launcher stop us
            if isinstance(error, MemoryBudgetExceeded):
                summary.mem_peak_bytes = error.peak_bytes
            self.record.write_summary(summary.ended(
                "oom" if any(e["status"] == "oom" for e in errors) else cause["status"],
                f"rank {cause['rank']}: {cause['error']}", time.time() - started))
            # torchrun's own report of the failure names the same cause (not "<N/A>"), at its time
            tell_torch_elastic(f"rank {cause['rank']}: {cause['error']} (recorded in {self.record.dir})",
                               cause.get("time"))
        except RecordNotWritable as e:  # one line: the reason is the folder, not the code
            print(f"rank {self.env.rank}: the failure is not recorded: {e}; its summary still says running, which "
                  "sweep.py --status and analysis.report show as dead once this process has ended", file=sys.stderr)
        except Exception:  # noqa: BLE001 - never mask the original error
            traceback.print_exc()
        try:  # the trackers' runs end as failed too, after the record
            self._finish_trackers({}, status)
        except Exception:  # noqa: BLE001
            traceback.print_exc()


def checkpoint_loading(backend) -> dict:
    """How loading the checkpoint went on each rank (collective): the peak bytes of the loading window
    (core/memory_profile.py LoadPeak), the growth of peak RSS over it, and the parameter bytes the rank
    holds after set-up (its share, where the backend shards)."""
    peak = backend.load_peak
    storages = {}
    for t in backend.accounting().state_tensors()["parameter"]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    mine = {"peak_bytes": peak.peak_bytes if peak else None, "rss_growth_bytes": peak.rss_growth_bytes if peak else None,
            "held_parameter_bytes": sum(storages.values())}
    ranks = [mine]
    if torch.distributed.is_initialized():
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
    return {"measure": LoadPeak.MEASURE, "ranks": ranks}
