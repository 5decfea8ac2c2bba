"""A failure is recorded as what it was, and a run that cannot record its end is never left running.

- a full disk while saving: one line naming the directory, the step and "no space left"; the
  partial checkpoint removed, the previous one intact;
- a rank killed by a signal: the record names that rank and the signal, not a survivor's broken
  connection;
- SIGTERM during a sharded (torch.distributed.checkpoint) save: terminated by SIGTERM, not the
  CheckpointException DCP wraps it in;
- a record folder that becomes unwritable mid-run: the run stops in one line, and sweep.py --status
  and analysis.load_runs show its `running` record dead (its process is gone, or its heartbeat
  stopped), without rewriting it.

A full disk is a small tmpfs and an unwritable folder an immutable one (root writes through file
modes): both need root, and are skipped, saying so, where the test cannot make them.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import LAUNCH_TIMEOUT_S, PARITY_ARGS, REPO, base_env, in_process, kill_tree, train

SMALL = (*PARITY_ARGS, "--micro_batch", "2", "--eval_batches", "1")


# ------------------------------------------------------------------ a small disk, an unwritable folder
MS_RDONLY, MS_REMOUNT, MNT_DETACH = 1, 32, 2
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def _mount(target: Path, options: str, flags: int = 0) -> int:
    """mount(2) of a tmpfs at `target` (or, with MS_REMOUNT, new options for it): 0, or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    done = libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", flags, options.encode())
    return 0 if done == 0 else ctypes.get_errno()


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs of its own (resized by the test with _mount(..., MS_REMOUNT))."""
    disk = tmp_path / "disk"
    disk.mkdir()
    failed = _mount(disk, "size=16m")
    if failed:
        pytest.skip(f"cannot mount a tmpfs here ({os.strerror(failed)}): a full disk needs root (CAP_SYS_ADMIN)")
    yield disk
    ctypes.CDLL(None, use_errno=True).umount2(str(disk).encode(), MNT_DETACH)


def _immutable(path: Path, on: bool) -> None:
    """chattr +i / -i: no file can be created, replaced or removed in `path`, not even by root."""
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        flags[0] = flags[0] | FS_IMMUTABLE_FL if on else flags[0] & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
    finally:
        os.close(fd)


def _can_make_immutable(tmp_path: Path) -> str | None:
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        _immutable(probe, True)
        _immutable(probe, False)
    except OSError as e:
        return (f"cannot make a folder immutable here ({e.strerror}): an unwritable record needs root and a "
                "filesystem with chattr (ext4, xfs, btrfs)")
    return None


def _files(directory: Path) -> dict:
    return {p.relative_to(directory): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ a full disk while saving
@pytest.mark.launch
def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, small_disk):
    """A run saves step 1; the disk then holds half a checkpoint more, and the run resumed from it
    fails saving step 3: one line saying so (torch.save's zip writer says "unexpected pos"), the
    partial checkpoint gone, step 1 untouched and still the latest, the record failed for that reason."""
    runs, save_dir = tmp_path / "runs", small_disk / "ckpt"
    flags = (*SMALL, "--save_every", "2", "--save_dir", str(save_dir))
    train(runs, "full", *flags, "--steps", "2").check_ok()
    used = os.statvfs(small_disk)
    used = (used.f_blocks - used.f_bfree) * used.f_frsize
    assert not _mount(small_disk, f"size={used * 3 // 2}", MS_REMOUNT)
    before, latest = _files(save_dir / "step_00000001"), (save_dir / "latest").read_text()

    run = train(runs, "full", *flags, "--steps", "4", "--resume")

    assert run.proc.returncode == 1, run.proc.stderr
    assert "Traceback" not in run.proc.stderr, run.proc.stderr
    said = [line for line in run.proc.stderr.splitlines() if "no space left" in line]
    assert len(said) == 1 and "step 3" in said[0] and str(save_dir) in said[0], run.proc.stderr
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "owner.json", "owner.lock", "step_00000001"]
    assert (save_dir / "latest").read_text() == latest and _files(save_dir / "step_00000001") == before
    error = run.summary["error"]
    assert run.summary["status"] == "failed" and "no space left" in error and "step 3" in error, run.summary


class _Sharded:
    """A backend's save, as the FSDP backends make it (torch.distributed.checkpoint, here in one process),
    through `writer`."""

    checkpoint_format = "dcp"

    def __init__(self, writer):
        self.writer = writer

    def save_checkpoint(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save({"weights": torch.ones(2**18)}, storage_writer=self.writer(str(directory / "dcp")))


def _meta(tmp_path: Path) -> dict:
    return {"run_id": "0123456789abcdef", "run_name": "r", "record": str(tmp_path / "runs" / "r")}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as meant
def test_a_full_disk_under_a_sharded_save_is_said_too(tmp_path, small_disk):
    """DCP wraps the writer's OSError (no space left) in a CheckpointException: found inside it."""
    from torch.distributed.checkpoint import FileSystemWriter

    from training import checkpoint

    save_dir = small_disk / "ckpt"
    checkpoint.save(_Sharded(FileSystemWriter), save_dir, 1, 0, _meta(tmp_path))
    assert not _mount(small_disk, "size=1200k", MS_REMOUNT)  # 1 MiB of weights written, 0.2 MiB more room
    with pytest.raises(BaseException) as full:
        checkpoint.save(_Sharded(FileSystemWriter), save_dir, 3, 0, _meta(tmp_path))
    said = str(full.value)
    assert f"step 3 not written: no space left on device in {save_dir}" in said, said
    assert "step_00000001 is still the latest" in said and "\n" not in said, said
    assert not (save_dir / ".step_00000003.partial").exists()
    assert (save_dir / "latest").read_text().strip() == "step_00000001"


# ------------------------------------------------------------------ SIGTERM while saving
def _failed_run(tmp_path: Path, error: BaseException) -> dict:
    """What training/run.py records for `error` raised in rank 0 of a running run: its summary."""
    from core.records import RunRecord
    from core.summary import RunSummary
    from training.lifecycle import Run

    env = SimpleNamespace(rank=0, is_main=True, world_size=1)
    run = Run(SimpleNamespace(cfg=SimpleNamespace(backend="fsdp2"), env=env, resume=None))
    run.record = RunRecord(tmp_path / "runs" / "r")
    run.record.create(overwrite=False)
    run.summary = RunSummary("r", backend="fsdp2", world_size=1)
    run.record.write_summary(run.summary)
    try:
        raise error
    except BaseException as e:  # noqa: BLE001 - as Run.execute catches it
        run._record_failure(e, time.time())
    return json.loads(run.record.summary_path.read_text())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sigterm_during_a_sharded_save_is_recorded_as_terminated(tmp_path):
    """SIGTERM (a launcher stopping the ranks, a scheduler's preemption) that arrives while DCP writes
    is wrapped by DCP in a CheckpointException: the record says terminated by SIGTERM, the partial
    checkpoint is removed and the previous one stays the latest."""
    from torch.distributed.checkpoint import FileSystemWriter

    from training import checkpoint
    from training.lifecycle import _raise_terminated

    class StoppedWhileWriting(FileSystemWriter):
        def write_data(self, plan, planner):
            os.kill(os.getpid(), signal.SIGTERM)
            return super().write_data(plan, planner)

    save_dir = tmp_path / "ckpt"
    checkpoint.save(_Sharded(FileSystemWriter), save_dir, 1, 0, _meta(tmp_path))
    handler = signal.signal(signal.SIGTERM, _raise_terminated)  # what train.py installs (training/run.py)
    try:
        with pytest.raises(BaseException) as stopped:
            checkpoint.save(_Sharded(StoppedWhileWriting), save_dir, 3, 0, _meta(tmp_path))
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert type(stopped.value).__name__ == "CheckpointException"  # what DCP raises: the case itself
    assert not (save_dir / ".step_00000003.partial").exists()
    assert (save_dir / "latest").read_text().strip() == "step_00000001"
    summary = _failed_run(tmp_path, stopped.value)
    assert summary["status"] == "failed"
    assert summary["error"].startswith("rank 0: Terminated: terminated by signal SIGTERM"), summary["error"]


def test_a_stop_dcp_gathered_from_another_rank_is_recorded_as_that_ranks(tmp_path):
    """DCP hands every rank the failures it gathered: rank 0 records rank 1's SIGTERM as rank 1's."""
    from torch.distributed.checkpoint.api import CheckpointException

    from training.lifecycle import Terminated

    gathered = CheckpointException("write", {1: (Terminated("terminated by signal SIGTERM (the launcher)"), None)})
    summary = _failed_run(tmp_path, gathered)
    assert summary["error"] == "rank 1: Terminated: terminated by signal SIGTERM (the launcher)", summary["error"]


# ------------------------------------------------------------------ a rank killed by a signal
@pytest.mark.distributed
def test_a_killed_rank_is_recorded_with_its_signal(tmp_path):
    """Rank 1 of two under torchrun dies of SIGKILL (GPTLITE_FAULT kind=kill) in the middle of a step:
    rank 0 fails on the broken connection a moment later; the record names rank 1 and SIGKILL."""
    run = train(tmp_path, "killed", *SMALL, "--backend", "ddp", "--steps", "20", "--dist_timeout_s", "60",
                launcher="torchrun", real=True, env={"GPTLITE_FAULT": "kind=kill,step=3,rank=1"})
    assert run.proc.returncode != 0
    assert run.summary["status"] == "failed"
    assert run.summary["error"].startswith("rank 1: killed by SIGKILL"), run.summary["error"]
    assert json.loads((run.dir / "errors" / "rank1.json").read_text())["error"].startswith("killed by SIGKILL")


# ------------------------------------------------------------------ a record that cannot be written
@pytest.mark.launch
def test_a_run_whose_record_becomes_unwritable_is_never_shown_running(tmp_path):
    """A sweep's run trains; its record folder becomes unwritable (immutable). The run stops at its
    next write, in one line; the sweep says it failed and that this is not recorded; sweep.py --status
    and load_runs then show the record, still `running` on disk, as dead (its process is gone),
    and neither rewrites it."""
    import sweep as sweep_cli
    from analysis import load_runs
    from orchestration.sweep import expand, load_spec

    skip = _can_make_immutable(tmp_path)
    if skip:
        pytest.skip(skip)
    runs = tmp_path / "runs"
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "unwritable", "runs_dir": str(runs), "steps": 100000, "timeout_s": 600,
                                    "matrix": {"backend": ["single"], "micro_batch": [2]},
                                    "train_args": {"warmup_steps": 0, "mem_profile_steps": 0, "eval_every": 0}}))
    (planned,) = expand(load_spec(str(spec)))[0]
    record = runs / planned.name
    proc = subprocess.Popen([sys.executable, str(REPO / "sweep.py"), str(spec)], cwd=REPO, env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not (record / "metrics.jsonl").exists():  # training
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        _immutable(record, True)
        try:
            output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        finally:
            _immutable(record, False)
    finally:
        kill_tree(proc.pid)

    assert proc.returncode == 1, output
    assert "Traceback" not in output and "failed" in output and "not recorded" in output, output
    log = (runs / ".logs" / f"{planned.name}.log").read_text()
    assert "Traceback" not in log and f"record {record} cannot be written" in log, log
    assert json.loads((record / "summary.json").read_text())["status"] == "running"  # as the run left it
    before = _files(record)

    status = in_process(sweep_cli.main, [str(spec), "--status", "--json"])
    assert status.returncode == 0, status.stderr
    (row,) = json.loads(status.stdout.splitlines()[-1])["runs"]
    assert row["state"] == "dead" and "is gone" in row["detail"], row
    (shown,) = load_runs(runs).to_dict("records")
    assert shown["status"] == "dead" and "is gone" in shown["error"], shown
    assert _files(record) == before


def _heartbeat(record: Path, **fields) -> None:
    """heartbeat.json as runs/README.md documents it (written here from /proc, not by the suite's code)."""
    stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    machine = f"{Path('/proc/sys/kernel/random/boot_id').read_text().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
    beat = {"pid": os.getpid(), "host": socket.gethostname(), "machine": machine, "process_start": stat[19],
            "every_s": 30.0, "time": time.time(), **fields}
    (record / "heartbeat.json").write_text(json.dumps(beat))


def test_a_running_record_is_shown_dead_by_its_heartbeat(tmp_path):
    """Records that say running, told apart by their heartbeat.json: a process of this machine that is
    gone (its pid now another process's) or a heartbeat from another host a day old is dead; this
    process, a fresh beat from elsewhere, and a record without a heartbeat (written before records
    had one) are running. Shown so by sweep.py --status's rows and load_runs; no file is written."""
    from analysis import load_runs
    from core.records import SWEEP_KEY_FILE
    from core.summary import RunSummary
    from orchestration.slurm import SlurmSettings, SlurmSweep
    from orchestration.sweep import SweepRun

    if not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("no /proc here: a heartbeat from this machine is judged by its pid through /proc (Linux)")
    runs = tmp_path / "runs"
    cases = {"gone": {"process_start": "0"},
             "stale": {"machine": "elsewhere", "host": "node7", "time": time.time() - 86400},
             "fresh": {"machine": "elsewhere", "host": "node7"}, "alive": {}, "old": None}
    planned = []
    for name, beat in cases.items():
        run = SweepRun(name, "single", None, 1, (("steps", 5),))
        planned.append(run)
        (runs / name).mkdir(parents=True)
        (runs / name / "summary.json").write_text(json.dumps(RunSummary(name, backend="single").to_dict()))
        (runs / name / SWEEP_KEY_FILE).write_text(json.dumps(run.key()))
        if beat is not None:
            _heartbeat(runs / name, **beat)
    before = _files(runs)

    status = SlurmSweep("s", runs, 60, planned, SlurmSettings()).status()
    rows = {name: (state, detail) for name, state, _, detail in status}
    shown = {row["run_name"]: (row["status"], row["error"]) for row in load_runs(runs).to_dict("records")}

    for states in (rows, shown):
        assert states["gone"][0] == "dead" and f"pid {os.getpid()}" in states["gone"][1], states
        assert states["stale"][0] == "dead" and "no heartbeat" in states["stale"][1] and "node7" in states["stale"][1]
        assert {states[name][0] for name in ("fresh", "alive", "old")} == {"running"}, states
    assert _files(runs) == before


@pytest.mark.launch
def test_ctrl_c_while_training_is_one_line_and_recorded(tmp_path):
    """Ctrl-C (SIGINT) during training printed a KeyboardInterrupt traceback: one line, the record
    failed with the reason, exit 130 as a shell gives an interrupted command."""
    from conftest import train

    run = train(tmp_path, "r", "--preset", "tiny", "--steps", "6", env={"GPTLITE_FAULT": "kind=interrupt,step=2"})
    assert run.proc.returncode == 130, run.proc.stderr
    assert "Traceback" not in run.proc.stderr and len(run.proc.stderr.strip().splitlines()) == 1, run.proc.stderr
    assert "interrupted (Ctrl-C" in run.proc.stderr
    assert run.summary["status"] == "failed" and "interrupted (Ctrl-C" in run.summary["error"]
