"""sweep.py --executor slurm against a real one-node Slurm started here (tools/slurm_local.sh):
submission, records equal to a local sweep's, a time limit with requeue and resume, --cancel,
--status, and bad input refused before anything is submitted."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, base_env, in_process, train
from orchestration.slurm import SlurmSettings, node_command, shape_of
from orchestration.sweep import expand, load_spec

SWEEP = REPO / "sweep.py"
SCRIPT = REPO / "tools" / "slurm_local.sh"


@pytest.fixture(scope="session")
def local_slurm():
    """The environment that reaches a one-node Slurm on this machine, started for the session
    (and stopped after, unless it ran before)."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm runs its daemons as root (tools/slurm_local.sh); these tests run as another user")
    installed = subprocess.run([str(SCRIPT), "install"], capture_output=True, text=True, timeout=600)
    if installed.returncode != 0:
        pytest.skip(f"Slurm cannot be installed here: {installed.stderr.strip().splitlines()[-1:]}")
    was_running = subprocess.run([str(SCRIPT), "status"], capture_output=True, timeout=60).returncode == 0
    started = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    conf = subprocess.run([str(SCRIPT), "conf"], capture_output=True, text=True).stdout.strip()
    yield {"SLURM_CONF": conf}
    if not was_running:
        subprocess.run([str(SCRIPT), "stop"], capture_output=True, timeout=60)


def _sweep(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, str(SWEEP), *map(str, args)], cwd=REPO, env={**base_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def _write(tmp_path, spec: dict, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return path


def _losses(record) -> list[float]:
    return [json.loads(line)["loss"] for line in (record / "metrics.jsonl").read_text().splitlines()]


def _jobs(runs):
    path = runs / ".slurm" / "jobs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _live(env) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], env={**os.environ, **env}, capture_output=True, text=True)
    return out.stdout.split()


@pytest.mark.slurm
def test_a_sweep_on_slurm_records_what_the_same_sweep_records_here(local_slurm, launches, request, tmp_path,
                                                                    monkeypatch):
    # sweeps/cpu_slurm.yaml: single, DDP, FSDP2 and ZeRO-2 with the quick matrix's settings, so the
    # local records to hold them to are the quick sweep's (the same runs, launched here).
    quick_sweep = launches.get("matrix", request)
    spec = yaml.safe_load((REPO / "sweeps" / "cpu_slurm.yaml").read_text())
    runs = tmp_path / "runs"
    path = _write(tmp_path, {**spec, "runs_dir": str(runs)})
    # One CPU per job: two jobs at once on this machine's two cores (the losses are compared, not the
    # speed; each rank's threads are the same either way: the local Slurm sets no CPU affinity).
    submit = _sweep(path, "--executor", "slurm", "--no_wait", "--cpus_per_task", "1", env=local_slurm)
    assert submit.returncode == 0 and "submitted 4 jobs" in submit.stdout, submit.stdout + submit.stderr
    # Started again while its jobs are queued or running: it submits nothing and follows them.
    proc = _sweep(path, "--executor", "slurm", "--cpus_per_task", "1", env=local_slurm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted" not in proc.stdout and "4 ok" in proc.stdout, proc.stdout
    jobs = _jobs(runs)
    assert len(jobs) == 4 and len({j["job_id"] for j in jobs.values()}) == 4
    for name in jobs:
        summary = json.loads((runs / name / "summary.json").read_text())
        assert summary["status"] == "ok", summary
        local = quick_sweep / name
        # Bit for bit: the same launcher command on CPU in fp32, here through a Slurm job.
        assert _losses(runs / name) == _losses(local), name
        assert json.loads((runs / name / "sweep_key.json").read_text()) == \
            json.loads((local / "sweep_key.json").read_text())
    from analysis import report

    made = in_process(report.main, [runs, "--out", tmp_path / "report"])
    assert made.returncode == 0, made.stdout + made.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    assert all(summary_name.split("-w")[0] in text for summary_name in jobs)
    # Again (in this process from here on: the logic, the processes ran above): everything is
    # recorded, nothing is submitted.
    for name, value in local_slurm.items():
        monkeypatch.setenv(name, value)
    again = _sweep_here(path, "--executor", "slurm", "--cpus_per_task", "1")
    assert again.returncode == 0 and "nothing to submit" in again.stdout, again.stdout + again.stderr
    assert again.stdout.count("(already done)") == 4 and _jobs(runs) == jobs
    status = _sweep_here(path, "--status")
    assert status.returncode == 0 and "4 ok" in status.stdout, status.stdout + status.stderr


@pytest.mark.slurm
def test_the_planner_verifies_its_pick_as_slurm_jobs(local_slurm, tmp_path):
    """analysis.plan --verify 1 --executor slurm on two candidates: the top one and the other, each a
    Slurm job with its ordinary record, and the pick the fastest measured."""
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "analysis.plan", "--world", "1", "--mem_budget_gb", "1",
                           "--global_batch", "8", "--configs", "single", "--ckpt", "none", "--micro_batches",
                           "4", "8", "--verify", "1", "--verify_steps", "4", "--runs_dir", str(runs), "--json",
                           "--executor", "slurm", "--cpus_per_task", "1", "--preset", "tiny"],
                          cwd=REPO, env={**base_env(), **local_slurm}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verified = json.loads(proc.stdout)["verified"]
    assert len(verified) == 2 and "submitted 2 jobs" in proc.stderr, proc.stderr
    jobs = _jobs(runs)
    for v in verified:
        assert v["status"] == "ok" and v["measured_samples_per_s"] > 0, v
        assert Path(v["record"]).name in jobs  # run as a Slurm job
    assert json.loads(proc.stdout)["pick"] == max(verified, key=lambda v: v["measured_samples_per_s"])["command"]


def _job_fields(job_id, env) -> dict:
    out = subprocess.run(["scontrol", "show", "job", str(job_id), "-o"], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def _pids(*needles: str) -> list[int]:
    """The processes whose command line holds every one of `needles`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmdline for n in needles):
            found.append(int(proc.name))
    return found


@pytest.mark.slurm
def test_a_job_past_its_time_limit_is_requeued_and_continues_from_its_checkpoint(local_slurm, tmp_path):
    steps, every, pause_at = 300, 50, 100  # stopped at the checkpoint of step 150: 150 steps from its end
    train_args = {"warmup_steps": 1, "eval_batches": 1, "eval_every": 100, "save_every": every}
    spec = {"name": "requeue", "runs_dir": str(tmp_path / "runs"), "steps": steps, "timeout_s": 600,
            "matrix": {"backend": ["single"], "preset": ["tiny"]}, "train_args": train_args,
            # A minute, the signal 20 s before it; Slurm checks time limits every 30 s, so the signal
            # comes 10 to 40 s into the job.
            "executor": {"time_min": 1, "signal_delay_s": 20, "cpus_per_task": 1, "max_requeues": 5}}
    path = _write(tmp_path, spec)
    (run,) = expand(load_spec(str(path)))[0]
    runs, saved = tmp_path / "runs", tmp_path / "runs" / ".ckpt" / run.name
    # The same run uninterrupted, here, on the other core while the job runs.
    flags = [f for f in run.argv(tmp_path / "ref")[4:] if f != "--resume"]
    i = flags.index("--save_dir")
    del flags[i:i + 2]
    del flags[flags.index("--save_every"):flags.index("--save_every") + 2]
    reference = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--runs_dir", str(tmp_path / "ref"),
                                  "--run_name", "ref", "--quiet", *flags], cwd=REPO, env=base_env(),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out = (tmp_path / "sweep.out").open("w+")
    proc = subprocess.Popen([sys.executable, str(SWEEP), str(path), "--executor", "slurm"], cwd=REPO,
                            env={**base_env(), **local_slurm}, stdout=out, stderr=subprocess.STDOUT, text=True)
    # The run needs more than its job's minute: once it has checkpointed step `pause_at`, its
    # process is stopped (SIGSTOP; it could not end before the signal however fast this machine is,
    # and a stopped run costs no CPU, unlike a run made long enough to outlast the minute). Slurm's
    # limit, its signal, the runner stopping the run, submitit's requeue and the resume are the real
    # ones. Once the job waits requeued with a checkpoint (nothing runs while it waits), its limit is
    # raised, as an operator would, and the next attempt runs to the end.
    def checkpointed() -> int:
        return max((int(p.name.split("_")[1]) for p in saved.glob("step_*")), default=-1)

    stopped, raised, deadline = [], None, time.monotonic() + 900
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the sweep did not end in 15 minutes"
            job = next(iter(_jobs(runs).values()), {}).get("job_id")
            if job and raised is None:
                fields = _job_fields(job, local_slurm)
                if not stopped and fields.get("JobState") == "RUNNING" and checkpointed() >= pause_at:
                    stopped = _pids("train.py", "--runs_dir", str(runs), run.name)
                    for pid in stopped:
                        os.kill(pid, signal.SIGSTOP)
                if int(fields.get("Restarts", 0)) >= 1 and fields.get("JobState") == "PENDING" and checkpointed() >= 0:
                    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=15"],
                                   env={**os.environ, **local_slurm}, check=True, capture_output=True, timeout=60)
                    raised = int(fields["Restarts"])
            time.sleep(0.5)
    finally:
        for pid in stopped:  # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    out.seek(0)
    output = out.read()
    _, err = reference.communicate(timeout=600)
    assert reference.returncode == 0, err
    assert proc.returncode == 0, output
    assert raised, output
    record = runs / run.name
    summary = json.loads((record / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    log = "".join(p.read_text() for p in (runs / ".slurm").glob("*_0_log.out"))
    assert "Requeued job" in log, log[-2000:]
    config = json.loads((record / "config.json").read_text())
    assert config["start_step"] > 0 and config["resumed_from"], config
    assert _losses(record) == _losses(tmp_path / "ref" / "ref")
    assert len(_losses(record)) == steps


@pytest.mark.slurm
def test_cancel_records_queued_and_running_runs_cancelled(local_slurm, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    spec = {"name": "cancel", "runs_dir": str(runs), "steps": 100000, "timeout_s": 900,
            "matrix": {"backend": ["ddp", "fsdp_configs/fsdp2.yaml"], "world_size": [2], "preset": ["tiny"]},
            "train_args": {"warmup_steps": 1, "eval_batches": 1},
            "executor": {"time_min": 10, "cpus_per_task": 2}}  # two CPUs each: one runs, one waits
    path = _write(tmp_path, spec)
    proc = _sweep(path, "--executor", "slurm", "--no_wait", env=local_slurm)
    assert proc.returncode == 0 and "submitted 2 jobs" in proc.stdout, proc.stdout + proc.stderr
    names = sorted(_jobs(runs))
    for name, value in local_slurm.items():  # --status and --cancel in this process: the logic
        monkeypatch.setenv(name, value)
    deadline = time.monotonic() + 180
    while not any((runs / n / "metrics.jsonl").exists() for n in names):  # one is training
        assert time.monotonic() < deadline, _sweep_here(path, "--status").stdout
        time.sleep(1)
    status = _sweep_here(path, "--status")
    assert {"running", "queued"} <= set(status.stdout.split()), status.stdout
    cancel = _sweep_here(path, "--cancel")
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    for name in names:
        summary = json.loads((runs / name / "summary.json").read_text())
        assert summary["status"] == "cancelled", summary
    assert not set(_live(local_slurm)) & {j["job_id"] for j in _jobs(runs).values()}
    after = _sweep_here(path, "--status")
    assert after.stdout.count("cancelled") >= 2 and "2 cancelled" in after.stdout, after.stdout


def _bad(tmp_path, executor=None, **spec):
    return _write(tmp_path, {"name": "bad", "runs_dir": str(tmp_path / "runs"), "steps": 2,
                             "matrix": {"backend": ["single"]}, **({"executor": executor} if executor else {}),
                             **spec})


def _sweep_here(*args) -> subprocess.CompletedProcess:
    """sweep.py's main in this process (the logic; one case below runs as a process)."""
    import sweep

    return in_process(sweep.main, args)


@pytest.mark.parametrize("case, executor, flags, env, expected", [
    pytest.param("unknown executor field", {"partitoin": "debug"}, [], {}, "unknown key 'executor.partitoin'",
                 marks=pytest.mark.launch),
    ("a time limit that cannot hold a run", {"time_min": 1, "signal_delay_s": 90}, [], {},
     "executor.time_min 1 cannot hold a run"),
    ("a flag out of range", None, ["--time_min", "0"], {}, "executor.time_min must be an integer >= 1"),
    ("no sbatch on PATH", None, [], {"PATH": str(REPO / "no-such-dir")}, "sbatch is not on PATH"),
])
def test_bad_executor_input_is_one_line_and_submits_nothing(tmp_path, monkeypatch, case, executor, flags, env,
                                                            expected):
    path = _bad(tmp_path, executor)
    if case == "unknown executor field":  # as a process: its exit code and its one line
        proc = _sweep(path, "--executor", "slurm", *flags, env=env, timeout=120)
    else:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        proc = _sweep_here(path, "--executor", "slurm", *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slurm
@pytest.mark.parametrize("case, flags, expected", [
    ("a partition Slurm does not have", ["--partition", "nosuchpart"],
     "executor.partition: 'nosuchpart' is not a partition of this cluster"),
    ("more CPUs than a node has", ["--cpus_per_task", "4096"], "Slurm would not take a job"),
])
def test_a_job_slurm_would_refuse_is_refused_before_anything_is_submitted(local_slurm, tmp_path, monkeypatch, case,
                                                                          flags, expected):
    path = _bad(tmp_path)
    before = set(_live(local_slurm))
    for name, value in local_slurm.items():
        monkeypatch.setenv(name, value)
    proc = _sweep_here(path, "--executor", "slurm", *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert set(_live(local_slurm)) == before and not (tmp_path / "runs" / ".slurm").exists()


def test_shapes_and_node_commands(tmp_path):
    spec = load_spec(str(_write(tmp_path, {"name": "s", "runs_dir": str(tmp_path / "r"), "matrix": {
        "backend": ["single", "ddp", "ds_configs/z2.json"], "world_size": [4]}})))
    runs = {r.backend: r for r in expand(spec)[0]}
    settings = SlurmSettings(nodes=2, gpus_per_node=2)
    assert shape_of(runs["single"], settings).nodes == 1  # one process: one node
    ddp = shape_of(runs["ddp"], settings)
    assert (ddp.nodes, ddp.ranks_per_node, ddp.gpus_per_node, ddp.cpus_per_task) == (2, 2, 2, 2)
    # DeepSpeed over several nodes: torchrun on each too (its own launcher would need ssh between them).
    assert shape_of(runs["deepspeed"], settings).nodes == 2
    ds = node_command(runs["deepspeed"], tmp_path, 2, ["n1", "n2"], "8")
    assert ds[1:3] == ["-m", "torch.distributed.run"] and "--deepspeed_config" in ds
    with pytest.raises(Exception, match="gpus_per_node 1"):
        shape_of(runs["ddp"], SlurmSettings(nodes=1, gpus_per_node=1))
    # Several nodes: torchrun on each, the rendezvous on the first host, the same port everywhere.
    cmd = node_command(runs["ddp"], tmp_path, 2, ["n1", "n2"], "1234_5")
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc_per_node") + 1] == "2"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == node_command(runs["ddp"], tmp_path, 2, ["n1", "n2"],
                                                                 "1234_5")[cmd.index("--rdzv-endpoint") + 1]
    assert cmd[cmd.index("--rdzv-endpoint") + 1].startswith("n1:")
    assert cmd[-len(runs["ddp"].argv(tmp_path)):] == runs["ddp"].argv(tmp_path)
    # One node: exactly the local runner's command.
    assert node_command(runs["ddp"], tmp_path, 1, ["n1"], "7")[:3] == runs["ddp"].command(tmp_path)[:3]


def test_a_spec_with_save_every_checkpoints_each_run_in_its_own_directory(tmp_path):
    spec = load_spec(str(_write(tmp_path, {"name": "s", "runs_dir": str(tmp_path / "r"), "train_args": {"save_every": 5},
                                          "matrix": {"backend": ["single", "ddp"]}})))
    runs = expand(spec)[0]
    dirs = [dict(r.flags)["save_dir"] for r in runs]
    assert len(set(dirs)) == 2 and all(r.resumable for r in runs)
    assert all(d.startswith(str(tmp_path / "r" / ".ckpt")) for d in dirs)


@pytest.mark.launch
def test_a_local_rerun_continues_a_checkpointed_run(tmp_path):
    """The same resume path locally: a run stopped after its first checkpoint continues there
    when the spec runs again, into the same record."""
    from core.records import SWEEP_KEY_ENV
    from orchestration.runner import Runner

    spec = load_spec(str(_write(tmp_path, {"name": "s", "runs_dir": str(tmp_path / "r"), "steps": 6,
                                          "train_args": {"save_every": 3, "warmup_steps": 1, "eval_batches": 1},
                                          "matrix": {"backend": ["single"]}})))
    (run,) = expand(spec)[0]
    # Its first attempt dies at step 5, after the checkpoint of step 2 (steps 0-2, then 3-5).
    first = train(tmp_path / "r", run.name, *run.argv(tmp_path / "r")[5:],
                  env={"GPTLITE_FAULT": "kind=exit,step=5", SWEEP_KEY_ENV: json.dumps(run.key())})
    assert first.summary["status"] != "ok"
    outcome = Runner(spec.directory, 300, retry_failed=True).run(run)
    assert outcome.status == "ok", outcome.line()
    config = json.loads((spec.directory / run.name / "config.json").read_text())
    assert config["start_step"] == 3 and config["resumed_from"]


def test_only_runs_with_checkpoints_are_left_requeueable_after_a_node_failure(tmp_path):
    from orchestration.slurm import _requeue_option

    plain = expand(load_spec(str(_write(tmp_path, {"name": "a", "runs_dir": str(tmp_path / "a"),
                                                   "matrix": {"backend": ["ddp"]}}, "a.yaml"))))[0]
    saving = expand(load_spec(str(_write(tmp_path, {"name": "b", "runs_dir": str(tmp_path / "b"),
                                                    "train_args": {"save_every": 5},
                                                    "matrix": {"backend": ["ddp"]}}, "b.yaml"))))[0]
    assert _requeue_option(plain, {}) == {"no_requeue": True}
    assert _requeue_option(saving, {}) == {}
    assert _requeue_option(plain, {"requeue": True}) == {}  # the spec's own sbatch option wins
