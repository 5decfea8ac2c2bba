"""The planner's accuracy on the model zoo (benchmarks/zoo_accuracy.py): its figures computed as they
say. The committed records are held to their bounds by tests/unit/test_reference.py (runs/reference/index.yaml);
a results page written from them is dated and never compared with them again."""

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO))
from benchmarks import zoo_accuracy, zoo_figures  # noqa: E402


def test_spearman_is_the_rank_correlation():
    assert zoo_figures.spearman([1, 2, 3, 4], [10, 40, 90, 160]) == pytest.approx(1)
    assert zoo_figures.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    assert zoo_figures.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def _write(directory: Path, grid: list[tuple], candidates: list[tuple], pick: str, race: dict) -> None:
    """grid: (flags, round, samples/s, peak bytes, seconds); candidates: (flags, predicted, refitted)."""
    directory.mkdir(parents=True)
    (directory / "grid.json").write_text(json.dumps([
        {"name": f"{f}-r{r}", "flags": f.split(), "round": r, "status": "ok" if s else "oom", "steps": 8,
         "samples_per_s": s, "mem_peak_bytes": p, "seconds": sec} for f, r, s, p, sec in grid]))
    (directory / "plan.json").write_text(json.dumps({
        "candidates": [{"config_flags": f.split(), "config": f.split()[0], "command": f"run {f}", "fits": True,
                        "pred_samples_per_s": p, "refit_samples_per_s": r} for f, p, r in candidates],
        "pick": f"run {pick}", "race": race}))


def test_the_lent_gpus_question_is_one_process_over_micro_batches_and_checkpointing():
    """single-world1 (benchmarks/gpu_zoo.sh): world 1, --backend single alone, global batch 16 as micro-
    batches 2 to 16 with the accumulation that makes it up, checkpointing none and every block: 8
    candidates for a model with blocks, the 4 without checkpointing for one without (the GRU)."""
    from benchmarks.zoo import ZOO

    q = zoo_figures.QUESTIONS["single-world1"]
    for name, expected in (("frozen_tied", 8), ("gru_lm", 4)):
        rows = zoo_accuracy._grid(list(ZOO[name].flags), q)
        assert len(rows) == expected, name
        assert {r["backend"] for r in rows} == {"single"}
        assert {(r["candidate"].micro_batch * r["candidate"].grad_accum) for r in rows} == {16}
        assert sorted({r["candidate"].micro_batch for r in rows}) == [2, 4, 8, 16]
        assert all(r["command"].startswith("python train.py") for r in rows)


def test_a_models_figures_are_the_grids_medians_against_the_plan(tmp_path):
    """Measured: the median of a candidate's grid runs (a failed run left out); errors |predicted /
    measured - 1|, before and after the refit; regret of the race's pick and of the predicted one
    against the grid's best; the race's share of the grid's steps and of its seconds (each candidate's
    median seconds); each grid run's peak against the estimate of its record: the median and worst
    error, and how many runs lie beyond 10%."""
    gib = 2**30
    grid = [("--a", 0, 10.0, gib, 10.0), ("--a", 1, 12.0, gib, 12.0),  # a: median 11
            ("--b", 0, 20.0, 2 * gib, 20.0), ("--b", 1, None, None, 30.0),  # b: 20 (its oom run left out)
            ("--c", 0, 5.0, gib, 8.0), ("--c", 1, 7.0, gib, 8.0)]  # c: 6
    candidates = [("--a", 22.0, 11.0), ("--b", 10.0, 25.0), ("--c", 12.0, 6.0)]
    estimated = {"--a": 1.15 * gib, "--b": 2 * gib, "--c": 0.9 * gib}

    def estimate(record):  # a record's directory: grid/NAME, NAME its flags and round
        assert record.parent == tmp_path / "m" / "grid"
        return estimated[record.name.rsplit("-r", 1)[0]]

    _write(tmp_path / "m", grid, candidates, "--a", {"steps_run": 24, "grid_steps": 48, "runs": 3,
                                                      "run_seconds": 15.0})
    a = zoo_figures.model_accuracy(tmp_path / "m", estimate)
    assert a["without_own_costs"] is None  # no plan without them: not shown
    (tmp_path / "m" / "plan_without_own_costs.json").write_text(json.dumps({"candidates": [
        {"config_flags": f.split(), "fits": True, "pred_samples_per_s": p} for f, p in
        (("--a", 33.0), ("--b", 30.0), ("--c", 6.0))]}))
    a = zoo_figures.model_accuracy(tmp_path / "m", estimate)
    assert a["without_own_costs"] == {"median": pytest.approx(0.5), "worst": pytest.approx(2.0),
                                      "spearman": pytest.approx(0.5)}  # 33/11, 30/20, 6/6; ranks 3 2 1 / 2 3 1
    assert a["candidates"] == 3
    assert a["rounds_spread"] == pytest.approx(0.3)  # a 12/10, c 7/5: 0.2 and 0.4 (b measured once)
    assert a["median_before"] == pytest.approx(1.0) and a["worst_before"] == pytest.approx(1.0)  # 22/11, 10/20, 12/6
    assert a["median_after"] == pytest.approx(0.0) and a["worst_after"] == pytest.approx(0.25)
    assert a["spearman"] == pytest.approx(-0.5)  # predicted a > c > b; measured b > a > c
    assert a["regret"] == pytest.approx(1 - 11 / 20) and a["best"] == "--b" and a["pick"] == "--a"
    assert a["predicted_pick"] == "--a" and a["regret_predicted"] == pytest.approx(1 - 11 / 20)
    assert a["steps_share"] == 0.5 and a["grid_seconds"] == pytest.approx(11 + 25 + 8)
    assert a["time_share"] == pytest.approx(15 / 44)
    # per run: a +15% twice, b 0 (its oom run has no peak), c -10% twice
    assert a["peak_runs"] == 5 and a["peak_median"] == pytest.approx(0.1)
    assert a["peak_worst"] == pytest.approx(0.15) and a["peak_beyond"] == 2
    assert a["peak_worst_run"] == "--a-r0"  # the first of the worst


def test_a_folder_measured_for_its_peaks_alone_gets_a_table_of_its_peaks(tmp_path, monkeypatch):
    """A records folder whose models have a grid and no plan (`grid` alone: measured for the peaks) gets
    the peaks' table: runs, the median and worst error, how many beyond 10%, and the worst run."""
    gib = 2**30
    _write(tmp_path / "d" / "m", [("--a", 0, 10.0, gib, 1.0), ("--b", 0, 20.0, 2 * gib, 1.0), ("--c", 0, None, None, 1.0)],
           [], "--a", {})
    (tmp_path / "d" / "m" / "plan.json").unlink()
    (tmp_path / "d" / "README.md").write_text("# Title\n\nWhat these are.\n")
    monkeypatch.setattr(zoo_figures, "record_estimate", lambda record: {"--a-r0": 1.05, "--b-r0": 1.6}[record.name] * gib)
    text = zoo_accuracy.page([tmp_path / "d"])
    assert "What these are." in text
    assert "| m |  | 2 | 12% / -20.0% (1 of 2) | --b-r0 |" in text  # 1.05 / 1, 1.6 / 2; the oom run has none


def test_the_race_on_the_grids_records_runs_the_races_code_on_the_grids_rounds(tmp_path):
    """race_on_grid: the planner's race with each run read from the grid (a candidate's k-th run its
    round k) and charged that run's seconds: every configuration entered, c (predicted last, measured
    fastest) wins; with --race_within 0.6 it is left out, and the regret and the left-out best say so."""
    grid = [("--a", 0, 10.0, 1, 10.0), ("--a", 1, 12.0, 1, 10.0), ("--b", 0, 8.0, 1, 10.0), ("--b", 1, 9.0, 1, 10.0),
            ("--c", 1, 28.0, 1, 20.0), ("--c", 0, 30.0, 1, 20.0)]
    _write(tmp_path / "m", grid, [("--a", 20.0, None), ("--b", 15.0, None), ("--c", 5.0, None)], "--a", {})
    acc = zoo_figures.model_accuracy(tmp_path / "m", estimate=lambda record: 1)
    every = zoo_figures.race_on_grid(tmp_path / "m", acc, 0.0, bounded=False)
    # round 0: a 10, b 8, c 30 (round 0's runs) -> c and a again (their round 1): c (30, 28) 29, a (10, 12) 11
    assert every["pick"] == "--c" and every["regret"] == 0 and every["runs"] == 5 and every["entrants"] == 3
    assert every["steps_share"] == pytest.approx(5 / 3) and every["seconds"] == 70.0
    assert every["time_share"] == pytest.approx(70 / 40) and every["left_out_best"] is None
    rule = zoo_figures.race_on_grid(tmp_path / "m", acc, 0.6, bounded=False)
    # a and b (15 >= 0.6 x 20) each twice: a (10, 12) 11 against b (8, 9) 8.5; c, 5 < 12, left out
    assert rule["pick"] == "--a" and rule["runs"] == 4 and rule["entrants"] == 2 and rule["configurations"] == 3
    assert rule["regret"] == pytest.approx(1 - 11 / 29) and rule["left_out_best"] == pytest.approx(1.0)
    assert rule["time_share"] == pytest.approx(40 / 40)


def test_a_compact_folder_gives_the_figures_its_records_gave(tmp_path, monkeypatch):
    """The committed folders are compact (analysis/compact.py): the figures, the race on the grid and the
    page read from one are those of the folder it was packed from."""
    from analysis import compact

    grid = [("--a", 0, 10.0, 1, 10.0), ("--a", 1, 12.0, 1, 10.0), ("--b", 0, 8.0, 1, 10.0), ("--b", 1, 9.0, 1, 10.0)]
    _write(tmp_path / "raw" / "m", grid, [("--a", 20.0, 11.0), ("--b", 15.0, 9.0)], "--a",
           {"steps_run": 24, "grid_steps": 48, "runs": 3, "run_seconds": 15.0})
    (tmp_path / "raw" / "m" / "question.json").write_text(json.dumps({"question": "deepspeed-world1"}))
    compact.write(tmp_path / "raw", tmp_path / "kept")
    monkeypatch.setattr(zoo_figures, "record_estimate", lambda record: 1)
    raw, kept = tmp_path / "raw" / "m", tmp_path / "kept" / "m"
    assert not kept.exists()  # read from records.jsonl alone
    assert zoo_figures.model_accuracy(kept) == zoo_figures.model_accuracy(raw)
    assert zoo_figures.question_of(kept) == zoo_figures.QUESTIONS["deepspeed-world1"]
    acc = zoo_figures.model_accuracy(raw)
    assert zoo_figures.race_on_grid(kept, acc, 0.6) == zoo_figures.race_on_grid(raw, acc, 0.6)
    assert zoo_accuracy.page([tmp_path / "kept"]).replace("kept", "raw") == zoo_accuracy.page([tmp_path / "raw"])


def test_a_models_question_is_the_one_its_grid_answered(tmp_path):
    """question.json names the question (grid --question); without it the first records' (world2). Its
    flags leave checkpointing out where no grid run checkpointed (a model without blocks)."""
    out = tmp_path / "m"
    _write(out, [("--a --ckpt_interval 1", 0, 1.0, 1, 1.0)], [], "--a", {})
    assert zoo_figures.question_of(out) == zoo_figures.QUESTIONS["world2"]
    argv = zoo_accuracy.question(out)
    assert argv[argv.index("--world") + 1] == "2" and argv[argv.index("--ckpt"):] == ["--ckpt", "none", "full/1"]
    _write(tmp_path / "gru", [("--a", 0, 1.0, 1, 1.0)], [], "--a", {})
    assert zoo_accuracy.question(tmp_path / "gru")[-2:] == ["--ckpt", "none"]
    (out / "question.json").write_text(json.dumps({"question": "deepspeed-world1"}))
    argv = zoo_accuracy.question(out)
    assert argv[argv.index("--world") + 1] == "1"
    assert argv[argv.index("--configs") + 1:argv.index("--micro_batches")] == [f"ds_configs/z{i}.json" for i in range(4)]
    assert argv[argv.index("--micro_batches") + 1:argv.index("--ckpt")] == ["1", "2", "4", "8", "16"]


def test_the_autotuner_and_the_race_are_judged_by_the_grid_and_the_final_runs_shown(tmp_path):
    """Each pick as a grid candidate (the autotuner's: the grid's file of its optimal config's stage, its
    micro-batch and accumulation), its regret by the grid's medians; the final runs' median and range
    (a failed run left out); the plan command's seconds from plan_time.json."""
    z = [f"--deepspeed_config ds_configs/z{i}.json --micro_batch 8 --grad_accum 2" for i in range(4)]
    out = tmp_path / "m"
    _write(out, [(z[0], 0, 100.0, 1, 1.0), (z[0], 1, 120.0, 1, 1.0), (z[1], 0, 90.0, 1, 1.0),
                 (z[1], 1, 80.0, 1, 1.0), (z[2], 0, 200.0, 1, 1.0), (z[2], 1, 160.0, 1, 1.0)],
           [(z[0], 100.0, None), (z[1], 90.0, None), (z[2], 80.0, None)], z[0], {})
    (out / "autotune" / "results").mkdir(parents=True)
    (out / "autotune" / "results" / "ds_config_optimal.json").write_text(json.dumps({
        "zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}))
    (out / "autotune.json").write_text(json.dumps({
        "race_pick": z[0], "grid_best": z[2], "experiments": 21, "seconds": 300.0,
        "final": {"autotuner": [80.0, None, 90.0], "race": [100.0, 120.0, 110.0], "grid": [100.0, 105.0, 130.0]}}))
    acc = zoo_figures.model_accuracy(out, estimate=lambda record: 1)
    assert acc["grid_median"] == {z[0]: 110.0, z[1]: 85.0, z[2]: 180.0}
    h = zoo_figures.head_to_head(out, acc)
    assert h["picks"] == {"autotuner": z[1], "race": z[0], "grid": z[2]}
    assert (h["experiments"], h["seconds"]) == (21, 300.0)
    assert h["regret"]["autotuner"] == pytest.approx(1 - 85 / 180) and h["regret"]["grid"] == 0.0
    assert h["regret"]["race"] == pytest.approx(1 - 110 / 180)
    assert h["final_median"] == {"autotuner": 85.0, "race": 110.0, "grid": 105.0}
    assert h["final_range"]["autotuner"] == (80.0, 90.0)
    assert h["final_peak_bytes"] == {"autotuner": None, "race": None, "grid": None}  # no final records
    for name, peak in (("autotuner-r0", 5), ("autotuner-r2", 7), ("race-r0", 3)):
        (out / "autotune" / "final" / name).mkdir(parents=True)
        (out / "autotune" / "final" / name / "summary.json").write_text(json.dumps({"mem_peak_bytes": peak}))
    assert zoo_figures.head_to_head(out, acc)["final_peak_bytes"] == {"autotuner": 7, "race": 3, "grid": None}
    assert h["plan_seconds"] != h["plan_seconds"]  # no plan_time.json: not a number, not 0
    (out / "plan_time.json").write_text(json.dumps({"seconds": 42.0}))
    assert zoo_figures.head_to_head(out, acc)["plan_seconds"] == 42.0
    assert zoo_accuracy._short(z[1]) == "--deepspeed_config z1.json --micro_batch 8 --grad_accum 2"


def test_a_records_zoo_file_is_read_from_this_checkout_where_its_recorded_path_is_gone(tmp_path):
    """A run records --model as the absolute path of the checkout it ran in; the committed records'
    estimates read the zoo's file from this one where that path is gone, and nothing else."""
    gone = {"run": {"model": "/nowhere/benchmarks/zoo/cnn_bn.py", "backend": "ddp"}}
    assert zoo_figures.zoo_file_here(gone)["run"] == {"model": str(REPO / "benchmarks" / "zoo" / "cnn_bn.py"),
                                                       "backend": "ddp"}
    assert gone["run"]["model"] == "/nowhere/benchmarks/zoo/cnn_bn.py"  # the record read is not changed
    own = tmp_path / "benchmarks" / "zoo" / "cnn_bn.py"  # a file that is there: the user's, kept
    own.parent.mkdir(parents=True)
    own.write_text("")
    for config in ({"run": {"model": str(own)}}, {"run": {"model": "/nowhere/models/cnn_bn.py"}},
                   {"run": {"model": "/nowhere/benchmarks/zoo/not_in_the_zoo.py"}}, {"run": {"model": "hf:llama"}}):
        assert zoo_figures.zoo_file_here(config) == config
