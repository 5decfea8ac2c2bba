"""The planner's accuracy page on the model zoo (benchmarks/zoo_accuracy.py): its figures computed as
they say, and the committed page held to the committed records it was generated from."""

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO))
from benchmarks import zoo_accuracy  # noqa: E402

# The records folders the page has a section of, in its order.
RECORDS = [REPO / "runs" / "reference" / name
           for name in ("cpu-2core-zoo", "cpu-2core-zoo-deepspeed-world1", "cpu-2core-zoo-race-within",
                        "cpu-2core-zoo-link-kept", "cpu-2core-zoo-link-kept-fastest",
                        "cpu-2core-zoo-plan-in-window", "cpu-2core-zoo-plan-loop", "cpu-2core-zoo-wide-point",
                        "cpu-2core-zoo-least-squares", "cpu-2core-zoo-ranks-in-step", "cpu-2core-zoo-ranks-in-step-kept",
                        "cpu-2core-zoo-median-point", "cpu-2core-zoo-trainable-comm",
                        "cpu-2core-zoo-two-reads", "cpu-2core-zoo-zen5-probed", "cpu-2core-zoo-ddp-buffers",
                        "cpu-2core-zoo-race-share", "cpu-2core-zoo-frozen-units",
                        "cpu-2core-zoo-peaks", "cpu-2core-zoo-peaks-deepspeed-world1", "cpu-2core-zoo-peaks-single")]
# Measured for the peaks alone, every free seen (core/memory_profile.py since 2026-11-29).
PEAKS = RECORDS[-3:]
PAGE = REPO / "docs" / "results" / "zoo_accuracy.md"


def test_spearman_is_the_rank_correlation():
    assert zoo_accuracy.spearman([1, 2, 3, 4], [10, 40, 90, 160]) == pytest.approx(1)
    assert zoo_accuracy.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    assert zoo_accuracy.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


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

    q = zoo_accuracy.QUESTIONS["single-world1"]
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
    a = zoo_accuracy.model_accuracy(tmp_path / "m", estimate)
    assert a["without_own_costs"] is None  # no plan without them: not shown
    (tmp_path / "m" / "plan_without_own_costs.json").write_text(json.dumps({"candidates": [
        {"config_flags": f.split(), "fits": True, "pred_samples_per_s": p} for f, p in
        (("--a", 33.0), ("--b", 30.0), ("--c", 6.0))]}))
    a = zoo_accuracy.model_accuracy(tmp_path / "m", estimate)
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
    monkeypatch.setattr(zoo_accuracy, "record_estimate", lambda record: {"--a-r0": 1.05, "--b-r0": 1.6}[record.name] * gib)
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
    acc = zoo_accuracy.model_accuracy(tmp_path / "m", estimate=lambda record: 1)
    every = zoo_accuracy.race_on_grid(tmp_path / "m", acc, 0.0, bounded=False)
    # round 0: a 10, b 8, c 30 (round 0's runs) -> c and a again (their round 1): c (30, 28) 29, a (10, 12) 11
    assert every["pick"] == "--c" and every["regret"] == 0 and every["runs"] == 5 and every["entrants"] == 3
    assert every["steps_share"] == pytest.approx(5 / 3) and every["seconds"] == 70.0
    assert every["time_share"] == pytest.approx(70 / 40) and every["left_out_best"] is None
    rule = zoo_accuracy.race_on_grid(tmp_path / "m", acc, 0.6, bounded=False)
    # a and b (15 >= 0.6 x 20) each twice: a (10, 12) 11 against b (8, 9) 8.5; c, 5 < 12, left out
    assert rule["pick"] == "--a" and rule["runs"] == 4 and rule["entrants"] == 2 and rule["configurations"] == 3
    assert rule["regret"] == pytest.approx(1 - 11 / 29) and rule["left_out_best"] == pytest.approx(1.0)
    assert rule["time_share"] == pytest.approx(40 / 40)


def test_on_the_committed_records_the_races_entry_rule_leaves_out_a_winner_only_where_the_docs_say():
    """What docs/planner.md and entrants() say of --race_within's default, held to the zoo's records:
    on every model of every question, no configuration it leaves out measured within 5% of the grid's
    best (the most any did: 0.71 of the best on the first 13 questions, 0.73 on the 14th to 18th,
    measured after the rule was set, and 0.85 on the 19th to 22nd, whose predictions a slow probe run
    skewed: runs/reference/cpu-2core-zoo-link-kept; 0.52 on the 27th to 30th, planned inside their
    grid's window), and the race's pick on the grid's records is
    within 5% of the best but on one question: mixtral's of runs/reference/cpu-2core-zoo-link-kept-fastest
    (18%), where DDP's two grid rounds (465 and 688 samples/s) lie wider apart than its lead over
    ZeRO-2 (576 against 475 by their medians) and the tie rule lets the prediction pick ZeRO-2.
    The 31st to 33rd (runs/reference/cpu-2core-zoo-plan-loop, a night whose grid rounds lie a median
    1.37-1.55x apart) broke it twice: on vit and mixtral the rule left out the grid's best (ZeRO-2 and
    FSDP1 FULL_SHARD, predicted below 0.6 of DDP), regret 23% and 5.0%. The 34th to 41st (all eight
    planned inside their grid's window on a quiet evening: runs/reference/cpu-2core-zoo-wide-point)
    leave out nothing within 5% of the best and miss none, and so do the 42nd to 49th (all eight
    again, the own costs fitted by least squares: runs/reference/cpu-2core-zoo-least-squares). The
    50th to 54th (runs/reference/cpu-2core-zoo-ranks-in-step) leave out nothing within 5% of the best;
    on bert the race's DDP is 13% behind the grid's ZeRO-2 by the grid's medians, whose rounds lie
    wider apart (DDP 555 and 703 samples/s, ZeRO-2 632 and 820) than that gap. The 55th to 62nd (all
    eight again, the same kept costs on another machine of the kind: runs/reference/cpu-2core-zoo-ranks-in-step-kept)
    leave out nothing within 5% of the best and miss none, and so do the 63rd to 70th (all eight, each
    probe point's step the median of its repeats: runs/reference/cpu-2core-zoo-median-point), and so do
    the 71st to 78th (all eight, the gradients' collectives priced on the trainable parameters:
    runs/reference/cpu-2core-zoo-trainable-comm), and so do the 79th to 86th (the machine's speed read
    twice: runs/reference/cpu-2core-zoo-two-reads) and the 87th to 94th (costs probed afresh on a CPU
    of another family: runs/reference/cpu-2core-zoo-zen5-probed; its frozen_tied, where DDP alone was
    within and ran once live, 14.5% behind, is the grid's best with two entrants, RACE_LEAST), and so
    do the 95th to 102nd (DDP's buffer broadcast priced, the race of at least two live:
    runs/reference/cpu-2core-zoo-ddp-buffers), and so do the 103rd to 110th (the race bound to a quarter
    of the grid's runs: runs/reference/cpu-2core-zoo-race-share) and the 111th to 118th (a frozen FSDP
    unit priced without its reduce-scatter: runs/reference/cpu-2core-zoo-frozen-units)."""
    from analysis.plan.verify import RACE_WITHIN

    models = [d for r in RECORDS for d in sorted(r.iterdir()) if (d / "plan.json").is_file()]
    assert len(models) == 118
    left_out, missed, winners_left_out = [], [], []
    for d in models:
        rule = zoo_accuracy.race_on_grid(d, zoo_accuracy.model_accuracy(d, estimate=lambda record: 1), RACE_WITHIN)
        if rule["left_out_best"] is not None and rule["left_out_best"] >= 0.95:
            winners_left_out.append((d.parent.name, d.name))
        if rule["regret"] > 0.05:
            missed.append((d.parent.name, d.name, round(rule["regret"], 2)))
        left_out.append(rule["left_out_best"] or 0.0)
    assert round(max(left_out[:18]), 2) <= 0.73 and round(max(left_out[:30]), 2) <= 0.85  # what the docs say
    assert winners_left_out == [("cpu-2core-zoo-plan-loop", "mixtral"), ("cpu-2core-zoo-plan-loop", "vit")]
    assert missed == [("cpu-2core-zoo-link-kept-fastest", "mixtral", 0.18), ("cpu-2core-zoo-plan-loop", "mixtral", 0.05),
                      ("cpu-2core-zoo-plan-loop", "vit", 0.23), ("cpu-2core-zoo-ranks-in-step", "bert", 0.13)]


def test_the_peaks_that_repeat_round_after_round_are_estimated_within_ten_percent():
    """Every zoo model's DDP and ZeRO-0 runs, and its ZeRO-3 runs on one rank, in the committed
    records (no collective of their own mid-backward: their measured peaks repeat round after
    round): the estimate within 10% of each.
    - The mixture of experts' DDP and ZeRO-0 were 10-11% over while a block's backward was counted
      as all it saves and two of its largest saved tensor: its largest (the experts' gate-up
      output) is freed early in its backward, which the traced backward sees.
    - ZeRO-3 on one rank was up to 18% over, counted with a gathered copy of every parameter and
      gathers in flight: on one rank a parameter's data is its partition."""
    checked = 0
    for d in (d for r in RECORDS for d in sorted(r.iterdir()) if (d / "grid.json").is_file()):
        one_rank = "world1" in d.parent.name
        for g in json.loads((d / "grid.json").read_text()):
            flags = " ".join(g["flags"])
            if g["status"] == "ok" and g["mem_peak_bytes"] and (
                    "--backend ddp" in flags or "z0.json" in flags or (one_rank and "z3.json" in flags)):
                error = zoo_accuracy.record_estimate(d / "grid" / g["name"]) / g["mem_peak_bytes"] - 1
                assert abs(error) <= 0.10, f"{d.relative_to(REPO)} {g['name']}: {error:+.1%}"
                checked += 1
    assert checked >= 130


def test_every_zoo_runs_peak_measured_with_every_free_seen_is_estimated_within_ten_percent():
    """Every fitting candidate of three questions (world 2; DeepSpeed on one rank; one process) on every
    zoo model, measured once after the memory profile stopped counting gloo's buffers freed unseen as
    alive to the step's end: the estimate within 10% of each measured peak (in the folders before, 49
    of 1524 runs lay beyond, all of them under and most of them FSDP2 and ZeRO-3 with accumulation,
    whose identical runs measured up to 1.3x apart; on one process, 11 of 60 lay beyond, -14.9% to
    +13.1%, before a block's traced backward held its input, 2026-12-04)."""
    from benchmarks.zoo import ZOO

    runs = {}
    for d in (d for r in PEAKS for d in sorted(r.iterdir()) if (d / "grid.json").is_file()):
        grid = json.loads((d / "grid.json").read_text())
        assert all(g["status"] == "ok" for g in grid), d
        runs[d.parent.name, d.name] = zoo_accuracy.peak_errors(d)
    # world 2 and one process for every model, and two of them on one rank under DeepSpeed
    assert {m for _, m in runs} == set(ZOO) and len(runs) == 2 * len(ZOO) + 2
    beyond = [(f, m, n, f"{e:+.1%}") for (f, m), errors in runs.items() for n, e in errors if abs(e) > 0.10]
    assert not beyond
    assert sum(len(e) for e in runs.values()) == 216 + 60


def test_a_models_question_is_the_one_its_grid_answered(tmp_path):
    """question.json names the question (grid --question); without it the first records' (world2). Its
    flags leave checkpointing out where no grid run checkpointed (a model without blocks)."""
    out = tmp_path / "m"
    _write(out, [("--a --ckpt_interval 1", 0, 1.0, 1, 1.0)], [], "--a", {})
    assert zoo_accuracy.question_of(out) == zoo_accuracy.QUESTIONS["world2"]
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
    acc = zoo_accuracy.model_accuracy(out, estimate=lambda record: 1)
    assert acc["grid_median"] == {z[0]: 110.0, z[1]: 85.0, z[2]: 180.0}
    h = zoo_accuracy.head_to_head(out, acc)
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
    assert zoo_accuracy.head_to_head(out, acc)["final_peak_bytes"] == {"autotuner": 7, "race": 3, "grid": None}
    assert h["plan_seconds"] != h["plan_seconds"]  # no plan_time.json: not a number, not 0
    (out / "plan_time.json").write_text(json.dumps({"seconds": 42.0}))
    assert zoo_accuracy.head_to_head(out, acc)["plan_seconds"] == 42.0
    assert zoo_accuracy._short(z[1]) == "--deepspeed_config z1.json --micro_batch 8 --grad_accum 2"


def test_the_committed_accuracy_page_is_what_its_records_say():
    """docs/results/zoo_accuracy.md is `zoo_accuracy.py page` of the committed records, figure for
    figure: a record or the page changed alone fails here."""
    assert PAGE.read_text() == zoo_accuracy.page(RECORDS)
    assert all(f"## {d.relative_to(REPO)}" in PAGE.read_text() for d in RECORDS)


def test_a_records_zoo_file_is_read_from_this_checkout_where_its_recorded_path_is_gone(tmp_path):
    """A run records --model as the absolute path of the checkout it ran in; the committed records'
    estimates read the zoo's file from this one where that path is gone, and nothing else."""
    gone = {"run": {"model": "/nowhere/benchmarks/zoo/cnn_bn.py", "backend": "ddp"}}
    assert zoo_accuracy.zoo_file_here(gone)["run"] == {"model": str(REPO / "benchmarks" / "zoo" / "cnn_bn.py"),
                                                       "backend": "ddp"}
    assert gone["run"]["model"] == "/nowhere/benchmarks/zoo/cnn_bn.py"  # the record read is not changed
    own = tmp_path / "benchmarks" / "zoo" / "cnn_bn.py"  # a file that is there: the user's, kept
    own.parent.mkdir(parents=True)
    own.write_text("")
    for config in ({"run": {"model": str(own)}}, {"run": {"model": "/nowhere/models/cnn_bn.py"}},
                   {"run": {"model": "/nowhere/benchmarks/zoo/not_in_the_zoo.py"}}, {"run": {"model": "hf:llama"}}):
        assert zoo_accuracy.zoo_file_here(config) == config
