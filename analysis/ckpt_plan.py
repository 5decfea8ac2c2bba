"""Checkpointing by memory budget: for each block, none, selective or full, so that the estimated
peak per rank stays within a budget in GiB at the least recompute cost, solved exactly.

    python -m analysis.estimate --preset small --micro_batch 8 --ckpt_policy auto --mem_budget_gb 0.15

Every moment of a training step that the estimator weighs (analysis/estimate.py) holds the bytes
kept for backward by the blocks below it (all blocks at the start of backward, the first i during
block i's backward) plus bytes no checkpointing choice changes. A plan therefore meets the budget
exactly when, for every k, the kept bytes of the first k blocks stay within the budget less the
largest such base among the moments over k blocks: upper bounds on prefix sums. The solver walks
the blocks in order keeping, for each reachable prefix, only the plans no other plan beats on both
kept bytes and cost (a Pareto front: a plan with fewer kept bytes and no more cost can finish
every way the other can), which is exact, and with identical blocks the front stays small (kept
bytes take few distinct values). tests/test_ckpt_plan.py holds it to brute force.

Cost of a choice for a block: the forward work the checkpoint runs again in backward, as (FLOPs of
the recomputed matmuls, convolutions and attention kernels, counted by torch's FlopCounterMode;
bytes written by the recomputed operators, traced), compared in that order: FLOPs first, and
between choices of equal FLOPs (selective under fused attention recomputes no matmul) the one that
recomputes fewer bytes. A count, not a measurement: on a CPU the recomputed elementwise work and
the selective checkpoint's per-operator dispatch cost nearly as much time as the matmuls
(benchmarks/ckpt_policies.py), which FLOPs do not see.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from analysis.estimate import Estimate
from backends.activation_checkpointing import save_ops_for
from core.config import CKPT_CHOICES
from gptlite.errors import ConfigError

GiB = 2**30


@dataclass
class CkptPlan:
    choices: list[str]  # per block: none, selective or full
    peak_bytes: int  # the estimated peak per rank with this plan
    cost: tuple[float, float]  # (recomputed FLOPs, recomputed bytes) per sample


def limits(est: Estimate, budget_bytes: int, blocks: int) -> list[float]:
    """For k = 0..blocks, the most the first k blocks may keep within `budget_bytes` (inf: no moment
    over exactly k blocks)."""
    room = [float("inf")] * (blocks + 1)
    for base, k, _ in est.moment_bases:
        room[k] = min(room[k], budget_bytes - est.batch_bytes - base)
    return room


def solve(room: Sequence[float], kept: Sequence[dict], cost: Sequence[dict]) -> list[str] | None:
    """The least-cost choice per block (cost compared as tuples) whose kept bytes keep every prefix of
    k blocks within room[k], or None where none does. `kept[i]` and `cost[i]`: {choice: value}."""
    front = [(0, (0.0, 0.0), ())]  # (kept bytes so far, cost so far, choices)
    for k in range(len(kept) + 1):
        front = [s for s in front if s[0] <= room[k]]
        if not front or k == len(kept):
            break
        grown = sorted(((b + kept[k][c], tuple(x + y for x, y in zip(spent, cost[k][c])), plan + (c,))
                        for b, spent, plan in front for c in kept[k]), key=lambda s: (s[0], s[1]))
        front, best = [], None
        for s in grown:  # the Pareto front: more kept bytes only for strictly less cost
            if best is None or s[1] < best:
                front.append(s)
                best = s[1]
    if not front:
        return None
    return list(min(front, key=lambda s: (s[1], s[0]))[2])


def peak_of(est: Estimate, kept_bytes: Sequence[int]) -> int:
    """The estimated peak with the blocks keeping `kept_bytes`."""
    return est.batch_bytes + max(base + sum(kept_bytes[:k]) for base, k, _ in est.moment_bases)


def plan(est: Estimate, budget_gb: float, block_flops: Sequence[dict], save_ops: Sequence[str] | None = None,
         choices: Sequence[str] = CKPT_CHOICES) -> CkptPlan:
    """The plan for an estimate `est` (any plan: its moments do not depend on it), within `budget_gb`.
    `block_flops`: each block's forward FLOPs by operator (core/flops.block_flops_by_op). Raises
    ConfigError naming the smallest reachable peak when no plan fits."""
    a = est.activations
    blocks = len(a.full)
    keep = set(save_ops_for("selective", save_ops))
    kept = [{c: a.retained(i, c, save_ops) for c in choices} for i in range(blocks)]

    def recomputed(i: int, choice: str) -> tuple[float, float]:
        if choice == "none":
            return (0.0, 0.0)
        spared = keep if choice == "selective" else set()
        return (float(sum(f for op, f in block_flops[i].items() if op not in spared)),
                float(sum(b for op, b in a.ops[i].items() if op not in spared)))

    cost = [{c: recomputed(i, c) for c in choices} for i in range(blocks)]
    # Planned below the budget by what the estimate cannot fix (Estimate.unfixed_bytes: an FSDP
    # reduce-scatter in flight on gloo), so that the measured peak stays within the budget.
    budget = int(budget_gb * GiB) - est.unfixed_bytes
    chosen = solve(limits(est, budget, blocks), kept, cost)
    if chosen is None:
        least = peak_of(est, [min(k.values()) for k in kept]) + est.unfixed_bytes
        raise ConfigError(f"ckpt_policy auto: no checkpointing plan fits mem_budget_gb {budget_gb:g}: the smallest "
                          f"reachable peak is {math.ceil(least / GiB * 1000) / 1000:.3f} GiB (every block keeping least: "
                          f"{', '.join(sorted({min(k, key=k.get) for k in kept}))}); raise the budget or lower "
                          "the micro-batch")
    return CkptPlan(chosen, peak_of(est, [kept[i][c] for i, c in enumerate(chosen)]),
                    tuple(sum(cost[i][c][j] for i, c in enumerate(chosen)) for j in range(2)))


def plan_for_record(config: dict, budget_gb: float, workload, choices: Sequence[str] = CKPT_CHOICES) -> CkptPlan:
    """The plan for a run described as its config.json would describe it (train.py --dry_run's
    output; `run.ckpt_policy` auto), within `budget_gb`: what train.py's --ckpt_policy auto runs.
    `workload`: the run's model (models.load), whose FLOPs are counted per block and operator."""
    from analysis.estimate import estimate, record_arguments
    from core.flops import block_flops_by_op

    model, args, kwargs = record_arguments(config)
    backend, world, micro_batch, precision, _, *rest = args
    kwargs.update(ckpt_plan=None, ckpt_policy="selective")  # every block selective: the operators' outputs traced
    est = estimate(model, backend, world, micro_batch, precision, 1, *rest, **kwargs)
    return plan(est, budget_gb, block_flops_by_op(workload, config["run"].get("block_class")), kwargs["save_ops"],
                choices)
