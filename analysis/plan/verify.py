"""Verification: the top candidates and two from further down run on this machine (or as Slurm jobs)
through the sweep runner, each a measured record."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from gptlite.errors import ConfigError
from analysis.plan.candidates import GiB


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


def flag_pairs(argv: list[str]) -> tuple[tuple[str, object], ...]:
    """train.py's flags as (name, value) pairs, a switch's value True (training/sweep.PlannedRun.flags)."""
    pairs, i = [], 0
    while i < len(argv):
        name = argv[i]
        if not name.startswith("--"):
            raise ConfigError(f"{name}: expected a --flag")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((name[2:], argv[i + 1]))
            i += 2
        else:
            pairs.append((name[2:], True))
            i += 1
    return tuple(pairs)


# Slurm settings the plan's question decides (training/slurm.py FLAGS).
SLURM_OWN = ("nodes", "gpus_per_node")


def verify(rows: list[dict], k: int, train_argv: list[str], world: int, runs_dir: Path, steps: int,
           timeout_s: float, slurm=None, rounds: int = 1) -> list[dict]:
    """Run the top `k` candidates and two from further down (to_verify) through the sweep's executor
    (training/executors.py: ordinary records under `runs_dir`, a progress line each; a record of the
    same run there is reused), each `steps` steps, `rounds` times taking turns here (the machine's
    speed drifts: each candidate's runs are spread over the whole verification), or with `slurm`
    (training/sweep.SlurmSettings) as Slurm jobs, all at once; predicted against measured, the median
    of a candidate's runs."""
    from training.executors import executor_for
    from training.sweep import PlannedRun

    chosen = to_verify(rows, k)
    planned = []  # round by round: every candidate once, then again
    for rnd in range(rounds):
        for row in chosen:
            cand = row["candidate"]
            pairs = flag_pairs([*train_argv, *cand.flags()[2:], "--steps", str(steps), "--warmup_steps", "2",
                                "--mem_profile_steps", "1", "--eval_batches", "1"])
            name = f"plan-{cand.run_name()}" + (f"-r{rnd}" if rnd else "")
            planned.append((row, PlannedRun(name, row["backend"], cand.file, world, pairs)))
    executor = executor_for("plan", runs_dir, timeout_s, [run for _, run in planned], slurm)
    lock = executor.hold_directory()
    try:
        executor.check()
        outcomes = executor.run_all(lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        lock.release()
    by_row: dict[int, list] = {}
    for (row, run), outcome in zip(planned, outcomes):
        by_row.setdefault(id(row), []).append((run, outcome))
    return [_measured(row, by_row[id(row)], runs_dir, rows.index(row) + 1) for row in chosen]


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
