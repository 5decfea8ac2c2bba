"""The cost model refitted on the verified runs, and a saved plan replayed."""

from __future__ import annotations

import itertools
import statistics

import numpy as np

from analysis.plan.device import CALIBRATION_LINE


def _bounded_lstsq(a, b, lower, upper):
    """min |a x - b| over lower <= x <= upper, exactly, for the few unknowns of a refit: each unknown
    free or held at one of its bounds, the free ones solved by least squares, the best feasible kept
    (the first of equals: a column of zeros, one rank's communication, is solved to 0)."""
    best = None
    for states in itertools.product((None, 0, 1), repeat=a.shape[1]):
        x = np.array([0.0 if s is None else (lower, upper)[s][i] for i, s in enumerate(states)])
        if not np.all(np.isfinite(x)):
            continue
        free = [i for i, s in enumerate(states) if s is None]
        if free:
            x[free] = np.linalg.lstsq(a[:, free], b - a @ x, rcond=None)[0]
        if np.all(x >= np.array(lower) - 1e-12) and np.all(x <= np.array(upper) + 1e-12):
            residual = float(np.sum((a @ x - b) ** 2))
            if best is None or residual < best[0] * (1 - 1e-9) - 1e-30:
                best = (residual, x)
    return np.clip(best[1], lower, upper)


def refit(rows: list[dict], verified: list[dict], global_batch: int) -> dict | None:
    """The step-time model's free parameters refitted on the verified runs: a factor on compute (the
    calibration ran alone; ranks share the machine) and the share of communication not hidden
    (1 - overlap, within [0, 1]), least squares on the step time; where the verified runs accumulate
    differently and determine it with a run to spare, the calibrated micro-steps' fixed cost
    (`micro_steps_ms`) gets a factor of its own (an H100's calibration put 26 ms on each where the
    runs said 6.5, and the one factor left 8 x 8 26% under:
    runs/reference/nvidia-h100-80gb-hbm3-plan); then each verified configuration's own overhead, the
    median of its runs' measured step over the refitted one (a wrapper's hooks, a ZeRO-3 gather the
    byte count does not price), applied to its every candidate (1 for a configuration not verified;
    a --variants file counts as the configuration it varies). Each candidate's `refit_samples_per_s`
    is then the refitted prediction, and the fitting candidates are re-ranked by it. None with fewer
    than 2 measured runs."""
    by_command = {r["command"]: r for r in rows if "command" in r}
    points = [(by_command[v["command"]], global_batch / v["measured_samples_per_s"]) for v in verified
              if v["status"] == "ok" and v.get("measured_samples_per_s")]
    if len(points) < 2:
        return None
    def columns(r: dict, split: bool) -> list[float]:  # compute (less its micro-steps' fixed cost), comm
        fixed = r.get("micro_steps_ms", 0.0) if split else 0.0
        return [(r["compute_ms"] - fixed) / 1e3, r["comm_ms"] / 1e3, *([fixed / 1e3] if split else [])]

    # The split only where the runs determine it, with a run to spare: they accumulate differently, and
    # the parts they have (one rank has no communication) are not proportional across them (every run
    # DDP without checkpointing: the rest of compute and comm both constant).
    a = np.array([columns(r, True) for r, _ in points])
    used = np.abs(a).max(axis=0) > 0
    scaled = a[:, used] / np.abs(a[:, used]).max(axis=0)
    split = bool(used[2] and len({r.get("micro x accum", "").partition("x")[2] for r, _ in points}) > 1
                 and np.linalg.matrix_rank(scaled, tol=1e-6 * len(points)) == used.sum() < len(points))
    a = np.array([columns(r, split) for r, _ in points])
    b = np.array([step - (r["offload_ms"] + r.get("wait_ms", 0.0) + r.get("own_ms", 0.0)) / 1e3 for r, step in points])
    x = _bounded_lstsq(a, b, [1e-6, 0.0, *([0.0] if split else [])], [np.inf, 1.0, *([np.inf] if split else [])])
    factor, exposed = float(x[0]), float(x[1])
    fixed_factor = float(x[2]) if split else factor

    def step_of(r: dict) -> float:
        # neither overlaps compute; a configuration's own measured cost is not refitted
        waiting = r["offload_ms"] + r.get("wait_ms", 0.0) + r.get("own_ms", 0.0)
        return float(np.dot([factor, exposed, *([fixed_factor] if split else [])], columns(r, split))) + waiting / 1e3

    ratios: dict[str, list[float]] = {}
    for r, step in points:  # a variant shares the overhead of the configuration it varies
        ratios.setdefault(r.get("base") or r.get("config"), []).append(step / step_of(r))
    overhead = {config: statistics.median(x) for config, x in ratios.items()}
    for r in rows:
        if "compute_ms" in r:
            r["refit_samples_per_s"] = global_batch / (step_of(r) * overhead.get(r.get("base") or r.get("config"), 1.0))
    for v in verified:
        v["refit_samples_per_s"] = by_command[v["command"]].get("refit_samples_per_s")
    return {"compute_factor": factor, "overlap": 1 - exposed, "overhead": overhead, "runs": len(points),
            **({"micro_step_factor": fixed_factor} if split else {})}


def replay(saved: dict) -> dict:
    """A saved plan (--json's object, with its verified runs) refitted by this code's refit, without
    running anything: each candidate's parts as the plan printed them, its verified runs as measured.
    A plan saved before its candidates carried `micro_steps_ms` gets it rebuilt from its calibration
    (`calibration`, or the line `assumptions` printed): a candidate's calibrated compute is (fixed x
    accumulation + per sample x samples) x (1 + recompute) + the optimizer step, so its micro-steps'
    share of the rest is fixed x accumulation over the bracket. Returns the refit's parameters and,
    for each verified run, the prediction as the plan ran it, as this refit puts it, and measured."""
    if not (isinstance(saved, dict) and isinstance(saved.get("candidates"), list)
            and isinstance(saved.get("verified", []), list)
            and all(isinstance(c, dict) for c in [*saved["candidates"], *saved.get("verified", [])])):
        got = "its candidates or verified is not a list of objects" if isinstance(saved, dict) else \
            f"a JSON {type(saved).__name__}"
        raise ValueError(f"{got}; a plan is the object analysis.plan --verify K --json writes, its candidates and "
                         "verified lists of objects")
    rows = [dict(c) for c in saved["candidates"]]
    verified = [dict(v) for v in saved.get("verified", [])]
    timed = [r for r in rows if r.get("step_ms")]
    if not verified or not timed:
        raise ValueError("the plan has no verified runs or no timed candidates to refit on")
    # the question's global batch: every candidate's samples/s is it over its step
    global_batch = round(timed[0]["pred_samples_per_s"] * timed[0]["step_ms"] / 1e3)
    cal = saved.get("calibration")
    if cal is None and any("micro_steps_ms" not in r for r in timed):
        line = next((a for a in saved.get("assumptions", []) if "ms per micro-step" in a), "")
        got = CALIBRATION_LINE.search(line)
        cal = got and {"micro_step_s": float(got[1]) / 1e3, "sample_s": float(got[2]) / 1e3,
                       "optimizer_s": float(got[3]) / 1e3}
    for r in timed:
        if "micro_steps_ms" in r:
            continue
        if not cal:  # a named GPU's compute has no fixed part apart
            r["micro_steps_ms"] = 0.0
            continue
        micro, accum = (int(x) for x in r["micro x accum"].split("x"))
        fixed, per_sample = accum * cal["micro_step_s"], micro * accum * cal["sample_s"]
        bracket = fixed + per_sample
        r["micro_steps_ms"] = (r["compute_ms"] - cal["optimizer_s"] * 1e3) * fixed / bracket if bracket else 0.0
    as_ran = {v["command"]: v.get("refit_samples_per_s") for v in verified}
    fitted = refit(rows, verified, global_batch)
    if fitted is None:
        raise ValueError("the plan has fewer than 2 verified runs measured: nothing to refit")
    runs = [{"command": v["command"], "pred_samples_per_s": v["pred_samples_per_s"],
             "refit_as_ran": as_ran[v["command"]], "refit_samples_per_s": v.get("refit_samples_per_s"),
             "measured_samples_per_s": v["measured_samples_per_s"]}
            for v in verified if v["status"] == "ok" and v.get("measured_samples_per_s")]
    return {"global_batch": global_batch, "refit": fitted, "refit_as_ran": saved.get("refit"), "verified": runs,
            "candidates": rows}
