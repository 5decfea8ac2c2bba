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
RECORDS = [REPO / "runs" / "reference" / "cpu-2core-zoo"]
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
        "candidates": [{"config_flags": f.split(), "command": f"run {f}", "fits": True, "pred_samples_per_s": p,
                        "refit_samples_per_s": r} for f, p, r in candidates],
        "pick": f"run {pick}", "race": race}))


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


def test_the_committed_accuracy_page_is_what_its_records_say():
    """docs/results/zoo_accuracy.md is `zoo_accuracy.py page` of the committed records, figure for
    figure: a record or the page changed alone fails here."""
    assert PAGE.read_text() == zoo_accuracy.page(RECORDS)
    assert all(f"## {d.relative_to(REPO)}" in PAGE.read_text() for d in RECORDS)
