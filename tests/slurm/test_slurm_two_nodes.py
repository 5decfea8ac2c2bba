"""sweep.py --executor slurm on a real two-node Slurm started here (tools/slurm_local.sh start --nodes 2:
two slurmd, each in a network and UTS namespace of its own, on a private network the script makes and
removes): runs spanning both nodes record what the same runs record on one machine, and a node lost
in the middle of a run ends it `failed`, never a sweep waiting forever."""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO, base_env

SCRIPT = REPO / "tools" / "slurm_local.sh"
SPEC = {"timeout_s": 600, "matrix": {"world_size": [2], "preset": ["tiny"], "precision": ["fp32"], "micro_batch": [4]},
        # The quick matrix's test settings (tests/support/launches.py MATRIX_TRAIN_ARGS): its records hold these.
        "train_args": {"warmup_steps": 1, "mem_profile_steps": 1, "eval_batches": 1, "dropout": 0.0,
                       "lr_warmup_steps": 0},
        # One CPU per node: each node is half this machine (the script gives each slurmd one CPU).
        "executor": {"nodes": 2, "cpus_per_task": 1, "time_min": 10}}


def _script(*args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_nodes():
    """The environment that reaches the two-node Slurm, started for this module (and stopped after,
    unless it ran before)."""
    if os.geteuid() != 0:
        pytest.skip("the two-node Slurm makes network namespaces and runs its daemons as root; these tests run "
                    "as another user")
    installed = _script("install", timeout=600)
    if installed.returncode != 0:
        pytest.skip(f"Slurm cannot be installed here: {installed.stderr.strip().splitlines()[-1:]}")
    was_running = _script("status", "--nodes", "2").returncode == 0
    started = _script("start", "--nodes", "2")
    if started.returncode == 2 and "refuses network namespaces" in started.stderr:
        pytest.skip(started.stderr.strip().splitlines()[-1])  # the machine's refusal, in its one line
    assert started.returncode == 0, started.stdout + started.stderr
    env = {"SLURM_CONF": _script("conf", "--nodes", "2").stdout.strip()}
    yield env
    if not was_running:
        stopped = _script("stop", "--nodes", "2")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not any(n in _netns() for n in ("gl-node1", "gl-node2")), _netns()


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _spec(tmp_path, name: str, backends: list[str], **changes):
    spec = json.loads(json.dumps(SPEC))
    spec.update({"name": name, "steps": 6, "runs_dir": str(tmp_path / "runs"), **changes})
    spec["matrix"]["backend"] = backends
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _sweep(*args, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "sweep.py"), *map(str, args), "--executor", "slurm"], cwd=REPO,
                          env={**base_env(), **env}, capture_output=True, text=True, timeout=timeout)


def _job(job_id: str, env) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env={**os.environ, **env}, capture_output=True,
                         text=True).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def _losses(record) -> list[float]:
    return [json.loads(line)["loss"] for line in (record / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slurm
def test_runs_over_two_nodes_record_what_one_machine_records(two_nodes, launches, request, tmp_path):
    """DDP (torchrun on each node) and ZeRO-2 (DeepSpeed under torchrun on each node), one rank per node:
    records ok, each job on both nodes, and the losses of the same runs made on one machine, bit for bit
    (the quick matrix's records; gloo's sum of two ranks is the same over the bridge as over loopback)."""
    quick_sweep = launches.get("matrix", request)
    path = _spec(tmp_path, "two_nodes", ["ddp", "ds_configs/z2.json"])
    proc = _sweep(path, env=two_nodes)
    assert proc.returncode == 0 and "2 ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = json.loads((tmp_path / "runs" / ".slurm" / "jobs.json").read_text())
    assert len(jobs) == 2
    for name, entry in jobs.items():
        record = tmp_path / "runs" / name
        summary = json.loads((record / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["world_size"] == 2, summary
        job = _job(entry["job_id"], two_nodes)
        assert job["NodeList"] == "gl-node[1-2]" and job["NumNodes"] == "2", job
        assert _losses(record) == _losses(quick_sweep / name), name


@pytest.mark.slurm
def test_a_node_lost_mid_run_ends_the_run_failed_not_a_sweep_waiting(two_nodes, tmp_path):
    """The second node cut off in the middle of a DDP run (its link down, every process on it killed: a
    machine gone, no goodbye on the wire): Slurm ends the job NODE_FAIL, the sweep records the run
    `failed` saying so, and returns. A run without checkpoints is not requeued (it would wait, queued,
    for a node that may not come back); the node is brought back after."""
    path = _spec(tmp_path, "node_lost", ["ddp"], steps=100000)
    submitted = _sweep(path, "--no_wait", env=two_nodes)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    metrics = next(iter((tmp_path / "runs").glob("*/metrics.jsonl")), None)
    deadline = time.monotonic() + 600  # a wait, not a bound: a loaded machine takes minutes to start a job
    while (metrics is None or len(metrics.read_text().splitlines()) < 3) and time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = next(iter((tmp_path / "runs").glob("*/metrics.jsonl")), None)
    assert metrics is not None and len(metrics.read_text().splitlines()) >= 3, "the run did not start training"
    try:
        subprocess.run(["ip", "link", "set", "glv2", "down"], check=True)
        pids = subprocess.run(["ip", "netns", "pids", "gl-node2"], capture_output=True, text=True).stdout.split()
        subprocess.run(["kill", "-9", *pids], check=False)
        # Slurm takes its node for lost after SlurmdTimeout (15 s) and a ping or two: well inside this.
        proc = _sweep(path, env=two_nodes, timeout=240)
    finally:
        subprocess.run(["ip", "link", "set", "glv2", "up"], check=False)
        revived = _script("start", "--nodes", "2")
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((metrics.parent / "summary.json").read_text())
    assert summary["status"] == "failed" and "NODE_FAIL" in summary["error"], summary
    job_id = json.loads((tmp_path / "runs" / ".slurm" / "jobs.json").read_text())[metrics.parent.name]["job_id"]
    job = _job(job_id, two_nodes)
    assert job["JobState"] == "NODE_FAIL" and job["Requeue"] == "0", job
    assert revived.returncode == 0 and "gl-node2" in revived.stdout, revived.stdout + revived.stderr


@pytest.mark.slurm
def test_the_hybrid_family_over_two_slurm_nodes_records_the_losses_of_one_host(two_nodes, launches, request, tmp_path):
    """The hybrid configurations at 2 nodes x 2 ranks as Slurm jobs (torchrun on each node): each job on
    both nodes, its record's ranks per node 2, and the losses the same runs make on one host as two
    torchrun nodes (tests/support/launches.py HYBRID), bit for bit."""
    from launches import HYBRID

    configs = [flags[1] for flags in HYBRID.values()]
    path = _spec(tmp_path, "hybrid_two_nodes", configs)
    spec = yaml.safe_load(path.read_text())
    spec["matrix"].update(world_size=[4], micro_batch=[2])
    path.write_text(yaml.safe_dump(spec))
    proc = _sweep(path, env=two_nodes, timeout=3000)
    assert proc.returncode == 0 and f"{len(configs)} ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = json.loads((tmp_path / "runs" / ".slurm" / "jobs.json").read_text())
    assert len(jobs) == len(configs)
    by_config = {}
    for name, entry in jobs.items():
        record = tmp_path / "runs" / name
        config = json.loads((record / "config.json").read_text())
        assert config["world_size"] == 4 and config["ranks_per_node"] == 2, name
        job = _job(entry["job_id"], two_nodes)
        assert job["NodeList"] == "gl-node[1-2]" and job["NumNodes"] == "2", job
        run = config["run"]
        by_config[os.path.basename(run["fsdp_config"] or run["deepspeed_config"])] = _losses(record)
    for name, flags in HYBRID.items():
        one_host = launches.get(f"{name}-2x2", request).first.losses
        assert by_config[os.path.basename(flags[1])] == one_host, name
