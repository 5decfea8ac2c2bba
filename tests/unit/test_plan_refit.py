"""The step model refitted on verified runs, and a saved plan replayed (analysis/plan/refit.py)."""

import json

import pytest

from analysis import plan

TINY = ["--preset", "tiny"]


def test_the_refit_recovers_the_compute_factor_and_overlap_of_the_measured_runs():
    """Runs measured as 2 x compute + 0.3 x comm: the refit finds factor 2 and overlap 0.7, and ranks
    every candidate by the refitted model; an overlap past its bounds is held at the bound."""
    rows = [{"command": f"c{i}", "compute_ms": c, "comm_ms": m, "offload_ms": 0.0, "fits": True}
            for i, (c, m) in enumerate([(100, 50), (200, 10), (150, 300), (120, 80)])]
    verified = [{"command": r["command"], "status": "ok",
                 "measured_samples_per_s": 8 / ((2 * r["compute_ms"] + 0.3 * r["comm_ms"]) / 1e3)} for r in rows[:3]]
    fitted = plan.refit(rows, verified, 8)
    assert fitted["compute_factor"] == pytest.approx(2) and fitted["overlap"] == pytest.approx(0.7)
    assert rows[3]["refit_samples_per_s"] == pytest.approx(8 / ((2 * 120 + 0.3 * 80) / 1e3))
    assert verified[0]["refit_samples_per_s"] == pytest.approx(verified[0]["measured_samples_per_s"])
    slower = [{**v, "measured_samples_per_s": 8 / ((r["compute_ms"] + 2 * r["comm_ms"]) / 1e3)}
              for v, r in zip(verified, rows)]  # more than all of the communication exposed: held at overlap 0
    assert plan.refit(rows, slower, 8)["overlap"] == 0
    assert plan.refit(rows, verified[:1], 8) is None


def test_the_refit_gives_the_micro_steps_fixed_cost_its_own_factor_where_accumulations_differ():
    """A calibration that overstated each micro-step's fixed cost (an H100's: 26 ms where the runs said
    6.5, and 8 x 8 refitted 26% under): runs measured as 0.25 x that cost + 1.2 x the rest of compute +
    0.3 x comm are fitted exactly when the verified runs accumulate differently, and a candidate not
    run is predicted as it would measure; verified at one accumulation, the one compute factor stays."""
    shapes = [("8x8", 8), ("32x2", 2), ("64x1", 1), ("16x4", 4), ("8x8", 8)]
    rows = [{"command": f"c{i}", "config": "single", "micro x accum": mxa, "compute_ms": 300 + 5 * i + 26 * accum,
             "micro_steps_ms": 26 * accum, "comm_ms": 10 * i, "offload_ms": 0.0, "fits": True}
            for i, (mxa, accum) in enumerate(shapes)]

    def measured(r):
        fixed = r["micro_steps_ms"]
        return 64 / ((0.25 * fixed + 1.2 * (r["compute_ms"] - fixed) + 0.3 * r["comm_ms"]) / 1e3)

    verified = [{"command": r["command"], "status": "ok", "measured_samples_per_s": measured(r)} for r in rows[:4]]
    fitted = plan.refit(rows, verified, 64)
    assert fitted["micro_step_factor"] == pytest.approx(0.25) and fitted["compute_factor"] == pytest.approx(1.2)
    assert fitted["overlap"] == pytest.approx(0.7) and fitted["overhead"] == {"single": pytest.approx(1.0)}
    assert rows[4]["refit_samples_per_s"] == pytest.approx(measured(rows[4]))
    same = [{**r, "micro x accum": "32x2"} for r in rows]  # one accumulation: the split is not identifiable
    assert "micro_step_factor" not in plan.refit(same, verified, 64)
    assert "micro_step_factor" not in plan.refit(rows, verified[:3], 64)  # 3 runs, 3 parameters: none to spare
    flat = [{**r, "compute_ms": 300 + r["micro_steps_ms"], "comm_ms": 40} for r in rows]  # DDP, no checkpointing:
    assert "micro_step_factor" not in plan.refit(flat, verified, 64)  # the rest of compute and comm both constant


def test_replay_rebuilds_the_micro_steps_of_a_plan_saved_without_them():
    """A plan saved before its candidates carried micro_steps_ms: replay rebuilds each from the printed
    calibration line as evaluate computed it (to the line's rounding), and from --json's `calibration`
    exactly; then refits as refit does on the rows that had them."""
    cal = {"micro_step_s": 0.01234, "sample_s": 0.004567, "optimizer_s": 0.0031, "recompute": {"full": 0.3,
                                                                                                 "selective": 0.1}}
    link = plan.Link(1.0, 1.0, "stub")
    device = plan.Device("here (stub)", link, link, **cal)
    rows = [{k: v for k, v in r.items() if k != "candidate"} for r in
            plan.plan(TINY, 1, 1, 10.0, 16, device, ["single"], ("none", "full/1", "selective/2"), [2, 8, 16])]
    assert len({r["micro_steps_ms"] for r in rows}) > 3  # accumulation and recompute both vary
    verified = [{"command": r["command"], "status": "ok", "pred_samples_per_s": r["pred_samples_per_s"],
                 "measured_samples_per_s": r["pred_samples_per_s"] * (0.8 + 0.1 * i)} for i, r in enumerate(rows[:5])]
    before = [{k: v for k, v in r.items() if k != "micro_steps_ms"} for r in rows]
    printed = {"assumptions": [f"compute calibrated on cpu: ...; {plan.calibration_line(cal)}; recompute ..."],
               "candidates": before, "verified": verified}
    for saved, tolerance in (({**printed, "calibration": cal}, 1e-9), (printed, 0.02)):
        out = plan.replay(saved)
        assert [r["micro_steps_ms"] for r in out["candidates"]] == pytest.approx(
            [r["micro_steps_ms"] for r in rows], rel=tolerance)
    expected = [dict(r) for r in rows]
    fitted = plan.refit(expected, [dict(v) for v in verified], 16)
    out = plan.replay({**printed, "calibration": cal})
    assert out["global_batch"] == 16 and out["refit"].keys() == fitted.keys()
    assert out["refit"]["overhead"] == {"single": pytest.approx(fitted["overhead"]["single"])}
    assert {k: v for k, v in out["refit"].items() if k != "overhead"} == pytest.approx(
        {k: v for k, v in fitted.items() if k != "overhead"})
    assert [v["refit_samples_per_s"] for v in out["verified"]] == pytest.approx(
        [r["refit_samples_per_s"] for r in expected[:5]])
    with pytest.raises(ValueError, match="no verified runs"):
        plan.replay({**printed, "verified": []})
    with pytest.raises(ValueError, match="fewer than 2 verified runs measured"):
        plan.replay({**printed, "verified": [verified[0], {**verified[1], "status": "oom"}]})


def test_the_refit_gives_each_verified_configuration_its_own_overhead():
    """A configuration measured 25% slower than its communication and compute say (ZeRO-3's gathers on
    this machine) gets its own overhead, applied to its candidates that were not run; a configuration
    not verified keeps the shared fit."""
    costs = [("ddp", 100, 20), ("ddp", 150, 20), ("z3", 100, 40), ("z3", 130, 40), ("fsdp2", 110, 30)]
    rows = [{"command": f"c{i}", "config": c, "compute_ms": t, "comm_ms": m, "offload_ms": 0.0, "fits": True}
            for i, (c, t, m) in enumerate(costs)]

    def measured(r):
        return 8 / ((1.5 * r["compute_ms"] + r["comm_ms"]) * (1.25 if r["config"] == "z3" else 1.0) / 1e3)

    verified = [{"command": r["command"], "status": "ok", "measured_samples_per_s": measured(r)} for r in rows[:3]]
    fitted = plan.refit(rows, verified, 8)
    assert set(fitted["overhead"]) == {"ddp", "z3"}
    assert fitted["overhead"]["z3"] / fitted["overhead"]["ddp"] == pytest.approx(1.25, rel=0.05)
    shared = 8 / ((fitted["compute_factor"] * 130 + (1 - fitted["overlap"]) * 40) / 1e3)
    assert rows[3]["refit_samples_per_s"] == pytest.approx(shared / fitted["overhead"]["z3"])
    assert rows[3]["refit_samples_per_s"] == pytest.approx(measured(rows[3]), rel=0.05)
    assert rows[4]["refit_samples_per_s"] == pytest.approx(
        8 / ((fitted["compute_factor"] * 110 + (1 - fitted["overlap"]) * 30) / 1e3))


def test_the_refit_leaves_waiting_communication_unscaled_and_counts_a_variant_as_its_configuration():
    """Runs measured as exactly 1.5 x compute + 0.5 x comm + wait, one of them a variant with waiting
    gathers: the refit recovers the factor and overlap (with the waiting part scaled, three runs
    would not fit two parameters exactly), the variant's runs count toward its configuration's
    overhead (no overhead of its own), and its other candidates are predicted as measured."""
    costs = [("ddp", None, 100, 20, 0), ("ddp", None, 150, 60, 0), ("ddp.v", "ddp", 100, 40, 20),
             ("ddp.v", "ddp", 130, 10, 20)]
    rows = [{"command": f"c{i}", "config": c, **({"base": b} if b else {}), "compute_ms": t, "comm_ms": m,
             "wait_ms": w, "offload_ms": 0.0, "fits": True} for i, (c, b, t, m, w) in enumerate(costs)]

    def measured(r):
        return 8 / ((1.5 * r["compute_ms"] + 0.5 * r["comm_ms"] + r["wait_ms"]) / 1e3)

    verified = [{"command": r["command"], "status": "ok", "measured_samples_per_s": measured(r)} for r in rows[:3]]
    fitted = plan.refit(rows, verified, 8)
    assert fitted["compute_factor"] == pytest.approx(1.5) and fitted["overlap"] == pytest.approx(0.5)
    assert fitted["overhead"] == {"ddp": pytest.approx(1.0)}
    assert rows[3]["refit_samples_per_s"] == pytest.approx(measured(rows[3]))
