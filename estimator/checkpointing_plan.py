"""Checkpointing by memory budget: for each block, none, selective or full, so that the estimated
peak per rank stays within a budget in GiB at the least recompute cost, solved exactly.

    python -m analysis.estimate_cli --preset small --micro_batch 8 --ckpt_policy auto --mem_budget_gb 0.15

Every moment of a training step that the estimator weighs (estimator/estimate.py) holds the bytes
kept for backward by the blocks below it (all blocks at the start of backward, the first i during
block i's backward) plus bytes no checkpointing choice changes. A plan therefore meets the budget
exactly when, for every k, the kept bytes of the first k blocks stay within the budget less the
largest such base among the moments over k blocks: upper bounds on prefix sums. The solver walks
the blocks in order keeping, for each reachable prefix, only the plans no other plan beats on both
kept bytes and cost (a Pareto front: a plan with fewer kept bytes and no more cost can finish
every way the other can), which is exact, and with identical blocks the front stays small (kept
bytes take few distinct values). tests/unit/test_ckpt_plan.py holds it to brute force.

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
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch

import backends
from backends.activation_checkpointing import apply_ac, save_ops_for
from backends.torch_backend import AUTOCAST_DTYPES
from core.blocks import find_blocks
from core.dist import synchronize
from core.flops import block_flops_by_op
from core.config import CKPT_CHOICES
from estimator.estimate import Estimate, estimate, record_arguments
from gptlite.errors import ConfigError

GiB = 2**30
# Kept free below the budget for the estimator's error where the program's order fixes the peak: its
# largest under-estimate measured on the CPU frontier (benchmarks/ckpt_frontier.py) was 3.0%
# (GPT-lite small, every block selective), the others within 0.5%.
HEADROOM = 0.03


@dataclass
class CheckpointingPlan:
    choices: list[str]  # per block: none, selective or full
    peak_bytes: int  # the estimated peak per rank with this plan
    cost: tuple[float, float]  # (recomputed FLOPs, recomputed bytes) per sample; measured: (seconds per micro-batch, bytes)
    measured: bool = False

    def describe_cost(self) -> str:
        return (f"recomputing {self.cost[0] * 1e3:.3g} ms per micro-batch (measured)" if self.measured
                else f"recomputing {self.cost[0] / 1e9:.3g} GFLOP per sample")


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
         choices: Sequence[str] = CKPT_CHOICES, measured: dict | None = None) -> CheckpointingPlan:
    """The plan for an estimate `est` (any plan: its moments do not depend on it), within `budget_gb`.
    `block_flops`: each block's forward FLOPs by operator (core/flops.block_flops_by_op). `measured`
    (measured_costs): the seconds every block's recompute costs under full and selective, shared
    among the blocks as their counted work, instead of the counted work. Raises ConfigError naming
    the smallest budget a plan fits when none does."""
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
    if measured:
        for c in choices:
            # Each block's share of the measured time: its share of the counted FLOPs (of the bytes where
            # the choice recomputes no FLOPs: selective under fused attention).
            key = 0 if sum(cost[i][c][0] for i in range(blocks)) > 0 else 1
            total = sum(cost[i][c][key] for i in range(blocks)) or 1.0
            for i in range(blocks):
                cost[i][c] = (measured.get(c, 0.0) * cost[i][c][key] / total, cost[i][c][1])
    # Planned below the budget by the estimator's error (HEADROOM) and what the estimate cannot fix
    # (Estimate.unfixed_bytes: an FSDP reduce-scatter in flight on gloo), so that the measured peak
    # stays within the budget.
    budget = int(budget_gb * GiB * (1 - HEADROOM)) - est.unfixed_bytes
    chosen = solve(limits(est, budget, blocks), kept, cost)
    if chosen is None:
        least = (peak_of(est, [min(k.values()) for k in kept]) + est.unfixed_bytes) / (1 - HEADROOM)
        raise ConfigError(f"ckpt_policy auto: no checkpointing plan fits mem_budget_gb {budget_gb:g}: the smallest budget "
                          f"a plan fits is {math.ceil(least / GiB * 1000) / 1000:.3f} GiB (every block keeping least: "
                          f"{', '.join(sorted({min(k, key=k.get) for k in kept}))}; a plan keeps {HEADROOM:.0%} of the "
                          "budget for the estimator's error); raise the budget or lower the micro-batch")
    return CheckpointingPlan(chosen, peak_of(est, [kept[i][c] for i, c in enumerate(chosen)]),
                    tuple(sum(cost[i][c][j] for i, c in enumerate(chosen)) for j in range(2)), bool(measured))


def plan_for_record(config: dict, budget_gb: float, workload, choices: Sequence[str] = CKPT_CHOICES,
                    measure: bool = False) -> CheckpointingPlan:
    """The plan for a run described as its config.json would describe it (train.py --dry_run's
    output; `run.ckpt_policy` auto), within `budget_gb`: what train.py's --ckpt_policy auto runs.
    `workload`: the run's model (models.load), whose FLOPs are counted per block and operator. With
    `measure` and `run.ckpt_cost` measured, the recompute is timed on the run's device
    (measured_costs) where the model can be built whole there."""
    model, args, kwargs = record_arguments(config)
    backend, world, micro_batch, precision, _, *rest = args
    kwargs.update(ckpt_plan=None, ckpt_policy="selective")  # every block selective: the operators' outputs traced
    est = estimate(model, backend, world, micro_batch, precision, 1, *rest, **kwargs)
    run = config["run"]
    flops = block_flops_by_op(workload, run.get("block_class"))
    # Whether a plan fits does not depend on the costs: a budget none fits is refused before anything is
    # timed (under a launcher, every rank then fails at once, not rank 0 seconds after the others).
    counted = plan(est, budget_gb, flops, kwargs["save_ops"], choices)
    if not (measure and run.get("ckpt_cost", "measured") == "measured"):
        return counted
    device = (config.get("environment") or {}).get("device", "cpu")
    single = estimate(model, backends.REFERENCE, 1, micro_batch, precision, 0, *rest[:1], **{**kwargs, "ckpt_policy": "full"})
    measured = measured_costs(workload, run.get("block_class"), micro_batch, device, kwargs["save_ops"],
                              [c for c in choices if c != "none"], single.total_bytes, precision=precision)
    return plan(est, budget_gb, flops, kwargs["save_ops"], choices, measured) if measured else counted


def measured_costs(workload, block_class: str | None, micro_batch: int, device: str, save_ops, policies: Sequence[str],
                   needs_bytes: int, reps: int = 3, precision: str = "fp32") -> dict[str, float] | None:
    """Seconds a micro-batch's forward and backward takes more with every block checkpointed under each
    of `policies` (full, selective) than without, timed on `device` with the model built whole (seed 0)
    at `micro_batch` under the run's `precision` (autocast, as the torch backends run it): the median of
    `reps` after a warm-up, the policies alternating. None where the
    model's step (`needs_bytes`, the estimator's single-process peak) would take more than half the
    device's free memory: the plan then weighs counted work."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return None  # a GPU run described on a machine without one (simulation/describe.py): counted
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
    else:
        free = psutil.virtual_memory().available
    if needs_bytes * (1 + len(policies)) > free / 2:
        return None
    x, y = workload.example(micro_batch)
    x, y = x.to(dev), y.to(dev)
    models = {"none": workload.build(0).to(dev)}
    for policy in policies:
        models[policy] = model = workload.build(0).to(dev)
        apply_ac(model, find_blocks(model, block_class), 1, "torch_nonreentrant", False, policy=policy,
                 save_ops=save_ops)
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        for rep in range(reps + 1):
            for name, model in models.items():
                seconds = seconds_of(dev, lambda: forward_backward(model, x, y, precision))
                if rep:
                    times[name].append(seconds)
                model.zero_grad(set_to_none=True)
    none = statistics.median(times["none"])
    return {policy: max(0.0, statistics.median(times[policy]) - none) for policy in policies}


def forward_backward(model, x, y, precision: str) -> None:
    """One micro-batch's forward and backward as the torch backends run it: under autocast to
    `precision`'s dtype (none for fp32). Timing it in fp32 for a bf16 run would time other kernels
    (on a GPU, fp32 matrix products several times slower than bf16)."""
    dtype = AUTOCAST_DTYPES[precision]
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        loss = model(x, y)[1]
    loss.backward()


def seconds_of(dev, fn) -> float:
    """Wall seconds of `fn()` on device `dev`, the work it queued there included."""
    synchronize(dev)
    started = time.perf_counter()
    fn()
    synchronize(dev)
    return time.perf_counter() - started
