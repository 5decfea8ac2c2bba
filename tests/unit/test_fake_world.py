"""simulation.fake_world: one process as rank 0 of W ranks predicts the real run's collectives and memory."""

import json
import subprocess
import sys

import pytest

from analysis import load_runs
from conftest import REPO, base_env, python

MEMORY_TOLERANCE = 0.10  # the bar: the peak within 10% (measured: 0.0-3.5%)
DROPPED = {"--runs_dir", "--run_name", "--local_rank"}  # the record's own place; the launcher's rank


def _fake_world(world: int, train_flags: list[str], tmp_path, gpus_per_node: int = 8) -> dict:
    out = tmp_path / "fake"
    proc = python("-m", "simulation.fake_world", "--world", world, "--gpus_per_node", gpus_per_node, "--out", out,
                  "--json", "--", *train_flags, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((out / "fake_world.json").read_text())
    assert json.loads(proc.stdout) == result  # --json: the same object, alone on stdout (the run's lines on stderr)
    return result


def _replayed_flags(argv: list[str]) -> list[str]:
    """A record's train.py flags without its place and the launcher's rank."""
    flags, rest = [], iter(argv[1:])
    for a in rest:
        if a.split("=", 1)[0] in DROPPED:
            if "=" not in a:
                next(rest, None)  # its value
            continue
        flags.append(a)
    return flags


def test_replayed_flags_drop_only_the_place_and_the_rank():
    argv = ["train.py", "--local_rank=1", "--runs_dir", "r", "--run_name", "n", "--preset", "tiny", "--quiet"]
    assert _replayed_flags(argv) == ["--preset", "tiny", "--quiet"]


def _batches(cases: list) -> list[list[int]]:
    """The cases' indices in batches of at most one DeepSpeed run each: DeepSpeed keeps its process groups
    in module globals, and a second simulation in the process found the first's group gone."""
    deepspeed = [i for i, (_, _, flags) in enumerate(cases) if "--deepspeed_config" in flags]
    others = [i for i in range(len(cases)) if i not in deepspeed]
    batches = [[i] for i in deepspeed] or [[]]
    batches[0] = others + batches[0]
    return batches


def _fake_worlds(cases: list, tmp_path) -> list[dict]:
    """Several simulations in few processes (tests/support/fake_world_batch.py): [world, gpus_per_node, flags] each."""
    results = {}
    for n, batch in enumerate(_batches(cases)):
        (tmp_path / f"cases{n}.json").write_text(json.dumps([cases[i] for i in batch]))
        proc = python(REPO / "tests" / "support" / "fake_world_batch.py", tmp_path / f"cases{n}.json", tmp_path / f"out{n}.json",
                      timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        results.update(zip(batch, json.loads((tmp_path / f"out{n}.json").read_text())))
    return [results[i] for i in range(len(cases))]


@pytest.mark.distributed
def test_fake_world_at_2_matches_every_real_2_rank_run(launches, request, tmp_path):
    """Every multi-rank configuration of the quick matrix (checkpointing off), replayed with its own
    flags as rank 0 of a fake 2-rank world: the same collectives, byte for byte, and the memory
    peak within 10%."""
    quick_sweep = launches.get("matrix", request)
    runs = load_runs(quick_sweep)
    real = runs[(runs["world_size"] == 2) & (runs["ckpt_interval"] == 0)]
    assert len(real) == 14
    flags = [_replayed_flags(json.loads((quick_sweep / name / "config.json").read_text())["environment"]["argv"])
             for name in real["run_name"]]
    predictions = dict(zip(real["run_name"], _fake_worlds([[2, 8, f] for f in flags], tmp_path)))
    bad = []
    for _, run in real.iterrows():
        summary = json.loads((quick_sweep / run["run_name"] / "summary.json").read_text())
        fake = predictions[run["run_name"]]
        assert fake["status"] == "ok", (run["label"], fake["error"])
        measured = {k: (v["calls"], v["bytes"]) for k, v in summary["comm"]["collectives"].items()}
        predicted = {k: (v["calls"], v["bytes"]) for k, v in fake["comm"]["collectives"].items()}
        if measured != predicted:
            bad.append(f"{run['label']}: collectives {predicted} predicted, {measured} measured")
        ratio = fake["mem_peak_bytes"] / summary["mem_peak_bytes"]
        if abs(ratio - 1) > MEMORY_TOLERANCE:
            bad.append(f"{run['label']}: memory peak {ratio:.3f} of the real run's")
    assert not bad, "\n".join(bad)


@pytest.mark.distributed
def test_ddp_all_reduces_in_the_buckets_its_flag_sets(tmp_path):
    """DDP's gradients, 846848 bytes for the tiny preset: one all-reduce in DDP's own 1 MiB first
    bucket by default; with --ddp_bucket_cap_mb 0.1, a call per bucket as the planner's replay of
    DDP's bucketing counts them (backends/ddp.buckets, torch's assignment: 7, each closed at 0.1 MiB or more)."""
    calls = {}
    caps = (None, "0.1")
    cases = [[2, 8, ["--preset", "tiny", "--backend", "ddp", *(["--ddp_bucket_cap_mb", cap] if cap else [])]]
             for cap in caps]
    for cap, result in zip(caps, _fake_worlds(cases, tmp_path)):
        comm = result["comm"]
        assert comm["collectives"]["all_reduce"]["bytes"] == 846848
        calls[cap] = comm["collectives"]["all_reduce"]["calls"]
    from backends.ddp import buckets
    from simulation.describe import resolve_flags

    sizes = resolve_flags(["--preset", "tiny", "--backend", "ddp"], 2, 2).workload.param_sizes
    assert calls == {None: len(buckets(sizes, 2**20, 25 * 2**20)), "0.1": len(buckets(sizes, *(0.1 * 2**20,) * 2))}
    assert calls == {None: 1, "0.1": 7}


@pytest.mark.distributed
def test_hybrid_shard_across_two_nodes_splits_its_traffic(tmp_path):
    """At 4 ranks in nodes of 2, HYBRID_SHARD gathers and reduce-scatters inside a node and
    all-reduces shards across the 2 nodes: the measured bytes follow its theory (the root unit is
    gathered once, as at 2 ranks), which a world-sized accounting of the gathers would double."""
    flags = ["--preset", "tiny", "--micro_batch", "2", "--fsdp_config", "fsdp_configs/hybrid_shard.yaml"]
    result = _fake_world(4, flags, tmp_path, gpus_per_node=2)
    comm = result["comm"]
    assert comm["theory"]["by_kind"]["all_gather"]["group_size"] == 2
    assert comm["theory"]["by_kind"]["all_reduce"]["group_size"] == 2
    assert comm["measured_over_theory"] == pytest.approx(0.98, abs=0.02)


BAD = [["--world", "0", "--", "--preset", "tiny"],
       ["--world", "12", "--gpus_per_node", "8", "--", "--preset", "tiny"],
       ["--world", "2", "--", "--preset", "tiny", "--save_dir", "x"],
       ["--world", "2", "--", "--preset", "tny"]]
AS_PROCESS = (0, 3)  # the exit code and the one line of the process itself; the rest in this process


@pytest.mark.parametrize("case", [pytest.param(i, marks=pytest.mark.launch) if i in AS_PROCESS else i
                                  for i in range(len(BAD))])
def test_bad_input_is_refused_in_one_line(case):
    from conftest import in_process
    from simulation import fake_world

    args = BAD[case]
    if case in AS_PROCESS:
        proc = subprocess.run([sys.executable, "-m", "simulation.fake_world", *args], cwd=REPO, env=base_env(),
                              capture_output=True, text=True, timeout=120)
    else:
        proc = in_process(fake_world.main, args)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("flags", [["--save_d", "{DIR}", "--save_ev", "1"], ["--save_dir={DIR}", "--save_every=1"],
                                   ["--runs_d", "{DIR}"], ["--run_n", "x"], ["--res"], ["--overw"],
                                   ["--keep_checkpoints", "5"], ["--nvme_p", "{DIR}"]])
def test_every_spelling_of_an_output_flag_is_refused_before_simulating(flags, tmp_path, monkeypatch, capsys):
    """In-process: a simulated run must never write into a real run's record, checkpoints or NVMe
    swap files, however a flag is spelled (argparse would take an abbreviation)."""
    from simulation import fake_world

    def simulate(*args):
        raise AssertionError("simulated")

    monkeypatch.setattr(fake_world, "simulate", simulate)
    target = tmp_path / "real"
    with pytest.raises(SystemExit) as refused:
        fake_world.main(["--world", "2", "--", "--preset", "tiny", *[f.replace("{DIR}", str(target)) for f in flags]])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("python -m simulation.fake_world: error:"), err
    assert not target.exists()


@pytest.mark.parametrize("own, message", [
    (["--world", "2", "--out", "{FILE}/x"], "--out: {FILE}/x is not writable"),
    # --out named a file before it named a directory in every tool: the old spelling, refused with the new one
    (["--world", "2", "--out", "{DIR}/z3.json"], "--out {DIR}/z3.json: --out names a directory (this tool writes "
                                                 "fake_world.json in it); give the directory, e.g. --out {DIR}"),
    (["--world", "1000000"], "--world 1000000: simulating it needs about 39.2 GiB of memory (40 KiB per simulated rank "
                             "for ddp with 4 blocks"),  # 39.1 GiB for the ranks, 0.03 for the tiny step
])
def test_what_would_fail_after_simulating_is_refused_before(own, message, tmp_path, monkeypatch, capsys):
    """In-process: a bad --out, or a world too large for this machine's memory (bad_alloc otherwise),
    refused in one line before the simulation starts."""
    from simulation import fake_world

    def simulate(*args):
        raise AssertionError("simulated")

    monkeypatch.setattr(fake_world, "simulate", simulate)
    monkeypatch.setattr(fake_world, "available_memory", lambda: 8 * 2**30)
    file, directory = tmp_path / "taken.txt", tmp_path / "a_dir"
    file.write_text("x")
    directory.mkdir()
    own = [a.replace("{FILE}", str(file)).replace("{DIR}", str(directory)) for a in own]
    with pytest.raises(SystemExit) as refused:
        fake_world.main([*own, "--", "--preset", "tiny", "--backend", "ddp"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert message.replace("{FILE}", str(file)).replace("{DIR}", str(directory)) in err, err


def test_a_world_that_fits_is_simulated(monkeypatch):
    from simulation import fake_world
    from training.cli import config_from_argv

    monkeypatch.setattr(fake_world, "available_memory", lambda: 8 * 2**30)
    fake_world.check_world(64, config_from_argv(["--preset", "tiny", "--fsdp_config",
                                                 str(REPO / "fsdp_configs" / "fsdp2.yaml")]))


def test_a_simulated_rank_whose_own_step_would_not_fit_is_refused_before_simulating(monkeypatch):
    """The simulated rank runs a real step here: its estimated peak counts, not only the world's
    bookkeeping (the paper preset under ZeRO-3 at world 64, the --help example, was killed by the kernel).
    The same flags at a preset that fits pass; the machine's memory is set, not read."""
    from gptlite.errors import ConfigError
    from simulation import fake_world
    from training.cli import config_from_argv

    monkeypatch.setattr(fake_world, "available_memory", lambda: 8 * 2**30)
    z3 = ["--deepspeed_config", str(REPO / "ds_configs" / "z3.json")]
    with pytest.raises(ConfigError, match=r"the simulated rank's own step needs about \d+\.\d GiB"):
        fake_world.check_world(64, config_from_argv(["--preset", "paper", *z3]), 8, ["--preset", "paper", *z3])
    fake_world.check_world(64, config_from_argv(["--preset", "small", *z3]), 8, ["--preset", "small", *z3])


def test_a_simulated_world_gathers_its_own_rank_only():
    """A million simulated ranks: the run's gathers (losses, step times, memory) return rank 0's
    own values instead of a million ranks' tensors nobody has (fake_world --world 1000000 ended in
    bad_alloc under DDP)."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from core.dist import gather_floats
    from training.results import gather_ranks

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1_000_000)
    try:
        assert gather_floats([1.5, 2.0], torch.device("cpu")) == [[1.5, 2.0]]
        ranks = gather_ranks(SimpleNamespace(allocator=None, profiled={"peak_bytes": 7}, state_bytes={}))
        assert len(ranks) == 1 and ranks[0]["profiled"] == {"peak_bytes": 7}
    finally:
        dist.destroy_process_group()
