"""Each configuration's own cost measured on this machine: the probe runs (analysis/plan/backend_costs.py
says what is measured and how it is fitted and kept)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from analysis.plan.backend_costs import (PROBE, PROBE_POINTS, QUICK_REPEATS, REPEATS, STEPS, WIDE, at_speed, fit_runs,
                                         items, keep, key, load, machine, point_label, point_size, reference_seconds,
                                         runs_per_point, shipped, trainable_params)
from gptlite.errors import ConfigError


def measure(config: str, world: int, device, progress=print, repeats: int = REPEATS,
            calibrated: dict | None = None, counter=None) -> dict:
    """One configuration's costs, measured: the probe points (PROBE_POINTS) run `repeats` times taking turns
    through the sweep runner (in a scratch directory: nothing is kept but the figures and the runs'
    steps), fitted by backend_costs.fit_runs against the step model's prediction with the model's
    compute calibrated on that probe size (`device(train_argv, micro_batches)` returns a calibrated
    analysis.plan.Device): for this configuration, or once for every configuration measured where
    `calibrated` ({probe size: Device}) is given and filled. The machine's speed (backend_costs.reference_seconds)
    is read before and after the runs, and the faster kept as `reference_s`: a plan scales the costs
    to its own speed. `counter()` names each run's place among the plan's ("[3/24] ", ETA), if given."""
    from analysis.plan.candidates import Candidate
    from analysis.plan.cost import evaluate
    from analysis.plan.verify import flag_pairs
    from simulation.describe import resolve_flags
    from orchestration.runner import Runner
    from orchestration.sweep import SweepRun

    n, params, runs, times = {}, {}, {}, {}
    calibrated = {} if calibrated is None else calibrated
    speed = [reference_seconds()]
    with tempfile.TemporaryDirectory(prefix="backend-costs-") as tmp:
        runner = Runner(Path(tmp), 900)
        planned = {}
        for point in PROBE_POINTS:  # the step model's prediction of each point, first
            layers, micro, accum = point[:3]
            size = point_size(point)
            model = ["--model", str(PROBE), "--model_args", f"layers={layers}"
                     + (f",width={point[3]}" if point == WIDE else "")]
            cand = Candidate(config, micro, accum, "none")
            if size not in calibrated:  # for each configuration (REPEATS): the speed drifts between them
                calibrated[size] = device(model, [4, 8])
            row = evaluate(cand, model, world, world, 1e6, calibrated[size])
            if "refused" in row:
                raise ConfigError(f"{config}: the probe run is refused ({row['refused']})")
            setup = resolve_flags([*model, *cand.flags()], world)
            item, n[size] = items(setup, row["backend"])
            params[size] = trainable_params(setup)
            planned[point] = (model, cand, row)
        for rep in range(repeats):  # the points taking turns: this machine's speed drifts between runs
            for point, (model, cand, row) in planned.items():
                pairs = flag_pairs([*model, *cand.flags()[2:], "--steps", str(STEPS), "--warmup_steps", "2",
                                    "--mem_profile_steps", "1", "--eval_batches", "1"])
                label = point_label(point)
                outcome = runner.run(SweepRun(f"probe-{cand.run_name()}-l{label}-r{rep}", row["backend"],
                                                cand.file, world, pairs))
                progress(f"  {counter() if counter else ''}{config}: {label} (blocks x micro-batch x accumulation): "
                         f"{outcome.line()}")
                if outcome.status != "ok" or not outcome.summary.samples_per_s:
                    raise RuntimeError(f"{config}: its probe run did not succeed ({outcome.status}: "
                                       f"{outcome.summary.error or ''})")
                times.setdefault(point, []).append(cand.micro_batch * cand.grad_accum * world
                                                   / outcome.summary.samples_per_s)
        for point, (model, cand, row) in planned.items():
            runs[point_label(point)] = {"measured_s": times[point], "predicted_s": row["step_ms"] / 1e3}
    speed.append(reference_seconds())
    return {**fit_runs(runs, n, params), "item": item, "runs": runs, "items": {str(k): v for k, v in n.items()},
            "params": {str(k): v for k, v in params.items()}, "reference_s": min(speed)}


def costs_for(configs: list[str], world: int, device, measure_missing: bool, progress=print,
              speed_before: float | None = None, use_shipped: bool = False, repeats: int = REPEATS) -> tuple[dict, list[str]]:
    """({config: its costs} for those of `configs` kept for this machine, or (`use_shipped`) shipped for
    its kind (backend_costs.shipped), or measured first where `measure_missing`, [the configurations
    without]). Measuring, `repeats` runs a probe point: a kept entry of fewer is measured again; below
    REPEATS (--backend_costs auto's QUICK_REPEATS) the probe model is calibrated once for every
    configuration measured. Each entry's "source" says which: "kept", "shipped" or "measured". Each is
    fitted from its runs by the code as it is (backend_costs.fit_runs) and priced at the machine's speed
    now (backend_costs.at_speed): the
    reference step read here and `speed_before` (the plan's read before its calibration), the faster,
    as a probe keeps the faster of its reads before and after its runs. One read of about a second is
    not the machine's speed every time: on 2026-12-02 the first plan of each of two evenings read 2.69
    and 2.78 ms where the plans after read 1.64-1.92 (cpu-2core-zoo-median-point of docs/results/zoo_accuracy_2026-12-05.md, -trainable-comm),
    and the second's calibration, timed just before in the same plan, was as fast as the evening's
    before (its micro-step 0.68 ms against 0.72): its own costs priced 1.6x too high. The cache is
    rewritten whole, by a rename, after each configuration measured. `single` has no costs of its own
    to measure: its step, train.py's loop
    at --backend single, is what every prediction's compute is calibrated on (analysis/plan/device.py),
    so it is neither measured nor missing."""
    import time

    cache = load()
    here = machine()
    ready = shipped() if use_shipped else {}
    found, missing, to_measure = {}, [], []
    for config in configs:
        if config == "single":
            continue
        k = key(config, world)
        entry = cache.get(k)
        if entry and entry.get("machine") == here and not (measure_missing and runs_per_point(entry) < repeats):
            found[config] = {**entry, "source": "kept"}
        elif k in ready:  # shipped for this machine's kind (`use_shipped`)
            found[config] = {**ready[k], "source": "shipped"}
        elif measure_missing:
            to_measure.append(config)
        else:
            missing.append(config)
    if to_measure:
        total = len(to_measure) * len(PROBE_POINTS) * repeats
        ended: list[float] = []

        def counter() -> str:
            """Each probe run's place among the plan's, and the time left at the pace since the first
            ended (before it, the probe's calibration)."""
            ended.append(time.monotonic())
            done = len(ended)
            if done == 1 or done == total:
                return f"[{done}/{total}] "
            left = (ended[-1] - ended[0]) / (done - 1) * (total - done)
            return f"[{done}/{total}, about {f'{left:.0f} s' if left < 120 else f'{left / 60:.0f} min'} left] "

        progress(f"measuring the own costs of {len(to_measure)} configuration{'s' * (len(to_measure) > 1)} on this "
                 f"machine (nothing kept{' or shipped' if use_shipped else ''} for them): {total} probe runs "
                 f"({len(PROBE_POINTS)} points x {repeats}), world {world}; kept for the next plan ...")
        calibrated = {} if repeats < REPEATS else None  # the quick protocol: the probe calibrated once for all
    for config in to_measure:
        k = key(config, world)
        try:
            entry = {**measure(config, world, device, progress, repeats, calibrated, counter), "machine": here}
        except (ConfigError, RuntimeError) as e:  # that configuration priced without; the plan goes on
            progress(f"  {config}: not measured ({e})")
            missing.append(config)
            continue
        cache[k] = entry
        found[config] = {**entry, "source": "measured"}
        keep(cache)
    # fitted by the code as it is, from the runs kept (costs kept before the fit changed stay right)
    found = {c: {**e, **fit_runs(e["runs"], e["items"], e.get("params"))} if "runs" in e else e
             for c, e in found.items()}
    if any("reference_s" in e for e in found.values()):
        now = min(t for t in (reference_seconds(), speed_before) if t)
        found = {c: at_speed(e, now) for c, e in found.items()}
    return found, missing
