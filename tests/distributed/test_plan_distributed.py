"""The planner with real ranks (distributed tier): collectives counted under the fake process group,
this machine calibrated on the real model and link, --verify's real runs through the sweep runner."""

import json
import time
from pathlib import Path

import pytest
import yaml

from analysis import plan

TINY = ["--preset", "tiny"]


def h100():
    return plan.named_device("H100-SXM", "infiniband-ndr", 0.4, 0.5, "fp32")


def _here(*args):
    """analysis.plan's main in this process: the logic (the CLI as a process: the test below)."""
    from conftest import in_process

    return in_process(plan.main, args)


@pytest.mark.distributed  # fake-process-group runs, one process each (as tests/unit/test_fake_world.py)
def test_counted_candidates_are_priced_by_the_calls_their_runs_make(tmp_path, monkeypatch, forked_launchers):
    """--counted: each fitting candidate run as rank 0 of W under the fake process group, once per
    configuration, accumulation and checkpointing; ZeRO-3 gathers module by module, so its counted
    calls are many times the theory's 25 MiB buckets, without prefetch the forward's half of them
    waits, and with more parameters persistent fewer bytes are gathered; the price is analysis.project's for the same count. A count that fails leaves its
    candidates on the theory, saying why."""
    from analysis import project as projection

    varied = plan.write_variants(["ds_configs/z3.json"], str(tmp_path))
    configs = ["ds_configs/z3.json", *varied]
    args = (TINY, 2, 2, 10.0, 8, h100(), configs, ("none",), [2, 4])
    calls = []
    real = projection.count_flags
    monkeypatch.setattr(projection, "count_flags", lambda *a: calls.append(a[0]) or real(*a))
    counted = {(Path(r["config"]).name, r["micro x accum"]): r for r in plan.plan(*args, bases=varied, counted=True)}
    theory = {(Path(r["config"]).name, r["micro x accum"]): r for r in plan.plan(*args, bases=varied)}
    assert len(calls) == 6  # three configurations x two accumulations, checkpointing none
    assert all(r["bytes"] == "counted" for r in counted.values()) and all(r["bytes"] == "theory" for r in theory.values())
    z3, bare = counted[("z3.json", "2x2")], counted[("z3.no_prefetch.json", "2x2")]
    assert z3["calls"] > 10 * theory[("z3.json", "2x2")]["calls"]
    assert z3["wait_ms"] == 0 < bare["wait_ms"]
    kept = counted[("z3.persistence_x100.json", "2x2")]  # the small ones are not gathered
    assert kept["comm_bus_bytes"] < z3["comm_bus_bytes"]
    assert theory[("z3.persistence_x100.json", "2x2")]["comm_bus_bytes"] == theory[("z3.json", "2x2")]["comm_bus_bytes"]
    assert (z3["step_ms"] - bare["step_ms"]) < (theory[("z3.json", "2x2")]["step_ms"]
                                                - theory[("z3.no_prefetch.json", "2x2")]["step_ms"]) < 0
    count = real([*TINY, *z3["candidate"].flags()], 2, 2, "z3")
    hw = yaml.safe_load(projection.HARDWARE.read_text())
    projected = projection.project("ds_configs/z3.json", [*TINY, "--micro_batch", "2", "--grad_accum", "2"], 2,
                                   hw["gpus"]["H100-SXM"], hw["networks"]["infiniband-ndr"], hw["nvlink_latency_us"],
                                   projection.Assumptions(mfu=0.4, overlap=0.5), count)
    for part in ("comm", "wait", "step"):
        assert z3[f"{part}_ms"] == pytest.approx(projected[f"{part} ms"]), part

    def fails(*a):
        raise RuntimeError("z3 at 2 ranks under the fake process group failed: no")

    monkeypatch.setattr(projection, "count_flags", fails)
    rows = plan.plan(TINY, 2, 2, 10.0, 8, h100(), ["ds_configs/z3.json"], ("none",), [4], counted=True)
    assert rows[0]["bytes"] == "theory (z3 at 2 ranks under the fake process group failed: no)"
    assert rows[0]["step_ms"] == pytest.approx(theory[("z3.json", "4x1")]["step_ms"])


@pytest.mark.distributed  # all_reduce timed between two local processes
def test_this_machine_is_calibrated_on_the_real_model_and_link():
    """--gpu here: the model's forward and backward timed at two micro-batches (time grows with the
    micro-batch), the recompute of full and selective checkpointing timed, and all_reduce timed between
    two local processes; a candidate's step is predicted from them."""
    here = plan.here_device(TINY, 2, 2, 0.5, (1, 8))
    assert here.sample_s > 0 and here.optimizer_s > 0 and set(here.recompute) == {"full", "selective"}
    assert "in 2 processes at once" in here.notes[0] and "train.py's own step at --backend single" in here.notes[0]
    assert 0 < here.inside.gb_s < float("inf") and here.inside.latency_us > 0
    row = plan.evaluate(plan.Candidate("ddp", 4, 2, "none"), TINY, 2, 2, 10.0, here)
    assert row["compute_ms"] == pytest.approx((2 * here.micro_step_s + 8 * here.sample_s + here.optimizer_s) * 1e3)
    # the tiny preset's gradients fit DDP's 1 MiB first bucket: all of the all-reduce waits after backward
    assert row["comm_ms"] == 0 < row["wait_ms"] and row["pred_samples_per_s"] == pytest.approx(16 / (row["step_ms"] / 1e3))


@pytest.mark.distributed
def test_verify_runs_the_top_candidate_and_two_more_and_picks_the_fastest_measured(tmp_path, forked_launchers):
    """--verify 1 on the tiny preset: three real runs through the sweep runner (2 ranks, forked:
    conftest.forked_launchers), ordinary records, predicted beside measured, and the pick the fastest
    measured within the budget."""
    runs = tmp_path / "runs"
    proc = _here("--world", "2", "--mem_budget_gb", "1", "--global_batch", "16", "--configs", "ddp", "--ckpt", "none",
                "full/1", "--micro_batches", "4", "8", "--verify", "1", "--verify_steps", "4", "--runs_dir", str(runs),
                "--json", "--out", str(tmp_path / "plan"), "--backend_costs", "off", *TINY)  # what is verified, not priced
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    verified = out["verified"]
    # --out holds the verification too: predicted against measured, the refit, and the pick.
    text = (tmp_path / "plan" / "plan.md").read_text()
    assert "predicted against measured" in text and "refitted on 3 verified candidates" in text
    assert f"pick (fastest measured within the budget): {out['pick']}" in text
    assert set(out["refit"]["overhead"]) == {"ddp"}
    assert len(verified) == 3 and verified[0]["rank"] == 1 and len({v["command"] for v in verified}) == 3
    for v in verified:
        assert v["status"] == "ok" and 0 < v["measured_peak_gb"] <= 1 and v["measured_samples_per_s"] > 0
        # The estimate holds every verified run's peak within 10%, the accumulating 4x2 ones too (DDP's
        # gradients made apart from its buckets under no_sync: -11.8% here before they were counted).
        assert v["est_peak_gb"] == pytest.approx(v["measured_peak_gb"], rel=0.10), v
        assert json.loads((Path(v["record"]) / "summary.json").read_text())["status"] == "ok"
    assert out["pick"] == max(verified, key=lambda v: v["measured_samples_per_s"])["command"]
    assert proc.stderr.count("[1/3]") == 2 and "[3/3]" in proc.stderr  # a line as each starts and ends
    # Ties: the verified runs whose spread (timed steps' quartiles) overlaps the pick's.
    best = next(v for v in verified if v["command"] == out["pick"])
    for v in verified:
        low, high = v["measured_spread"]
        assert low <= v["measured_samples_per_s"] <= high
    assert out["ties_with_pick"] == [v["command"] for v in verified if v is not best and
                                     max(v["measured_spread"][0], best["measured_spread"][0])
                                     <= min(v["measured_spread"][1], best["measured_spread"][1])]
