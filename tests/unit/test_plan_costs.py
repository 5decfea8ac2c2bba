"""The planner's default prices each configuration's own cost (analysis/plan/backend_costs.py): kept on
this machine, else shipped for its kind, else measured first with progress; never 0 unsaid.

A plan that priced them at 0 when none were kept (the default until issue 81) ranked a ViT's six
verified configurations against their measured order (Spearman -0.83). The tests' plans see no kept
and no shipped costs (conftest.py); each test here names its own."""

import json
import os

import pytest

from analysis import plan
from analysis.plan import cli
from analysis.plan import backend_costs as bc
from analysis.plan import probe
from conftest import in_process

TINY = ["--preset", "tiny"]
QUESTION = ["--world", "2", "--gpu", "here", "--mem_budget_gb", "1", "--global_batch", "16", "--configs", "ddp",
            "--ckpt", "none", "--micro_batches", "8", "--json", *TINY]
COSTS = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 1e-4, "per_param_s": 0.0}


def _runs(costs: dict, repeats: int) -> dict:
    """measure()'s kept runs of probe points whose residuals are `costs` exactly (predicted 10 ms)."""
    n = {"2": 10, "12": 50, "wide": 52}
    params = {"2": 9_096, "12": 51_976, "wide": 210_568}
    runs = {}
    for point in bc.PROBE_POINTS:
        size = str(bc.point_size(point))
        step = 0.01 + bc.cost_seconds(costs, point[2], n[size], params[size])
        runs[bc.point_label(point)] = {"measured_s": [step] * repeats, "predicted_s": 0.01}
    return {"runs": runs, "items": n, "params": params}


def _entry(machine: dict, costs: dict = COSTS, repeats: int = bc.REPEATS) -> dict:
    return {**costs, "item": "trainable tensor", **_runs(costs, repeats), "reference_s": 1e-3, "machine": machine}


def _ship(path, machine: dict, entries: dict, measured: str = "2026-12-04 18:46 UTC on an idle machine") -> None:
    link = {"gb_s": 1.5, "latency_us": 400.0, "source": "all_reduce timed", "machine": machine,
            "measured": "2026-12-04 18:46 UTC"}
    path.write_text(json.dumps({"kinds": [{"measured": measured, "device": bc.probe_device(),
                                           "entries": {"link|world=2": link, **entries}}]}))


@pytest.fixture
def no_machine(monkeypatch):
    """A plan with --gpu here that neither calibrates nor probes: a fixed device, the machine's speed
    1 ms now, and every probe run it would make listed instead of run."""
    from analysis.plan import device
    from analysis.plan.device import machine_link

    made = {"here": [], "measured": [], "links": []}

    def here(train_argv, world, per_node, overlap, micro_batches, shipped_link=False):
        made["here"].append(shipped_link)
        link = machine_link(world, shipped_link) if shipped_link else plan.Link(1.0, 100.0, "stub")
        made["links"].append(link)
        return plan.Device("here (stub)", link, link, micro_step_s=0.01, sample_s=0.001)

    def measure(config, world, device, progress=print, repeats=bc.REPEATS, calibrated=None, counter=None):
        made["measured"].append((config, repeats))
        for point in bc.PROBE_POINTS:
            for _ in range(repeats):
                progress(f"  {counter() if counter else ''}{config}: {bc.point_label(point)}: ok")
        return {**COSTS, "item": "trainable tensor", **_runs(COSTS, repeats), "reference_s": 1e-3}

    monkeypatch.setattr(cli, "here_device", here)
    monkeypatch.setattr(device, "probe_link", lambda world: device.Link(1.0, 100.0, "probed (stub)"))
    monkeypatch.setattr(bc, "reference_seconds", lambda: 1e-3)
    monkeypatch.setattr(probe, "reference_seconds", lambda: 1e-3)
    # The real one, reached through a name bound past these stand-ins, fails instead of timing a model.
    monkeypatch.setattr(bc, "PROBE", bc.PROBE.with_name("no_such_probe_model.py"))
    monkeypatch.setattr(probe, "measure", measure)
    return made


def test_the_default_with_nothing_kept_prices_with_the_costs_shipped_for_this_kind_and_says_so(
        tmp_path, monkeypatch, no_machine):
    """Nothing kept, a machine of a kind the costs were shipped for (the same CPU and cores): the
    default plan charges every candidate its configuration's own cost from the shipped figures and
    the link shipped with them, says they are shipped and not measured here, measures nothing, and
    keeps nothing (shipped figures are not this machine's)."""
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "kept.json"))
    monkeypatch.setenv("GPTLITE_SHIPPED_COSTS", str(tmp_path / "shipped.json"))
    other = {**bc.machine(), "torch": "0.0.1"}  # another torch: shipped all the same, the line says so
    _ship(tmp_path / "shipped.json", other, {bc.key("ddp", 2): _entry(other)})
    proc = in_process(plan.main, QUESTION)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    line = next(a for a in out["assumptions"] if a.startswith("each configuration's own cost"))
    assert "not measured here, shipped for this machine's kind" in line and line.endswith("measures them here): ddp")
    assert "torch 0.0.1 (here " in line and "priced at 0" not in line
    from simulation.describe import resolve_flags

    tensors = bc.items(resolve_flags([*TINY, "--backend", "ddp"], 2), "ddp")[1]
    fitting = [c for c in out["candidates"] if c.get("fits")]
    # 4 ms a step + (2 ms + 0.1 ms a tensor) a micro-step, at the speed it was measured at
    assert fitting and all(c["own_ms"] == pytest.approx(4 + int(c["micro x accum"].split("x")[1]) * (2 + 0.1 * tensors))
                           for c in fitting)
    link, = no_machine["links"]
    assert "shipped with its costs" in link.source and link.latency_us == 400.0
    assert no_machine["measured"] == [] and no_machine["here"] == [True]
    assert not (tmp_path / "kept.json").exists()


def test_the_default_measures_what_nothing_kept_or_shipped_prices_quickly_showing_each_run(
        tmp_path, monkeypatch, no_machine):
    """Nothing kept and nothing shipped for this kind (another CPU's figures are not priced): the
    default plan measures the configuration first, QUICK_REPEATS run a probe point, a line for each
    probe run with its place among them, keeps the figures for the next plan, and says they were
    measured here; the next plan measures nothing. `measure` measures again in full what was measured
    quickly; `cached` measures nothing, pricing what it lacks at 0 and saying so."""
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "kept.json"))
    monkeypatch.setenv("GPTLITE_SHIPPED_COSTS", str(tmp_path / "shipped.json"))
    elsewhere = {**bc.machine(), "cpu": "Another CPU (cpu family 1, model 2, stepping 3)"}
    _ship(tmp_path / "shipped.json", elsewhere, {bc.key("ddp", 2): _entry(elsewhere)})
    proc = in_process(plan.main, QUESTION)
    assert proc.returncode == 0, proc.stderr
    assert no_machine["measured"] == [("ddp", bc.QUICK_REPEATS)]
    runs = len(bc.PROBE_POINTS) * bc.QUICK_REPEATS
    assert f"measuring the own costs of 1 configuration on this machine (nothing kept or shipped for them): " \
           f"{runs} probe runs" in proc.stderr
    assert all(f"[{i}/{runs}" in proc.stderr for i in range(1, runs + 1)), proc.stderr
    line = next(a for a in json.loads(proc.stdout)["assumptions"] if a.startswith("each configuration's own cost"))
    assert "measured on this machine (1 run a probe point" in line and "shipped" not in line, line
    kept = json.loads((tmp_path / "kept.json").read_text())
    assert bc.runs_per_point(kept[bc.key("ddp", 2)]) == bc.QUICK_REPEATS
    assert in_process(plan.main, QUESTION).returncode == 0 and len(no_machine["measured"]) == 1  # kept: not again
    assert in_process(plan.main, [*QUESTION, "--backend_costs", "measure"]).returncode == 0
    assert no_machine["measured"][1:] == [("ddp", bc.REPEATS)]  # measured in full, the quick figures replaced
    assert no_machine["here"][-1] is False  # measure: the link probed here, not shipped
    (tmp_path / "kept.json").unlink()
    proc = in_process(plan.main, [*QUESTION, "--backend_costs", "cached"])
    assert len(no_machine["measured"]) == 2 and "not measured (priced at 0" in proc.stdout


def test_a_quick_measurement_calibrates_the_probe_once_for_every_configuration(tmp_path, monkeypatch):
    """probe.measure's runs through the sweep runner, a stub runner in their place: the quick protocol
    (QUICK_REPEATS) runs each probe point once per configuration, calibrates each probe size once for
    all of them, and numbers every run among all of the plan's; the full one calibrates each
    configuration's own (the machine's speed drifts between them) and runs each point REPEATS times."""
    from types import SimpleNamespace

    import orchestration.runner

    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "kept.json"))
    monkeypatch.setattr(probe, "reference_seconds", lambda: 1e-3)
    launched = []

    class Runner:
        def __init__(self, directory, timeout_s):
            pass

        def run(self, planned):
            launched.append(planned.name)
            summary = SimpleNamespace(samples_per_s=100.0, error=None)
            return SimpleNamespace(status="ok", summary=summary, line=lambda: f"{planned.name}: ok")

    monkeypatch.setattr(orchestration.runner, "Runner", Runner)
    calibrated = []

    def device(model, micro_batches):
        calibrated.append(tuple(model))
        return plan.Device("here (stub)", plan.Link(1.0, 100.0, "stub"), plan.Link(1.0, 100.0, "stub"),
                           micro_step_s=0.001, sample_s=0.0001)

    lines = []
    configs = ["ddp", "ds_configs/z2.json"]
    found, missing = probe.costs_for(configs, 2, device, measure_missing=True, progress=lines.append,
                                     repeats=bc.QUICK_REPEATS)
    points = len(bc.PROBE_POINTS)
    assert set(found) == set(configs) and not missing
    assert len(launched) == 2 * points * bc.QUICK_REPEATS and len(calibrated) == len(set(calibrated)) == 3
    runs = [line for line in lines if "(blocks x micro-batch x accumulation)" in line]
    assert [r.split("]")[0].split("[")[1].split(",")[0] for r in runs] == [f"{i}/{len(launched)}"
                                                                          for i in range(1, len(launched) + 1)]
    assert all(e["source"] == "measured" and bc.runs_per_point(e) == bc.QUICK_REPEATS for e in found.values())
    launched.clear(), calibrated.clear()
    found, _ = probe.costs_for(configs, 2, device, measure_missing=True, progress=lines.append)
    assert len(launched) == 2 * points * bc.REPEATS and len(calibrated) == 2 * 3  # each configuration its own
    assert all(bc.runs_per_point(e) == bc.REPEATS for e in found.values())


def test_the_link_shipped_with_the_costs_is_priced_where_none_is_kept(tmp_path, monkeypatch):
    """The shipped costs are what was left after pricing the probe runs' calls on the link measured with
    them: with nothing kept, a plan that prices shipped costs prices the calls on that link (not probed,
    not kept); a kept link comes first; without shipped costs (--backend_costs measure) it is probed."""
    from analysis.plan import device

    probed = []
    monkeypatch.setattr(device, "probe_link", lambda world: probed.append(world) or device.Link(2.0, 700.0, "probed"))
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "kept.json"))
    monkeypatch.setenv("GPTLITE_SHIPPED_COSTS", str(tmp_path / "shipped.json"))
    _ship(tmp_path / "shipped.json", bc.machine(), {})
    link = device.machine_link(2, use_shipped=True)
    assert (link.latency_us, probed) == (400.0, []) and "shipped with its costs" in link.source
    assert not (tmp_path / "kept.json").exists()
    assert device.machine_link(4, use_shipped=True).latency_us == 700.0 and probed == [4]  # none shipped for 4
    assert device.machine_link(2).latency_us == 700.0 and probed == [4, 2]  # not shipped: probed and kept
    assert device.machine_link(2, use_shipped=True).latency_us == 700.0 and probed == [4, 2]  # kept first


def test_the_shipped_costs_are_measured_in_full_for_the_shipped_configuration_files():
    """analysis/plan/shipped_costs.json: each kind measured on one machine in full (REPEATS runs a probe
    point, the runs kept: a plan refits them by the code as it is) with the link its costs were fitted
    against; each configuration's key names the file as it is now (a file changed since is another
    configuration, which a plan would measure: ship it again, benchmarks/ship_costs.py); every fit
    non-negative."""
    from analysis.plan.candidates import configurations

    shipped = json.loads(bc.SHIPPED.read_text())
    assert shipped["kinds"]
    now = {bc.key(c, 2) for c in configurations(2, 2)}
    for kind in shipped["kinds"]:
        entries = kind["entries"]
        machines = {json.dumps({f: e["machine"][f] for f in bc.KIND}) for e in entries.values()}
        assert len(machines) == 1 and kind["measured"] and kind["device"] in ("cpu", "cuda")
        configs = {k for k in entries if not k.startswith("link|")}
        assert {f"link|{k.split('|')[1]}" for k in configs} <= set(entries)
        stale = {k for k in configs if k.split("|")[1] == "world=2"} - now
        assert not stale, f"shipped for configuration files changed since: {sorted(stale)} (benchmarks/ship_costs.py)"
        for k in configs:
            e = entries[k]
            assert bc.runs_per_point(e) == bc.REPEATS and e["reference_s"] > 0
            fitted = bc.fit_runs(e["runs"], e["items"], e.get("params"))
            assert all(v >= 0 for v in fitted.values()) and sum(fitted.values()) > 0, k


def test_shipped_figures_are_found_by_the_machines_kind_not_its_versions(tmp_path, monkeypatch):
    """A machine's kind is its CPU (with its generation), its cores and the calibration the costs are the
    rest of, the probes run on its device: another torch or DeepSpeed still finds them (the plan names
    both), another CPU, core count, calibration or device does not; an unreadable shipped file is none."""
    monkeypatch.setenv("GPTLITE_SHIPPED_COSTS", str(tmp_path / "shipped.json"))
    here = bc.machine()
    for changed, found in (({"torch": "0.0.1", "deepspeed": None, "python": "3.0"}, True), ({"cpu": "X"}, False),
                           ({"cores": (here["cores"] or 1) * 2}, False), ({"calibration": "before"}, False)):
        _ship(tmp_path / "shipped.json", {**here, **changed}, {bc.key("ddp", 2): _entry({**here, **changed})})
        assert (bc.key("ddp", 2) in bc.shipped()) is found, changed
    _ship(tmp_path / "shipped.json", here, {bc.key("ddp", 2): _entry(here)})
    other = "cuda" if bc.probe_device() == "cpu" else "cpu"
    monkeypatch.setattr(bc, "probe_device", lambda: other)
    assert bc.shipped() == {}  # probed on another device: a GPU machine's costs are its GPU's
    (tmp_path / "shipped.json").write_text("[")
    assert bc.shipped() == {}
    monkeypatch.setenv("GPTLITE_SHIPPED_COSTS", os.devnull)
    assert bc.shipped() == {}
