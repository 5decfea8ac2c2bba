"""Sweeps on a Slurm cluster: `sweep.py SPEC --executor slurm`, through submitit.

Each run of the matrix becomes one Slurm job (one job array per resource shape). The job runs, on
its node, the command the local runner runs (python, torchrun or deepspeed with the run's ranks)
through the same Runner (orchestration/runner.py): the same record, key and lock rules, so a recorded
configuration is not submitted again and a changed spec never overwrites a record. Records go to
the sweep's runs directory, which must be on a filesystem the nodes share; submitit's files and
the sweep's job list go to <runs dir>/.slurm/.

Submitit sends a job SIGUSR2 `signal_delay_s` before its time limit (or when it is preempted).
The job then stops its run and records it `timeout`; a run with checkpoints (train_args
save_every) is requeued (submitit's checkpoint and requeue, up to max_requeues times) and
continues from its last checkpoint into the same record. `--cancel` cancels what is queued or
running and records those runs `cancelled`. States come from squeue and the records: nothing here
needs Slurm's accounting database (sacct).
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from core.records import atomic_write_json, dead_because, read_json, read_summary
from gptlite.errors import ConfigError, one_line
from orchestration.launch import REPO, launch_env, launcher_for
from orchestration.runner import TERMINATED, Outcome, Runner, other_settings, wait_for
from orchestration.sweep import SlurmSettings  # the spec's executor: section, read with the spec
from training.locks import FileLock, LockHeld

SLURM_DIR = ".slurm"
JOBS_FILE = "jobs.json"
# squeue's job states, as the sweep reports them; any other state (COMPLETED, FAILED, TIMEOUT,
# CANCELLED, NODE_FAIL, ...) or a job squeue no longer lists has ended: its record says how.
QUEUED = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED"}
RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}
# A job's final state, for a run whose job ended before the run could record how (killed at its
# limit without the signal ahead, its memory limit, cancelled from outside the sweep).
ENDED_AS = {"TIMEOUT": "timeout", "DEADLINE": "timeout", "OUT_OF_MEMORY": "oom", "CANCELLED": "cancelled",
            "NODE_FAIL": "failed", "BOOT_FAIL": "failed"}


@dataclass(frozen=True)
class Shape:
    """What one run asks of Slurm; runs of one shape go as one job array."""

    nodes: int
    ranks_per_node: int
    cpus_per_task: int
    gpus_per_node: int


def shape_of(run, settings: SlurmSettings) -> Shape:
    nodes = 1 if run.world_size == 1 else settings.nodes
    if run.world_size % nodes:
        raise ConfigError(f"run {run.name}: world size {run.world_size} is not a multiple of executor.nodes {nodes}")
    ranks = run.world_size // nodes
    # Over several nodes every run starts torchrun on each node; DeepSpeed's runs too (DeepSpeed reads
    # torchrun's environment): its own launcher reaches the other nodes over ssh (pdsh), which a
    # Slurm job does not need.
    if nodes > 1 and launcher_for(run.backend) == "python":
        raise ConfigError(f"run {run.name}: executor.nodes {nodes}: a {run.backend} run is one process; use nodes: 1")
    if settings.gpus_per_node and ranks > settings.gpus_per_node:
        raise ConfigError(f"run {run.name}: {ranks} ranks per node, executor.gpus_per_node {settings.gpus_per_node}")
    return Shape(nodes, ranks, settings.cpus_per_task or ranks, ranks if settings.gpus_per_node else 0)


def node_command(run, directory: Path, nodes: int, hostnames: list[str], job_id: str) -> list[str]:
    """The launch command on a job's node: the local runner's for one node; for several,
    torchrun on each node (DeepSpeed's runs too), its c10d rendezvous on the job's first host (a
    port from the job id, the same on every node)."""
    if nodes == 1:
        return run.command(directory)
    port = 29500 + int("".join(c for c in job_id if c.isdigit()) or 0) % 20000
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
            "--nproc_per_node", str(run.world_size // nodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{hostnames[0]}:{port}", "--rdzv-id", str(job_id), str(REPO / "train.py"),
            *run.argv(directory)]


class SlurmRun:
    """One run as a Slurm job (what submitit pickles and calls on the node)."""

    def __init__(self, directory: Path, run, timeout_s: float, nodes: int, time_min: int):
        self.directory, self.run, self.timeout_s, self.nodes, self.time_min = Path(directory), run, timeout_s, nodes, time_min
        self.attempt = 0
        self._runner = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_runner"}

    def __setstate__(self, state):
        self.__dict__.update(state, _runner=None)

    def __call__(self) -> str:
        import submitit

        job = submitit.JobEnvironment()
        command = node_command(self.run, self.directory, self.nodes, job.hostnames, str(job.job_id))
        # Slurm's SIGUSR2 ahead of the time limit reaches every process of the job: the run ignores
        # it (its default action kills), and this process stops the run in order (checkpoint()).
        if job.global_rank != 0:  # another node of the run: its ranks only; node 0's runner records
            return str(subprocess.run(command, cwd=REPO, env=launch_env(dict(self.run.env)),
                                      preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN)).returncode)
        # A requeued attempt continues its run (recorded `timeout` when it was stopped).
        self._runner = Runner(self.directory, self.timeout_s, retry_failed=self.attempt > 0,
                              child_ignores=(signal.SIGUSR2,))
        outcome = self._runner.run(self.run, command)
        print(outcome.line(), flush=True)
        return outcome.status

    def checkpoint(self):
        """Submitit calls this on SIGUSR2 (the time limit ahead, or preemption): the run is stopped
        and recorded `timeout`; a run with checkpoints is requeued to continue from its last one."""
        import submitit

        if self._runner is None:
            return None
        requeue = self.run.resumable
        why = (f"stopped by Slurm (time limit {self.time_min} min, or preempted) in attempt {self.attempt + 1}; "
               + ("requeued to continue from its last checkpoint" if requeue else
                  "give executor.time_min more, or set save_every in train_args to continue from checkpoints"))
        self._runner.stop_current("timeout", why)
        if not requeue:
            return None
        self.attempt += 1
        return submitit.helpers.DelayedSubmission(self)


# --- the submitting side -----------------------------------------------------------------------

def check_tools() -> None:
    """Slurm's commands on PATH and submitit importable, or ConfigError."""
    for tool in ("sbatch", "squeue", "scancel", "srun"):
        if shutil.which(tool) is None:
            raise ConfigError(f"--executor slurm: {tool} is not on PATH: run on a Slurm cluster's login node (or start "
                              "one here: tools/slurm_local.sh start)")
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise ConfigError("--executor slurm needs submitit: pip install submitit") from None


def check_slurm(settings: SlurmSettings, shapes: list[Shape]) -> None:
    """Refuse (ConfigError) before anything is submitted: no Slurm, a partition it does not
    have, or a job it would not take (`sbatch --test-only` for each shape: time limit, account,
    CPUs and GPUs)."""
    check_tools()
    if settings.partition is not None:
        proc = _slurm(["scontrol", "show", "partition", settings.partition, "-o"])
        if proc.returncode != 0:
            raise ConfigError(f"executor.partition: {settings.partition!r} is not a partition of this cluster "
                              f"({', '.join(partitions()) or 'none found'})")
    for shape in shapes:
        proc = _slurm(["sbatch", "--test-only", *_sbatch_options(settings, shape), "--wrap", "true"])
        if proc.returncode != 0:
            message = " ".join((proc.stderr or proc.stdout).split()).removeprefix("sbatch: error: ")
            raise ConfigError(f"--executor slurm: Slurm would not take a job of {shape.nodes} node(s), "
                              f"{shape.cpus_per_task} CPUs, {shape.gpus_per_node} GPUs, {settings.time_min} min: "
                              f"{message}")


def partitions() -> list[str]:
    proc = _slurm(["sinfo", "-h", "-o", "%P"])
    return [p.strip().rstrip("*") for p in proc.stdout.split()] if proc.returncode == 0 else []


def _requeue_option(runs, sbatch: dict) -> dict:
    """Slurm requeues a batch job whose node fails, and the job then waits, queued, for as many nodes
    as it had: a run that cannot continue would start over into its record, or wait for a node that
    may never come back, and the sweep with it. Only runs with checkpoints (train_args save_every)
    are left requeueable (they continue from their last checkpoint, as after a time limit); the
    others end NODE_FAIL and are recorded failed. The spec's executor.sbatch may say otherwise."""
    if any(key.replace("-", "_") in ("requeue", "no_requeue") for key in sbatch):
        return {}
    return {} if any(run.resumable for run in runs) else {"no_requeue": True}


def _sbatch_options(settings: SlurmSettings, shape: Shape) -> list[str]:
    options = [f"--time={settings.time_min}", f"--nodes={shape.nodes}", "--ntasks-per-node=1",
               f"--cpus-per-task={shape.cpus_per_task}"]
    if shape.gpus_per_node:
        options.append(f"--gpus-per-node={shape.gpus_per_node}")
    if settings.partition:
        options.append(f"--partition={settings.partition}")
    if settings.account:
        options.append(f"--account={settings.account}")
    options += [f"--{k}={v}" for k, v in settings.sbatch.items()]
    return options


def _slurm(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(argv, 1, "", str(e))


def read_jobs(directory: Path) -> dict:
    """{run name: {"job_id", "cancelled"}} of this sweep's submissions."""
    try:
        return read_json(Path(directory) / SLURM_DIR / JOBS_FILE)
    except (OSError, ValueError):
        return {}


def queue_states(job_ids) -> dict[str, str]:
    """{job id: squeue state} of the jobs squeue still lists (finished ones for MinJobAge)."""
    ids = sorted({str(j) for j in job_ids})
    if not ids:
        return {}
    proc = _slurm(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T"])
    if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
        raise ConfigError(f"squeue failed: {' '.join(proc.stderr.split())}")
    states = {}
    for line in proc.stdout.splitlines():
        job, _, state = line.strip().partition("|")
        states[job] = state
    if proc.returncode != 0 and len(ids) > 1:  # one id squeue no longer knows fails the whole call
        for job in ids:
            states.update(queue_states([job]))
    return states


def state_of(job_id: str | None, states: dict[str, str]) -> str | None:
    """queued, running, or None (ended, or never submitted)."""
    state = states.get(str(job_id)) if job_id else None
    if state in QUEUED:
        return "queued"
    if state in RUNNING:
        return "running"
    return None


class SlurmSweep:
    """Submits a sweep's runs, follows them to the end, reports and cancels them."""

    def __init__(self, name: str, directory: Path, timeout_s: float, runs, settings: SlurmSettings,
                 retry_failed: bool = False):
        self.name, self.timeout_s, self.runs, self.settings, self.retry_failed = name, timeout_s, runs, settings, \
            retry_failed
        self.directory = Path(directory)
        self.folder = self.directory / SLURM_DIR

    def shapes(self) -> dict[str, Shape]:
        return {run.name: shape_of(run, self.settings) for run in self.runs}

    def check_tools(self) -> None:
        check_tools()

    def hold_directory(self):
        """The directory for this sweep's submission alone (ConfigError naming the holder): a lock
        released when this process exits; the jobs go on."""
        return Runner(self.directory, self.timeout_s).hold_directory()

    def check(self) -> None:
        """Refuse (ConfigError) a run whose name holds a record made with other settings, then what
        this cluster cannot run (its partitions, GPUs and nodes against the runs' shapes)."""
        Runner(self.directory, self.timeout_s).check_records(self.runs)
        check_slurm(self.settings, sorted(set(self.shapes().values()), key=str))

    def _write_jobs(self, update: dict) -> None:
        """Merge `update` into the job list, holding its lock (a --cancel may write beside a submission)."""
        lock = wait_for(lambda: FileLock(self.folder / "jobs.lock"), 60.0)
        if isinstance(lock, LockHeld):
            raise ConfigError(f"{self.folder / JOBS_FILE}: {lock}")
        try:
            jobs = read_jobs(self.directory)
            for name, entry in update.items():
                jobs[name] = {**jobs.get(name, {}), **entry}
            atomic_write_json(self.folder / JOBS_FILE, jobs)
        finally:
            lock.release()

    def to_submit(self, report) -> tuple[list, dict[str, str], dict]:
        """(the runs that need a job: not done, as the local runner decides, nor queued or running;
        {run name: job id} of those queued or running already, from an earlier invocation;
        {run name: its RunSummary} of those done)."""
        jobs = read_jobs(self.directory)
        states = queue_states(entry["job_id"] for entry in jobs.values() if entry.get("job_id"))
        runner = Runner(self.directory, self.timeout_s, retry_failed=self.retry_failed)
        todo, live, done = [], {}, {}
        for run in self.runs:
            job_id = jobs.get(run.name, {}).get("job_id")
            state = state_of(job_id, states)
            if state:
                report(f"{run.name}: {state} (job {job_id})")
                live[run.name] = job_id
            elif (summary := runner.done(run)) is not None:
                report(f"{run.name}: {summary.status} (already done)")
                done[run.name] = summary
            else:
                todo.append(run)
        return todo, live, done

    def run_all(self, report, follow: bool = True) -> list | None:
        """Submit what needs a job, then follow it, and any job of these runs still queued or running
        from an earlier invocation, to its end: every run's Outcome in order (those recorded before
        as already done); None when not following. ConfigError: Slurm refused the submission."""
        todo, live, done = self.to_submit(report)
        submitted = self.submit(todo) if todo else {}
        if submitted:
            report(f"{self.name}: submitted {len(submitted)} jobs ({', '.join(sorted(set(submitted.values())))}); "
                   f"records in {self.directory}")
        elif not live:
            report(f"{self.name}: nothing to submit")
        if not follow:
            return None
        outcomes = {o.run.name: o for o in self.wait({**live, **submitted}, report)}
        outcomes.update({run.name: Outcome(run, done[run.name], 0.0, True) for run in self.runs if run.name in done})
        return [outcomes[run.name] for run in self.runs]

    def submit(self, runs) -> dict[str, str]:
        """One job per run, one array per shape; {run name: job id}."""
        import submitit

        shapes = self.shapes()
        submitted = {}
        for shape in sorted({shapes[run.name] for run in runs}, key=str):
            group = [run for run in runs if shapes[run.name] == shape]
            executor = submitit.SlurmExecutor(folder=self.folder, max_num_timeout=self.settings.max_requeues)
            executor.update_parameters(
                job_name=f"sweep-{self.name}", time=self.settings.time_min, nodes=shape.nodes,
                ntasks_per_node=1, cpus_per_task=shape.cpus_per_task,
                **({"gpus_per_node": shape.gpus_per_node} if shape.gpus_per_node else {}),
                **({"partition": self.settings.partition} if self.settings.partition else {}),
                **({"account": self.settings.account} if self.settings.account else {}),
                signal_delay_s=self.settings.signal_delay_s, array_parallelism=self.settings.array_parallelism,
                additional_parameters={**_requeue_option(group, self.settings.sbatch), **self.settings.sbatch},
                # The repository importable on the node; srun gives each task the job's CPUs
                # (since Slurm 22.05 srun no longer takes --cpus-per-task from sbatch).
                setup=[f"export PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}}",
                       "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK", *self.settings.setup])
            try:
                with executor.batch():
                    jobs = [executor.submit(SlurmRun(self.directory, run, self.timeout_s, shape.nodes,
                                                     self.settings.time_min)) for run in group]
            except Exception as e:  # noqa: BLE001 - sbatch refusing what --test-only took: its message, one line
                raise ConfigError(f"--executor slurm: submission failed: {one_line(e)}") from None
            for run, job in zip(group, jobs):
                submitted[run.name] = str(job.job_id)
            self._write_jobs({name: {"job_id": job_id, "cancelled": False, "submitted": time.time()}
                              for name, job_id in submitted.items()})
        return submitted

    def settle_ended(self, run, slurm_state: str | None = None) -> "object":
        """The outcome of a run whose job has ended: its record, or, when the job ended before the
        run could settle it (killed at its time limit, cancelled while queued, its node lost), a
        record saying so, with the job's final state where squeue still has it (`slurm_state`)."""
        entry = read_jobs(self.directory).get(run.name, {})
        summary = read_summary(self.directory / run.name / "summary.json")
        stopped = summary is not None and summary.status == "failed" and TERMINATED in (summary.error or "")
        if summary is not None and summary.status != "running" and not (stopped and entry.get("cancelled")):
            return Outcome(run, summary, summary.wall_time_s or 0.0)
        job_id = entry.get("job_id")
        if entry.get("cancelled"):
            ended = ("cancelled", f"cancelled by sweep.py --cancel (Slurm job {job_id})")
        elif slurm_state in ENDED_AS:
            ended = (ENDED_AS[slurm_state], f"its Slurm job {job_id} ended {slurm_state} before the run finished")
        else:
            ended = ("failed", f"its Slurm job {job_id} ended before the run finished (see "
                               f"{self.folder / f'{job_id}_0_log.err'})")
        return Runner(self.directory, self.timeout_s).settle_ended(run, *ended)

    def wait(self, submitted: dict[str, str], report, poll_s: float = 2.0) -> list:
        """Follow the jobs until every one has ended; each run's outcome reported as it ends."""
        by_name = {run.name: run for run in self.runs}
        pending = dict(submitted)
        outcomes = []
        while pending:
            states = queue_states(pending.values())
            for name, job_id in list(pending.items()):
                if state_of(job_id, states):
                    continue
                outcome = self.settle_ended(by_name[name], states.get(str(job_id)))
                outcomes.append(outcome)
                report(f"{outcome.line()} (job {job_id})")
                del pending[name]
            if pending:
                time.sleep(poll_s)
        return outcomes

    def status(self) -> list[tuple[str, str, str | None, str]]:
        """(run, state, job id, detail) of every run: queued or running from squeue, else its
        record's status (ok, failed, oom, timeout, cancelled), or 'not submitted'; 'other settings' where its
        name holds another spec's record (the rule running applies: orchestration/runner.py other_settings).
        A record that says running without a job of this sweep (a local sweep's) is running, or dead
        where its process is gone (core/records.dead_because), shown so and left as it is."""
        jobs = read_jobs(self.directory)
        states = queue_states(entry["job_id"] for entry in jobs.values() if entry.get("job_id"))

        rows = []
        for run in self.runs:
            job_id = jobs.get(run.name, {}).get("job_id")
            changed = other_settings(self.directory, run)
            if changed is not None:  # another spec's record under this name: not this run's, and left as it is
                rows.append((run.name, "other settings", None, f"recorded with other settings ({changed}): not "
                             "this spec's run; running it is refused"))
                continue
            live = state_of(job_id, states)
            summary = read_summary(self.directory / run.name / "summary.json")
            if live:
                rows.append((run.name, live, job_id, ""))
            elif summary is not None and summary.status != "running":
                rows.append((run.name, summary.status, job_id, summary.error or ""))
            elif summary is not None and not job_id:  # not this sweep's job (a local sweep's run): shown, not settled
                why = dead_because(self.directory / run.name)
                rows.append((run.name, "running", None, "") if why is None else
                            (run.name, "dead", None, f"{why}; its summary still says running"))
            elif summary is not None or job_id:  # its job ended without settling it: settled now
                outcome = self.settle_ended(run, states.get(str(job_id)))
                rows.append((run.name, outcome.status, job_id, outcome.summary.error or ""))
            else:
                rows.append((run.name, "not submitted", None, ""))
        return rows

    def cancel(self, report, wait_s: float = 120.0) -> int:
        """Cancel every queued or running job of the sweep and record those runs `cancelled`."""
        jobs = read_jobs(self.directory)
        states = queue_states(entry["job_id"] for entry in jobs.values() if entry.get("job_id"))
        names = {run.name for run in self.runs}
        live = {name: entry["job_id"] for name, entry in jobs.items()
                if name in names and state_of(entry.get("job_id"), states)}
        if not live:
            report("nothing queued or running")
            return 0
        # Marked first: whoever settles the run once its job has ended records it cancelled.
        self._write_jobs({name: {"cancelled": True} for name in live})
        proc = _slurm(["scancel", *sorted(set(live.values()))])
        if proc.returncode != 0:
            raise ConfigError(f"scancel failed: {' '.join(proc.stderr.split())}")
        deadline = time.monotonic() + wait_s
        pending = dict(live)
        while pending and time.monotonic() < deadline:
            states = queue_states(pending.values())
            for name, job_id in list(pending.items()):
                if not state_of(job_id, states):
                    outcome = self.settle_ended(next(r for r in self.runs if r.name == name))
                    report(f"{name}: {outcome.status} (job {job_id})")
                    del pending[name]
            if pending:
                time.sleep(1.0)
        for name, job_id in pending.items():
            report(f"{name}: job {job_id} still ends; its record is settled by sweep.py --status")
        return len(live)


# The flags that override an executor section, with their help (sweep.py and analysis.plan).
FLAGS = (("partition", str, "Slurm partition"), ("account", str, "Slurm account"),
         ("time_min", int, "each job's time limit, minutes"),
         ("nodes", int, "nodes per run (torchrun on each, c10d rendezvous)"),
         ("gpus_per_node", int, "GPUs per node (0: CPU ranks)"),
         ("cpus_per_task", int, "CPUs per node's launcher task (default: one per rank)"),
         ("array_parallelism", int, "jobs of one array running at once"))


def add_flags(parser, where: str = "the spec's executor", skip: tuple = ()):
    """--executor and the Slurm settings' flags but `skip` (the caller has its own), in a group of
    their own (returned)."""
    group = parser.add_argument_group("cluster (--executor slurm)")
    group.add_argument("--executor", choices=("local", "slurm"), default="local",
                       help="local: one run at a time here (default); slurm: one Slurm job per run (submitit)")
    for name, kind, text in FLAGS:
        if name in skip:
            continue
        group.add_argument(f"--{name}", type=kind, default=None, help=f"{text} (overrides {where}.{name})")
    return group


def settings_from(base: SlurmSettings, args, skip: tuple = ()) -> SlurmSettings:
    """`base` (a spec's executor section) with the flags given over it; ConfigError naming the field."""
    overrides = {name: getattr(args, name) for name, _, _ in FLAGS
                 if name not in skip and getattr(args, name, None) is not None}
    try:
        return dataclasses.replace(base, **overrides)
    except ConfigError as e:
        raise ConfigError(f"{e} (from the flags)") from None
