"""Verification: the top candidates and two from further down run on this machine (or as Slurm jobs)
through the sweep runner, each a measured record."""

from __future__ import annotations

import statistics
from pathlib import Path

from gptlite.errors import ConfigError
from analysis.plan.candidates import GiB
from analysis.plan.run import flag_pairs, run_candidates, short_run  # noqa: F401 - flag_pairs: the planner's API


def to_verify(rows: list[dict], k: int) -> list[dict]:
    """The top `k` fitting candidates, and two from further down the fitting ones, to test the
    ranking: the best-ranked of each backend the top `k` leave out, then of each configuration
    (the model's largest errors are a configuration's own overhead, which the refit learns only
    from a run of it: on GPT-lite small here DDP's best ran 33% above ZeRO-2's and FSDP's with the
    same batch and checkpointing, predicted within 1%), else a third and two thirds of the way down."""
    fitting = [r for r in rows if r.get("fits")]
    top, rest = fitting[:k], fitting[k:]
    extra: list[dict] = []
    for family in (lambda r: r.get("backend"), lambda r: r.get("base") or r.get("config")):
        seen = {family(r) for r in top + extra}
        for r in rest:
            if len(extra) < 2 and family(r) not in seen and not any(r is e for e in extra):
                seen.add(family(r))
                extra.append(r)
    rest = [r for r in rest if not any(r is e for e in extra)]
    lower = sorted({len(rest) // 3, (2 * len(rest)) // 3}) if len(rest) > 1 else list(range(len(rest)))
    return top + extra + [rest[i] for i in lower][:2 - len(extra)]


# The race's default entry (entrants()): the configurations predicted within this share of the best.
RACE_WITHIN = 0.6
# and at least this many entrants: where fewer configurations are within, the next best-ranked
# candidates (of any configuration, an entered one's other micro-batches and checkpointing too).
RACE_LEAST = 2

# The race's cost bound (issue 40: regret within 5% "using <= 1/4 of the full grid's run time"): at
# most this share of the fitting candidates' runs, each as long as a grid run, and never fewer than
# RACE_LEAST runs. None: no bound. Where it binds: the zoo's GRU, 8 fitting candidates (no FSDP, no
# checkpointing), whose race of two entrants run twice each took 26-58% of its grid's run time on ten
# evenings; bound to two runs, replayed on the 102 committed questions' grids (race_on_grid), its
# regret stayed 0% on all ten at 12-22% of the grid's time, and no other question's pick changed
# (the 24-candidate grids' races run 4-5 of their 6).
RACE_SHARE = 0.25

# Slurm settings the plan's question decides (orchestration/slurm.py FLAGS).
SLURM_OWN = ("nodes", "gpus_per_node")


def verify(rows: list[dict], k: int, train_argv: list[str], world: int, runs_dir: Path, steps: int,
           timeout_s: float, slurm=None, rounds: int = 1) -> list[dict]:
    """Run the top `k` candidates and two from further down (to_verify) through the sweep's executor
    (orchestration/executors.py: ordinary records under `runs_dir`, a progress line each; a record of the
    same run there is reused), each `steps` steps, `rounds` times taking turns here (the machine's
    speed drifts: each candidate's runs are spread over the whole verification), or with `slurm`
    (orchestration/sweep.SlurmSettings) as Slurm jobs, all at once; predicted against measured, the median
    of a candidate's runs."""
    chosen = to_verify(rows, k)
    return _run_rows(chosen, rows, train_argv, world, runs_dir, steps, timeout_s, slurm, rounds, "plan")


def _run_rows(chosen: list[dict], rows: list[dict], train_argv: list[str], world: int, runs_dir: Path, steps: int,
              timeout_s: float, slurm, rounds: int, prefix: str) -> list[dict]:
    """`chosen` run `rounds` times taking turns through the sweep's executor, each `steps` steps, as
    records named `prefix`-<candidate> (-r<round> after the first); each measured (_measured)."""
    planned = []  # round by round: every candidate once, then again
    for rnd in range(rounds):
        for row in chosen:
            cand = row["candidate"]
            name = f"{prefix}-{cand.run_name()}" + (f"-r{rnd}" if rnd else "")
            planned.append((row, short_run(name, cand, row["backend"], world, train_argv, steps)))
    outcomes = run_candidates(prefix, runs_dir, timeout_s, [run for _, run in planned], slurm)
    by_row: dict[int, list] = {}
    for (row, run), outcome in zip(planned, outcomes):
        by_row.setdefault(id(row), []).append((run, outcome))
    out = []
    for row in chosen:
        measured = _measured(row, by_row[id(row)], runs_dir, rows.index(row) + 1)
        measured["steps"] = steps
        # Seconds each run took from launch to its end (a reused record: 0); what a race is charged.
        measured["run_seconds"] = sum(0.0 if o.skipped else o.seconds for _, o in by_row[id(row)])
        out.append(measured)
    return out


def entrants(rows: list[dict], per_family: int = 1, within: float = 0.0, least: int | None = None) -> list[dict]:
    """The race's entrants: the `per_family` best-ranked fitting candidates of each configuration
    (a backend's file or flags, a --variants file its own), in the order ranked. A configuration's
    own costs are what the step model misses most on a model it was not tuned on (issue 40: ZeRO-3
    measured at 0.08 of its prediction on a ViT where DDP was at 0.54), and they are shared by its
    micro-batches and checkpointing, which the calibrated compute ranks within it.
    `within` (0 to 1): only the configurations whose best prediction is at least `within` x the best
    candidate's; 0 enters every one. The model's errors are large, but not that large across a whole
    configuration: on the zoo's 22 model questions (cpu-2core-zoo* of docs/results/zoo_accuracy_2026-12-05.md) no configuration predicted
    below 0.6 of the leader measured within 5% of the grid's best (at most 0.73 of it on the first 18,
    0.85 on the four whose own costs a slow probe run skewed; docs/results/zoo_accuracy_2026-12-05.md).
    `least` (default RACE_LEAST): where fewer are entered, the next best-ranked fitting candidates
    join, in the order ranked, up to that many. A race of one is no race: on the zoo's frozen_tied
    (2026-12-03, cpu-2core-zoo-zen5-probed of docs/results/zoo_accuracy_2026-12-05.md) only DDP was within, its best-ranked
    candidate (8 x 1) ran once and was picked, 14.5% behind DDP 4 x 2 by the grid's medians, the
    plan's second."""
    if not 0.0 <= within <= 1.0:
        raise ConfigError(f"race_within must lie between 0 and 1 (got {within!r})")
    fitting = [r for r in rows if r.get("fits")]
    lead = max((r["pred_samples_per_s"] for r in fitting), default=0.0)
    seen: dict[str, int] = {}
    out = []
    for r in fitting:
        if r["config"] not in seen:  # a configuration enters on its best-ranked candidate's prediction
            seen[r["config"]] = 0 if r["pred_samples_per_s"] >= within * lead else per_family
        if seen[r["config"]] < per_family:
            seen[r["config"]] += 1
            out.append(r)
    entered = {id(r) for r in out}
    for r in fitting:  # fewer than `least`: the next best-ranked join
        if len(entered) >= (RACE_LEAST if least is None else least):
            break
        entered.add(id(r))
    return [r for r in fitting if id(r) in entered]


def race(rows: list[dict], train_argv: list[str], world: int, runs_dir: Path, steps: int, timeout_s: float,
         budget_gb: float, slurm=None, per_family: int = 1, within: float = 0.0, measure=None,
         share: float | None = RACE_SHARE) -> dict:
    """Successive halving, trusting no prediction across configurations: every configuration's
    entrants (entrants()) run `steps` steps; the faster half of those that ran ok within the budget
    (measured peak) run again, and so on, until a round after the first has at most two: the faster
    is the pick, where the gap between the two is wider than either one's own runs lie apart; where
    it is not, the one predicted faster (`tied`).
    A candidate's speed is the median of all its runs so far, so a survivor's measurement grows
    longer round by round. Every run is `steps` long: a longer run measures other steps (on the
    2-core CPU, a 32-step run of an HF Llama under DDP took 19-23 ms for steps 2-6 and 22-35 ms
    after; ZeRO-2's took 20-31 ms throughout), and the grid the race is judged against runs as long.
    `within`: which configurations enter (entrants()). `share` (RACE_SHARE): at most that share of the
    fitting candidates' runs in all, at least RACE_LEAST: the best-ranked entrants alone enter where more
    would not fit, and a round that would go over is not run (the last round's faster is the pick).
    `measure(alive, round)`: how a round's
    candidates are measured (default: run here, or as Slurm jobs, through the sweep's executor; the
    same rule on records already measured: benchmarks/zoo_accuracy.py).
    Returns {rounds: [[measured, ...],
    ...] (each run as verify's, with its `round` and `race_samples_per_s`, the median of the
    candidate's runs so far), pick (the winner's last, None if nothing ran ok within the budget),
    steps_run (every run's steps, summed), run_seconds (their launch-to-end seconds, summed),
    grid_steps (the fitting candidates x `steps`), runs, grid_runs, within, tied}."""
    if measure is None:
        def measure(alive: list[dict], rnd: int) -> list[dict]:
            return _run_rows(alive, rows, train_argv, world, runs_dir, steps, timeout_s, slurm, 1, f"race{rnd}")
    alive = entrants(rows, per_family, within)
    fitting = sum(1 for r in rows if r.get("fits"))
    most_runs = None if share is None else max(RACE_LEAST, int(share * fitting))
    if most_runs is not None:
        alive = alive[:most_runs]
    rounds: list[list[dict]] = []
    history: dict[str, list[float]] = {}
    while alive:
        if rounds and most_runs is not None and sum(map(len, rounds)) + len(alive) > most_runs:
            break
        measured = measure(alive, len(rounds))
        good = []
        for m in measured:
            m["round"] = len(rounds)
            fits = m["status"] == "ok" and m.get("measured_samples_per_s") and (
                m.get("measured_peak_gb") is None or m["measured_peak_gb"] <= budget_gb)
            if fits:
                history.setdefault(m["command"], []).append(m["measured_samples_per_s"])
                m["race_samples_per_s"] = statistics.median(history[m["command"]])
                good.append(m)
        rounds.append(measured)
        good.sort(key=lambda m: -m["race_samples_per_s"])
        # The last two raced (each at least twice: two entrants run again): the faster is the pick.
        if len(good) <= 1 or (len(good) <= 2 and len(rounds) > 1):
            break
        by_command = {r["command"]: r for r in alive}
        alive = [by_command[m["command"]] for m in good[:max(2, (len(good) + 1) // 2)]]
    last = [m for m in rounds[-1] if "race_samples_per_s" in m] if rounds else []
    pick = max(last, key=lambda m: m["race_samples_per_s"], default=None)
    tied = False
    if len(last) == 2:
        # A difference the finalists' own runs do not resolve is no evidence: the prediction breaks
        # the tie. Resolved: the faster's median above the slower's by more than either finalist's
        # runs lie apart (the faster over the slower of its own runs). (Live on the zoo's BERT, 2026-11-28:
        # ZeRO-1 measured 770 and 533 samples/s, DDP 593 and 650; ZeRO-1 won on its median, 4.8%
        # ahead; alternated four times each afterwards DDP was 13% faster, as predicted.)
        low, high = sorted(last, key=lambda m: m["race_samples_per_s"])
        spread = max(max(history[m["command"]]) / min(history[m["command"]]) - 1 for m in last)
        if high["race_samples_per_s"] / low["race_samples_per_s"] - 1 <= spread:
            # (a refused candidate, one no backend can run the model under, has no command)
            predicted = {r["command"]: r.get("pred_samples_per_s", 0.0) for r in rows if "command" in r}
            pick, tied = max(last, key=lambda m: predicted.get(m["command"], 0.0)), True
    every = [m for rnd in rounds for m in rnd]
    return {"rounds": rounds, "pick": pick, "steps_run": sum(m["steps"] for m in every),
            "run_seconds": sum(m["run_seconds"] for m in every), "grid_steps": fitting * steps,
            "runs": len(every), "grid_runs": fitting, "within": within, "tied": tied}


def _measured(row: dict, runs: list, runs_dir: Path, rank: int) -> dict:
    """A verified candidate from its runs: ok only if every run was; samples/s the median of its ok
    runs; its spread (two candidates whose spreads overlap are a tie): one run's, the quartiles of its
    timed steps; several runs', from the slowest run to the fastest (the machine's speed drifts
    between runs more than within one); the peak the highest, an oom run's too (its record keeps it)."""
    ok = [o.summary for _, o in runs if o.status == "ok" and o.summary.samples_per_s]
    status = next((o.status for _, o in runs if o.status != "ok"), "ok")
    if len(ok) > 1:
        spread = [min(s.samples_per_s for s in ok), max(s.samples_per_s for s in ok)]
    else:
        spread = [ok[0].samples_per_s_p25, ok[0].samples_per_s_p75] if ok else [None, None]
    peaks = [o.summary.mem_peak_bytes for _, o in runs if o.summary.mem_peak_bytes]
    label = " ".join(str(row[k]) for k in ("config", "micro x accum", "ckpt") if k in row)
    out = {"candidate": label, "command": row["command"],
           "record": str(runs_dir / runs[0][0].name), "status": status,
           "measured_samples_per_s": statistics.median(s.samples_per_s for s in ok) if ok else None,
           "pred_samples_per_s": row["pred_samples_per_s"], "measured_spread": spread,
           "measured_peak_gb": max(peaks) / GiB if peaks else None, "est_peak_gb": row["est_peak_gb"], "rank": rank}
    if len(runs) > 1:
        out["records"] = [str(runs_dir / run.name) for run, _ in runs]
        out["measured_runs"] = [o.summary.samples_per_s if o.status == "ok" else None for _, o in runs]
    return out
