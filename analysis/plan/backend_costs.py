"""Each backend configuration's own cost on this machine, measured (issue 40, item 2), not assumed.

The step model (analysis/plan/cost.py) prices a candidate's compute (calibrated on the model),
its communication (alpha-beta links) and what waits. What it misses on a model nobody here wrote
is each configuration's own work: DDP's hooks and buckets, FSDP's flattening and per-unit gathers,
DeepSpeed's engine, its partitioning and its optimizer, gloo's cost per call beyond the link's
latency. On a ViT the planner put every configuration within 8% of each other where the runs
measured DDP 6.3x faster than ZeRO-3 (issue 40).

So each configuration is run on this machine (world W, STEPS steps, REPEATS times) on the probe model
(analysis/plan/probe_model.py: residual Linear + LayerNorm blocks, four parameter tensors each) at
four points, and the step model's prediction for the same run (its compute calibrated on that
probe) is taken from the measured step. What is left is the configuration's own cost, fitted as

    cost(step) = per_step + accumulation x (per_micro_step + per_item x items + per_param x parameters)

where the items are what the configuration's work goes by (items()): FSDP's units (the blocks it
wraps, and the root: measured on the probe, FSDP1 FULL_SHARD cost 5 ms more per unit at world 2 on
the 2-core CPU, whatever a unit's tensors; a unit with nothing to train, two thirds of one), else the
trainable parameter tensors; the parameters,
the trainable ones (trainable_params(): what its copies, buckets and gathers move). Fitted from (2
blocks, micro-batch 8 x 1), (12 blocks, 8 x 1), (12 blocks, 4 x 2) and (12 blocks twice as wide,
8 x 1: WIDE): the non-negative costs that fit the four points' residuals best (least squares, fit()),
refitted from the kept runs whenever a plan reads them.
The figures are kept in $GPTLITE_CACHE/backend_costs.json (default ~/.cache/gptlite; or the file
$GPTLITE_BACKEND_COSTS names), keyed by the
configuration, the world and what they were measured on (CPU, cores, torch, DeepSpeed, the
configuration file's contents): measured once per machine, again when any of those changes.

Where none are kept, a plan (--backend_costs auto, the default) prices a configuration with the
figures shipped for this machine's kind (analysis/plan/shipped_costs.json: measured so on the
machines the suite is benchmarked on, with their runs, refitted as kept ones are; shipped()), saying
so, and measures the rest first, QUICK_REPEATS run a point: a plan that priced them at 0 ranked a
ViT's configurations against their measured order (Spearman -0.83 over six verified runs), and the
full protocol took 938 s on the 2-core CPU before the first prediction (six configurations).
`--backend_costs measure` measures here, REPEATS runs a point, whatever is shipped or was measured quickly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import nnls

from analysis.plan.candidates import _source
from backends import get_backend
from core.blocks import find_blocks
from core.environment import cpu_name

PROBE = Path(__file__).resolve().with_name("probe_model.py")
# (blocks, micro-batch, accumulation) of the three probe points, at the probe's width.
POINTS = ((2, 8, 1), (12, 8, 1), (12, 4, 2))
# The fourth: the larger size's blocks WIDE_WIDTH wide (4x the parameters, two tensors more), so that a
# cost that goes with the parameters' size, not their number, is fitted apart (per_param_s). Fitted
# from the three points alone, the zoo's larger models ran their sharded configurations slower than
# priced (seen 2026-11-29 on a grid whose records were lost with its session: FSDP1 FULL_SHARD's own
# cost 26.9 ms a step on the mixture of experts, 239k parameters in 21 tensors, against 12.1 priced,
# and 9.6 against 12.1 on frozen_tied, 10k in 3; measured again: cpu-2core-zoo-wide-point of docs/results/zoo_accuracy_2026-12-05.md).
WIDE_WIDTH = 128
WIDE = (12, 8, 1, WIDE_WIDTH)
PROBE_POINTS = (*POINTS, WIDE)  # what measure() runs
STEPS = 24  # 2 warm-up, the last profiled for memory: 21 timed
# Each point run three times, taking turns, its step the median of them (point_seconds, POINT_RULE):
# what a plan's prediction is judged against is a run of the same kind, the grid's median of its
# rounds (benchmarks/zoo_accuracy.py), and a point's fastest run prices the configuration at the
# machine's best moment. From 2026-11-28 to 2026-12-02 the step was the fastest (after a median of two
# repeats, the mean of two, put 28 ms on every ZeRO-3 step: of its runs of 2 blocks, 8 x 1, one 31 ms
# and the other 65, cpu-2core-zoo-race-within/backend_costs.json of docs/results/zoo_accuracy_2026-12-05.md; and of FSDP2's three
# at 12 blocks, 4 x 2, 170, 328 and 676 ms, the median put 111 ms on every micro-step,
# cpu-2core-zoo-link-kept/backend_costs.json of docs/results/zoo_accuracy_2026-12-05.md). With the fastest, every configuration of
# every zoo model came out predicted too fast (cpu-2core-zoo-ranks-in-step-kept of docs/results/zoo_accuracy_2026-12-05.md: signed
# median errors up to +69% on ZeRO-3); refitted from the medians of those folders' kept runs
# (benchmarks/own_costs_replay.py --repeats median) the errors fell on 35 of 62 questions and rose on
# 25, which a rule judged on its own questions cannot settle: it was switched and judged on a fresh
# evening's grid (cpu-2core-zoo-median-point of docs/results/zoo_accuracy_2026-12-05.md).
POINT_RULE = "median"
REPEATS = 3
# What a plan measures when nothing is kept or shipped for a configuration (--backend_costs auto): each
# point run once, and the probe model calibrated once for all the configurations it measures (not
# for each), 4 runs a configuration where the full protocol (--backend_costs measure) makes 12 and 3
# calibrations. The points' launches are most of a probe's time: on the 2-core CPU (2026-12-06, idle) a
# probe run took 5 s launch to end under DDP, 6-7 under FSDP, 10-13 under DeepSpeed, its 24 steps a
# fraction of a second; the zoo question's six configurations took 11.5 minutes in full, and a plan
# from nothing kept measured them quickly and predicted in 4.5 minutes. One run a point
# ranks as well as the median of three: the committed zoo evenings' plans (runs/reference/cpu-2core-zoo-*,
# the eight with these points, 61 model plans) re-priced with each configuration's costs fitted from
# its first run of each point, median error a median 13% over the plans against 14% with the median
# of three, Spearman 0.87-1.00 against 0.86-0.99 (from the second or third run alone: 14% and 17%,
# Spearman at least 0.88 and 0.85).
QUICK_REPEATS = 1
# The machine's speed when the costs were measured and when a plan prices them: the probe model (12
# blocks) forward and backward at micro-batch 8 in one process, timed REFERENCE_CALLS times after a
# warm-up, their median (reference_seconds). A 2-core VM's speed drifts: the zoo's calibrations read
# it 1.7-1.8x faster 35 minutes apart (cpu-2core-zoo-link-kept-fastest of docs/results/zoo_accuracy_2026-12-05.md), and costs
# measured at one speed priced at another put every plan's own costs off by as much.
# The calls are timed in REFERENCE_BATCHES batches a REFERENCE_GAP_S apart, and the fastest batch's
# median kept (steady_seconds): one batch lasts about 50 ms on the 2-core CPU, and anything else
# running that long slows it. So read once, it read 2.54 ms in a ViT plan (2026-11-29, records lost
# with their session) where GPT-lite's, ten minutes before in the same quiet window, read 1.09 (the
# grids between ran at one speed), and that plan priced every configuration's own costs 2.3x too high:
# its median error 33% where 1.09 gives 21%.
REFERENCE = (12, 8)
REFERENCE_CALLS = 40
REFERENCE_BATCHES = 5
REFERENCE_GAP_S = 0.2
# What a probe run's prediction calibrates its compute on, which its own cost is the rest of: since
# 2026-11-28 the micro-step's forward and backward and train.py's own loop at --backend single
# (analysis/plan/device.py with_loop), since 2026-12-02 that loop as ranks in step meet it (device.together).
# Costs kept against another calibration are measured again.
CALIBRATION = "micro-step and train.py's loop, ranks in step; a wide point"


def reference_seconds() -> float:
    """This machine's speed now, as one step of a fixed tiny model (REFERENCE, in this process): a step
    of it is mostly per-operator overhead, as a configuration's own cost is. About a second: its calls
    in REFERENCE_BATCHES batches, REFERENCE_GAP_S apart (steady_seconds)."""
    spec = importlib.util.spec_from_file_location("gptlite_probe_model", PROBE)  # a model file, as train.py loads one
    probe_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe_model)
    layers, micro = REFERENCE
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = probe_model.get_model(layers)
    x = torch.randn(micro, probe_model.WIDTH, generator=gen)
    y = torch.randint(probe_model.CLASSES, (micro,), generator=gen)

    def call() -> float:
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        return time.perf_counter() - start

    for _ in range(5):  # the first calls warm up
        call()
    batches = []
    for b in range(REFERENCE_BATCHES):
        if b:
            time.sleep(REFERENCE_GAP_S)
        batches.append([call() for _ in range(REFERENCE_CALLS)])
    return steady_seconds(batches)


def steady_seconds(batches: list[list[float]]) -> float:
    """The machine's speed from batches of one call's timings taken apart in time: the fastest
    batch's median. Something else running slows the batches it overlaps; the machine slowing down
    slows them all."""
    return min(statistics.median(b) for b in batches)


def at_speed(entry: dict, now: float | None) -> dict:
    """A kept entry's costs at the machine's speed `now` (reference_seconds): scaled by now / its
    reference_s, the speed they were measured at ("scale" says by how much); unscaled where either
    is unknown (costs kept before there was a reference)."""
    then = entry.get("reference_s")
    if not then or not now:
        return entry
    f = now / then
    return {**entry, **{k: entry[k] * f for k in ("per_step_s", "per_micro_step_s", "per_item_s", "per_param_s")
                        if k in entry}, "scale": f,
            "reference_now_s": now}


def point_seconds(times: list[float], rule: str = POINT_RULE) -> float:
    """A probe point's step from its repeats, by `rule`: "median" (POINT_RULE: the step of a run of the
    kind a plan is judged against) or "fastest" (the rule until 2026-12-02, which benchmarks/own_costs_replay.py
    replays kept runs with)."""
    if rule == "median":
        return statistics.median(times)
    if rule == "fastest":
        return min(times)
    raise ValueError(f"point rule {rule!r}: 'median' or 'fastest'")


def cache_path() -> Path:
    """$GPTLITE_BACKEND_COSTS, else backend_costs.json in $GPTLITE_CACHE (default ~/.cache/gptlite)."""
    if os.environ.get("GPTLITE_BACKEND_COSTS"):
        return Path(os.environ["GPTLITE_BACKEND_COSTS"])
    return Path(os.environ.get("GPTLITE_CACHE") or Path.home() / ".cache" / "gptlite") / "backend_costs.json"


# The figures measured on the machines the suite is benchmarked on, shipped with it: a plan with nothing
# kept on a machine of one of those kinds (KIND: the same CPU, as core.environment.cpu_name names its
# generation, the same cores, the same calibration) prices with them (--backend_costs auto, cached),
# saying so, rather than measure first. $GPTLITE_SHIPPED_COSTS names another file (os.devnull: none,
# as the tests have it).
SHIPPED = Path(__file__).resolve().with_name("shipped_costs.json")
KIND = ("cpu", "cores", "calibration")


def shipped_path() -> Path:
    """$GPTLITE_SHIPPED_COSTS, else analysis/plan/shipped_costs.json."""
    return Path(os.environ.get("GPTLITE_SHIPPED_COSTS") or SHIPPED)


def probe_device() -> str:
    """The device type the probe runs train on here (train.py's default device: a GPU where there is one)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def shipped() -> dict:
    """The shipped figures for this machine's kind: {key: entry}, the entries of each kind in the
    shipped file (its "kinds": {"measured": when and how, "device": the device type the probes ran on,
    "entries": {key: entry as measure() keeps it, its "machine" with it}}) whose machine is of this
    one's KIND and whose probes ran on the device they would run on here (a GPU machine's costs are its
    GPU's, whatever its CPU), each with "shipped": that kind's "measured" (where another kind holds the
    same key, the first). None where the file is missing or unreadable."""
    try:
        kinds = json.loads(shipped_path().read_text()).get("kinds", [])
    except (OSError, ValueError, AttributeError):
        return {}
    here = machine()
    device = probe_device()
    found = {}
    for kind in kinds:
        if kind.get("device") != device:
            continue
        for k, entry in kind.get("entries", {}).items():
            there = entry.get("machine") or {}
            if k not in found and all(there.get(f) == here.get(f) for f in KIND):
                found[k] = {**entry, "shipped": kind.get("measured", "")}
    return found


def _shown(path: Path) -> str:
    """A path as a plan prints it: the repository's files relative to it."""
    repo = Path(__file__).resolve().parents[2]
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def runs_per_point(entry: dict) -> int:
    """How many runs of each probe point an entry's costs were fitted from (REPEATS where its runs
    were not kept)."""
    runs = entry.get("runs")
    return min(len(r["measured_s"]) for r in runs.values()) if runs else REPEATS


def machine() -> dict:
    """What the costs were measured on: a change of any of these measures them again."""
    cpu = cpu_name() or platform.processor()
    try:
        deepspeed = version("deepspeed")
    except Exception:  # not installed: its configurations are refused before they are probed
        deepspeed = None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "deepspeed": deepspeed,
            "python": platform.python_version(), "calibration": CALIBRATION}


def key(config: str, world: int) -> str:
    """The cache's key of `config` at `world`: its name, and a file's contents (a changed file is
    another configuration)."""
    entry = config.split(" ")[0]
    digest = ""
    if entry.endswith((".json", ".yaml")):
        digest = hashlib.sha256(_source(entry).read_bytes()).hexdigest()[:16]
    return f"{config}|world={world}|{digest}"


def items(setup, backend: str) -> tuple[str, float]:
    """What a configuration's own cost scales with, in the model training.run.Setup `setup` resolves:
    FSDP's and FSDP2's units (each block wrapped, and the root), else the trainable parameter tensors
    (per-parameter hooks, DeepSpeed's partitioning and its optimizer's loop over them).

    A unit makes three collectives: a gather in forward, one in backward and (on the micro-step that
    syncs) a reduce-scatter of its gradients; one whose parameters are all frozen makes no reduce-scatter
    (it has no gradient to reduce), so it counts as FROZEN_UNIT of a unit (frozen_units). The probe model's units all
    train, so its per-unit price is of the three. Replayed on the ten committed evenings' frozen_tied
    grids (benchmarks/own_costs_replay.py; nothing run, no other model's prediction changes), the
    median error fell on all ten, by 0.6 to 2.9 points (cpu-2core-zoo-race-share of docs/results/zoo_accuracy_2026-12-05.md: 25.7% to 23.1%)."""
    if get_backend(backend).wraps_blocks:
        units, frozen = frozen_units(setup.workload.meta(), setup.cfg.block_class)
        return "FSDP unit", units - frozen * (1 - FROZEN_UNIT)
    return "trainable tensor", len(setup.workload.param_sizes)


# A unit without a trainable parameter: its two gathers of a unit's three collectives (items()).
FROZEN_UNIT = 2 / 3


def frozen_units(model, block_class: str | None) -> tuple[int, int]:
    """(FSDP's units of `model`: its blocks and the root, of them those whose parameters are all
    frozen). The root holds what no block holds; a root that holds nothing counts as a unit that trains
    (FSDP wraps it all the same)."""
    blocks = find_blocks(model, block_class)
    inside = {id(p) for block in blocks for p in block.parameters()}
    root = [p for p in model.parameters() if id(p) not in inside]
    frozen = sum(not any(p.requires_grad for p in block.parameters()) for block in blocks)
    frozen += bool(root) and not any(p.requires_grad for p in root)
    return len(blocks) + 1, frozen


def trainable_params(setup) -> int:
    """The trainable parameters (elements) of the model `setup` resolves: what a configuration's
    copies, buckets and gathers go by besides its items (per_param_s)."""
    return sum(setup.workload.param_sizes)


def cost_seconds(costs: dict, accum: int, n: int, params: int = 0) -> float:
    """A configuration's own seconds per optimizer step (the fit above), with `n` of its items and
    `params` trainable parameters (costs kept before per_param_s: none for them)."""
    return costs["per_step_s"] + accum * (costs["per_micro_step_s"] + costs["per_item_s"] * n
                                          + costs.get("per_param_s", 0.0) * params)


def fit(residuals: dict[tuple, float], n: dict, params: dict | None = None) -> dict:
    """The probe points' residual seconds fitted (`n`, `params`: {blocks, or "wide" for WIDE: its items,
    its trainable parameters}) as cost_seconds: per step, per micro-step, per item and (where WIDE was
    run and `params` given) per parameter, each >= 0: the non-negative costs whose seconds fit the points
    best (least squares, scipy.optimize.nnls). As many points as costs: the exact solution where it has
    no negative cost. Where it has, the costs were fitted one after another before (2026-12-02), each
    from its own pair of points, a negative one set to 0 and the next taking the rest: ZeRO-2's probe on
    the 2-core CPU (cpu-2core-zoo-wide-point of docs/results/zoo_accuracy_2026-12-05.md) left 7.0 ms at 12 blocks 8 x 1 and 21.8 at
    4 x 2, so its micro-step got 12.9 ms, its step -7.8 set to 0, and every 8 x 1 ZeRO-2 candidate was
    priced 14.8 ms where its probe had left 7.0 (least squares: 9.7 ms at 12 blocks 8 x 1, 19.5 at 4 x 2)."""
    wide = params is not None and WIDE in residuals
    points = [*POINTS, *([WIDE] if wide else [])]
    rows = [[1.0, p[2], p[2] * n[point_size(p)], *([p[2] * params[point_size(p)]] if wide else [])] for p in points]
    a = np.array(rows)
    scale = np.abs(a).max(axis=0)  # the columns to one magnitude (a parameter's cost is ~1e-8 s)
    x, _ = nnls(a / scale, np.array([residuals[p] for p in points]))
    x = [float(v) for v in x / scale]
    out = {"per_step_s": x[0], "per_micro_step_s": x[1], "per_item_s": x[2]}
    return {**out, "per_param_s": x[3]} if wide else out


def point_size(point: tuple) -> int | str:
    """A probe point's model size, as the items and parameters are keyed: its blocks, "wide" for WIDE."""
    return "wide" if point == WIDE else point[0]


def point_label(point: tuple) -> str:
    """A probe point's name in the kept runs: BLOCKSxMICROxACCUM, and wWIDTH after it for WIDE."""
    return "x".join(map(str, point[:3])) + (f"w{point[3]}" if len(point) > 3 else "")


def fit_runs(runs: dict[str, dict], n: dict, params: dict | None = None, rule: str = POINT_RULE) -> dict:
    """The costs fitted from a configuration's probe runs as measure() keeps them (`runs`: {point_label:
    {measured_s: each repeat's step, predicted_s}}; `n`, `params`: {"BLOCKS" or "wide": items, trainable
    parameters}): each point's step (point_seconds, by `rule`) less the step model's prediction, fitted (fit).
    Costs kept before WIDE (three points, no `params`) are fitted from those three."""
    points = [*POINTS, *([WIDE] if params is not None and point_label(WIDE) in runs else [])]
    residuals = {point: point_seconds(runs[point_label(point)]["measured_s"], rule) - runs[point_label(point)]["predicted_s"]
                 for point in points}

    def keyed(d: dict) -> dict:
        return {k if k == "wide" else int(k): v for k, v in d.items()}

    return fit(residuals, keyed(n), None if params is None else keyed(params))


def load() -> dict:
    """The kept costs ({key: entry}); none where the file is missing or unreadable."""
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def keep(cache: dict) -> None:
    """The kept costs rewritten whole, by a rename (a reader never sees half a file); nothing is kept
    where the cache is os.devnull (the tests': a rename there would replace the device)."""
    path = cache_path()
    if str(path) == os.devnull:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(cache, f, indent=1)
        os.replace(f.name, path)
    except OSError as e:
        print(f"backend costs: cannot keep them in {path} ({e.strerror or e}); measured for this plan only",
              file=sys.stderr)


def summary_line(found: dict, missing: list[str]) -> str:
    """The plan's assumption line for the configurations' own costs: each one's figures, and where
    they came from (each entry's "source": "kept" on this machine, "measured" by this plan, "shipped"
    for this machine's kind, shipped())."""
    parts = [f"{c}: {e['per_step_s'] * 1e3:.1f} ms + {e['per_micro_step_s'] * 1e3:.1f} ms per micro-step + "
             f"{e['per_item_s'] * 1e6:.0f} us per {e['item']}"
             + (f" + {e['per_param_s'] * 1e9:.1f} ns per trainable parameter" if "per_param_s" in e else "")
             + " per micro-step" for c, e in found.items()]
    line = "each configuration's own cost (backend_costs): " + ("; ".join(parts) or "none")
    scales = [e["scale"] for e in found.values() if "scale" in e]
    if scales:
        now = next(e["reference_now_s"] for e in found.values() if "scale" in e)
        line += (f" (at the machine's speed now: the measured costs x{min(scales):.2f}"
                 + (f" to x{max(scales):.2f}" if max(scales) - min(scales) >= 0.005 else "")
                 + f", the reference step {now * 1e3:.2f} ms now against when each was measured)")
    here = machine()
    kept = [c for c, e in found.items() if e.get("source", "kept") in ("kept", "measured")]
    if kept:
        few = sorted({runs_per_point(found[c]) for c in kept})
        line += (f"; measured on this machine ({' or '.join(map(str, few))} run{'s' if few != [1] else ''} a probe "
                 f"point; kept in {cache_path()}): {', '.join(kept)}")
    by_kind: dict[str, list[str]] = {}
    for c, e in found.items():
        if e.get("source") == "shipped":
            there = e.get("machine") or {}
            versions = "".join(f", {name} {there.get(f)}" + (f" (here {here.get(f)})" if there.get(f) != here.get(f) else "")
                               for f, name in (("torch", "torch"), ("deepspeed", "DeepSpeed")))
            by_kind.setdefault(f"{there.get('cpu')}, {there.get('cores')} cores; measured {e['shipped']}{versions}",
                               []).append(c)
    for kind, configs in by_kind.items():
        line += (f"; not measured here, shipped for this machine's kind ({kind}; {_shown(shipped_path())}; "
                 f"--backend_costs measure measures them here): {', '.join(configs)}")
    if missing:
        line += f"; not measured (priced at 0; --backend_costs measure): {', '.join(missing)}"
    return line
