"""Each configuration's own cost on this machine (analysis/plan/probe.py, backend_costs.py): fitted
from the probe runs, kept per machine, priced at the machine's speed now."""

import json
import time

import pytest

from analysis import plan


def test_backend_costs_are_fitted_from_the_probe_runs_and_kept_per_machine(tmp_path, monkeypatch):
    """The three probe points' residuals give back the per-step, per-micro-step and per-tensor costs
    they were made of; they are kept in $GPTLITE_CACHE/backend_costs.json per configuration and world,
    measured again when the machine (or the file) changes; with `measure_missing` off the others are
    listed, not measured; a configuration whose probe fails is listed, and the plan goes on."""
    from analysis.plan import backend_costs as bc
    from analysis.plan import probe

    truth = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 1e-4}
    tensors = {2: 10, 12: 50}
    residuals = {(layers, m, a): bc.cost_seconds(truth, a, tensors[layers]) for layers, m, a in bc.POINTS}
    assert bc.fit(residuals, tensors) == pytest.approx(truth)
    assert bc.fit({k: 0.0 for k in residuals}, tensors) == {"per_step_s": 0.0, "per_micro_step_s": 0.0,
                                                             "per_item_s": 0.0}
    # With the wide point: a cost per parameter told apart from the cost per tensor (the wide point has
    # two tensors more and four times the parameters); where nothing goes by the size, none is fitted.
    sized = {**truth, "per_param_s": 2e-8}
    tensors, params = {2: 10, 12: 50, "wide": 52}, {2: 9_000, 12: 52_000, "wide": 208_000}
    size = {**{p: p[0] for p in bc.POINTS}, bc.WIDE: "wide"}
    residuals = {p: bc.cost_seconds(sized, p[2], tensors[size[p]], params[size[p]]) for p in size}
    assert bc.fit(residuals, tensors, params) == pytest.approx(sized)
    assert bc.fit(residuals, tensors)["per_item_s"] > 1.2 * truth["per_item_s"]  # three points: the size in the tensors
    residuals = {p: bc.cost_seconds(truth, p[2], tensors[size[p]], params[size[p]]) for p in size}
    assert bc.fit(residuals, tensors, params) == pytest.approx({**truth, "per_param_s": 0.0})
    sizeonly = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 0.0, "per_param_s": 2e-8}
    residuals = {p: bc.cost_seconds(sizeonly, p[2], tensors[size[p]], params[size[p]]) for p in size}
    assert bc.fit(residuals, tensors, params) == pytest.approx(sizeonly, abs=1e-12)
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "backend_costs.json"))
    measured = []

    def fake_measure(config, world, device, progress=print, *protocol):
        measured.append((config, world))
        if config == "ds_configs/z3.json":
            raise RuntimeError("its probe run did not succeed")
        return {**truth, "item": "trainable tensor"}

    monkeypatch.setattr(probe, "measure", fake_measure)
    configs = ["ddp", "fsdp_configs/fsdp2.yaml", "ds_configs/z3.json"]
    found, missing = probe.costs_for(configs, 2, None, measure_missing=False, progress=lambda line: None)
    assert (found, missing, measured) == ({}, configs, [])
    found, missing = probe.costs_for(configs, 2, None, measure_missing=True, progress=lambda line: None)
    assert set(found) == {"ddp", "fsdp_configs/fsdp2.yaml"} and missing == ["ds_configs/z3.json"]
    assert found["ddp"]["per_item_s"] == truth["per_item_s"]
    kept = json.loads((tmp_path / "backend_costs.json").read_text())
    assert len(kept) == 2 and all(e["machine"] == bc.machine() for e in kept.values())
    measured.clear()
    found, missing = probe.costs_for(configs[:2], 2, None, measure_missing=True, progress=lambda line: None)
    assert measured == [] and set(found) == set(configs[:2])  # kept: not measured again
    found, _ = probe.costs_for(["ddp"], 4, None, measure_missing=True, progress=lambda line: None)
    assert measured == [("ddp", 4)]  # another world is another measurement
    monkeypatch.setattr(probe, "machine", lambda: {"cpu": "another"})
    measured.clear()
    probe.costs_for(["ddp"], 2, None, measure_missing=True, progress=lambda line: None)
    assert measured == [("ddp", 2)]  # another machine: measured again
    assert "not measured" in bc.summary_line({}, ["ds_configs/z3.json"])
    measured.clear()  # single's step is the calibration itself: nothing of its own to measure
    assert probe.costs_for(["single"], 2, None, measure_missing=True, progress=lambda line: None) == ({}, [])
    assert measured == []


def test_backend_costs_fit_is_the_best_non_negative_one_where_the_exact_one_is_negative(tmp_path, monkeypatch):
    """Where the exact solution through the probe points has a negative cost, the fit is the non-negative
    costs that fit the points best, not one cost set to 0 and the next taking the rest: ZeRO-2's probe
    on the 2-core CPU (wide-point, docs/results/zoo_accuracy_2026-12-05.md) left 7.0 ms at 12 blocks 8 x 1 and 21.8
    at 4 x 2, and one after another its 8 x 1 candidates were priced 14.8 ms. A plan refits kept costs
    from their kept runs by the code as it is."""
    import random

    from analysis.plan import backend_costs as bc
    from analysis.plan import probe

    n, params = {2: 10, 12: 50, "wide": 52}, {2: 9_096, 12: 51_976, "wide": 210_568}
    left = {(2, 8, 1): 5.4e-3, (12, 8, 1): 7.0e-3, (12, 4, 2): 21.8e-3, bc.WIDE: 8.2e-3}
    size = {**{p: p[0] for p in bc.POINTS}, bc.WIDE: "wide"}

    def misfit(costs: dict) -> float:
        return sum((bc.cost_seconds(costs, p[2], n[size[p]], params[size[p]]) - r) ** 2 for p, r in left.items())

    fitted = bc.fit(left, n, params)
    assert all(v >= 0 for v in fitted.values())
    assert abs(bc.cost_seconds(fitted, 1, n[12], params[12]) - 7.0e-3) < 3.5e-3  # one after another: 14.8 ms
    rng = random.Random(0)
    for _ in range(200):  # no other non-negative costs fit the points better
        other = {k: max(0.0, v * rng.uniform(0.5, 1.5) + rng.choice([0.0, 1e-3 if k != "per_param_s" else 1e-9]))
                 for k, v in fitted.items()}
        assert misfit(other) >= misfit(fitted) - 1e-15
    # kept with figures fitted otherwise (a cache from before): priced as its runs fit now
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "backend_costs.json"))
    runs = {bc.point_label(p): {"measured_s": [r + 0.02, r + 0.01, r + 0.01], "predicted_s": 0.01} for p, r in left.items()}
    kept = {"per_step_s": 0.0, "per_micro_step_s": 12.9e-3, "per_item_s": 3e-5, "per_param_s": 7.5e-9,
            "item": "trainable tensor", "runs": runs, "items": {str(k): v for k, v in n.items()},
            "params": {str(k): v for k, v in params.items()}, "machine": bc.machine()}
    (tmp_path / "backend_costs.json").write_text(json.dumps({bc.key("ds_configs/z2.json", 2): kept}))
    found, missing = probe.costs_for(["ds_configs/z2.json"], 2, None, measure_missing=False, progress=lambda line: None)
    assert not missing and found["ds_configs/z2.json"]["per_micro_step_s"] == pytest.approx(fitted["per_micro_step_s"])
    assert json.loads((tmp_path / "backend_costs.json").read_text())[bc.key("ds_configs/z2.json", 2)] == kept


def test_the_machine_the_costs_are_kept_for_names_the_cpus_generation():
    """Two CPUs /proc/cpuinfo names alike ("AMD EPYC", as virtual machines do) but of other families
    are other machines: costs kept on one are not priced on the other."""
    from core.environment import cpu_name

    def cpuinfo(family):
        one = f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: 2\n" \
              "model name\t: AMD EPYC\nstepping\t: 1\n"
        return one + "\n" + one.replace("processor\t: 0", "processor\t: 1").replace(f": {family}", ": 99")

    assert cpu_name(cpuinfo(26)) == "AMD EPYC (cpu family 26, model 2, stepping 1)"  # the first processor's
    assert cpu_name(cpuinfo(25)) != cpu_name(cpuinfo(26))
    assert cpu_name("processor\t: 0\nmodel name\t: Some CPU\n") == "Some CPU"  # no ids: the name alone
    assert cpu_name("processor\t: 0\nBogoMIPS\t: 50.00\n") is None  # no name (some ARM kernels)
    assert cpu_name(cpuinfo(26), ids=False) == "AMD EPYC"  # a record's device_name: the name alone


def test_kept_costs_are_priced_at_the_machines_speed_now(tmp_path, monkeypatch):
    """Costs measured while the machine ran at one speed (its reference step, kept beside them) are
    scaled to the speed a plan reads when it prices them; costs kept without a reference stay as
    kept; the cache keeps what was measured, unscaled; the plan's assumption line says by how much."""
    from analysis.plan import backend_costs as bc
    from analysis.plan import probe

    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "backend_costs.json"))
    truth = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 1e-4, "item": "trainable tensor"}
    speeds = iter([2e-3, 1e-3])  # measured at 2 ms a reference step; the plan reads 1 ms: twice as fast
    monkeypatch.setattr(probe, "reference_seconds", lambda: next(speeds))
    monkeypatch.setattr(probe, "measure", lambda config, world, device, progress=print, *protocol:
                        {**truth, "reference_s": probe.reference_seconds()})
    found, _ = probe.costs_for(["ddp"], 2, None, measure_missing=True, progress=lambda line: None)
    assert found["ddp"]["per_step_s"] == pytest.approx(0.002) and found["ddp"]["per_item_s"] == pytest.approx(5e-5)
    assert json.loads((tmp_path / "backend_costs.json").read_text())["ddp|world=2|"]["per_step_s"] == 0.004
    assert "x0.50" in bc.summary_line(found, [])
    speeds = iter([4e-3])  # kept, read at 4 ms now: twice as slow as when measured
    found, _ = probe.costs_for(["ddp"], 2, None, measure_missing=False, progress=lambda line: None)
    assert found["ddp"]["per_micro_step_s"] == pytest.approx(0.004) and "x2.00" in bc.summary_line(found, [])
    # benchmarks/own_costs_replay.py prices refitted costs at the speed the plan read, from its line
    from benchmarks.own_costs_replay import speed_now

    assert speed_now({"assumptions": ["overlap 0.5", bc.summary_line(found, [])]}) == pytest.approx(4e-3)
    assert speed_now({"assumptions": [bc.summary_line({"ddp": truth}, [])]}) is None
    assert bc.at_speed(truth, 4e-3) == truth  # kept without a reference: as kept
    scaled = bc.at_speed({**truth, "per_param_s": 1e-8, "reference_s": 2e-3}, 4e-3)
    assert scaled["per_param_s"] == pytest.approx(2e-8) and scaled["per_item_s"] == pytest.approx(2e-4)
    assert 0 < bc.reference_seconds() < 1  # the real one: a step of a tiny model, in seconds


def test_the_machines_speed_is_not_read_from_a_moment_something_else_ran():
    """The reference step that prices kept costs at the machine's speed now (backend_costs.
    reference_seconds) is the fastest of its batches' medians, taken apart in time: something else
    running through one batch (a ViT plan on 2026-11-29, its records lost with their session, read
    2.54 ms where the machine ran at about 1.1 and priced every configuration 2.3x too high)
    does not move it; the machine slowing down through all of them does."""
    from analysis.plan import backend_costs as bc

    steady = [[1.0e-3, 1.1e-3, 1.2e-3]] * bc.REFERENCE_BATCHES
    assert bc.steady_seconds(steady) == pytest.approx(1.1e-3)
    # through three batches of five: more than half the calls, their median 2.4 ms
    blip = [*[[2.4e-3, 2.6e-3, 2.5e-3]] * 3, *steady[3:]]
    assert bc.steady_seconds(blip) == pytest.approx(1.1e-3)
    slower = [[2 * t for t in b] for b in steady]
    assert bc.steady_seconds(slower) == pytest.approx(2.2e-3)
    assert bc.REFERENCE_BATCHES >= 3 and bc.REFERENCE_GAP_S > 0


def test_a_plan_prices_kept_costs_at_the_faster_of_its_two_reads_of_the_machines_speed(tmp_path, monkeypatch):
    """The plan reads the reference step before its calibration and again when it prices the kept
    costs (probe.costs_for's speed_before), and keeps the faster, as a probe run keeps the faster of
    its reads before and after: one read slowed by something else (the first plan of two evenings,
    trainable-comm, docs/results/zoo_accuracy_2026-12-05.md: 2.78 ms where the plans after read 1.64-1.75) does
    not price every configuration's own cost 1.6x too high; the machine slowing through both reads does."""
    from analysis.plan import backend_costs as bc
    from analysis.plan import probe

    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "backend_costs.json"))
    kept = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 1e-4, "item": "trainable tensor",
            "reference_s": 2e-3, "machine": bc.machine()}
    (tmp_path / "backend_costs.json").write_text(json.dumps({bc.key("ddp", 2): kept}))

    def priced(now: float, before: float | None) -> float:
        monkeypatch.setattr(probe, "reference_seconds", lambda: now)
        found, _ = probe.costs_for(["ddp"], 2, None, measure_missing=False, progress=lambda line: None,
                                   speed_before=before)
        return found["ddp"]["per_step_s"]

    assert priced(3e-3, 1e-3) == pytest.approx(0.002)  # the read now slow, the one before fast: the faster
    assert priced(1e-3, 3e-3) == pytest.approx(0.002)
    assert priced(3e-3, 3e-3) == pytest.approx(0.006)  # both slow: the machine is
    assert priced(3e-3, None) == pytest.approx(0.006)  # no read before: this one


def test_a_probe_points_step_is_the_median_of_its_repeats():
    """A probe point's step is the median of its repeats (backend_costs.point_seconds, POINT_RULE): a run
    of the kind the plan is judged against (the grid's median of its rounds), so one slow repeat does not
    set the cost and one fast one does not either; "fastest", the rule before, stays for
    benchmarks/own_costs_replay.py --repeats fastest."""
    from analysis.plan import backend_costs as bc

    assert bc.POINT_RULE == "median"
    assert bc.point_seconds([0.170, 0.328, 0.676]) == 0.328
    assert bc.point_seconds([0.170, 0.328, 0.676], "fastest") == 0.170
    with pytest.raises(ValueError, match="median"):
        bc.point_seconds([0.1], "mean")
    truth = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 1e-4}
    tensors = {2: 10, 12: 50}
    runs = {}
    for slow, (layers, m, a) in zip((1, 2, 3), bc.POINTS):
        typical = 0.01 + bc.cost_seconds(truth, a, tensors[layers])  # predicted 0.01 s, plus the cost
        runs[f"{layers}x{m}x{a}"] = {"predicted_s": 0.01, "measured_s": [typical * (1 + slow), typical, typical * 0.9]}
    assert bc.fit_runs(runs, {"2": 10, "12": 50}) == pytest.approx(truth)
    assert bc.fit_runs(runs, {"2": 10, "12": 50}, rule="fastest") != pytest.approx(truth)  # the fast runs' costs
    # the wide point kept beside them (measure's names and keys since it was added)
    sized = {**truth, "per_param_s": 2e-8}
    n, params = {"2": 10, "12": 50, "wide": 52}, {"2": 9_000, "12": 52_000, "wide": 208_000}
    for point in (*bc.POINTS, bc.WIDE):
        size = "wide" if point == bc.WIDE else str(point[0])
        typical = 0.01 + bc.cost_seconds(sized, point[2], n[size], params[size])
        runs[bc.point_label(point)] = {"predicted_s": 0.01, "measured_s": [typical * 3, typical, typical * 0.99]}
    assert bc.point_label(bc.WIDE) == "12x8x1w128" and bc.point_label(bc.POINTS[0]) == "2x8x1"
    assert bc.fit_runs(runs, n, params) == pytest.approx(sized)
    fastest = bc.fit_runs(runs, n, params, "fastest")
    assert fastest != pytest.approx(sized) and sum(fastest.values()) < sum(sized.values())
