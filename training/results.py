"""A run's results: every rank's measurements gathered into the summary of a finished run.

Memory is per rank, the maximum over ranks; the peak is the CUDA allocator's where there is one,
else the memory profile's (runs/README.md). A peak over --mem_budget_gb ends every rank with
status oom: every rank sees every rank's peak here, so they all stop together.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch

from core import comm, flops
from core.dist import is_fake_process_group
from core.memory import peak_rss_bytes
from core.summary import RunSummary
from training.loop import LoopResult

STATE_KEYS = ("params", "params_gathered", "grads", "optimizer", "offloaded")


class MemoryBudgetExceeded(MemoryError):
    """The measured peak went over --mem_budget_gb (recorded as status oom, with the peak)."""

    def __init__(self, message: str, peak_bytes: int):
        super().__init__(message)
        self.peak_bytes = peak_bytes


def gather_ranks(result: LoopResult) -> list[dict]:
    """Every rank's memory measurements, indexed by rank."""
    mine = {"allocator": result.allocator, "profiled": result.profiled, "rss_peak": peak_rss_bytes(),
            "state": result.state_bytes}
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1) or is_fake_process_group():
        return [mine]  # a simulated world (simulation/fake_world.py) has no other ranks to ask
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    return ranks


def comm_record(measured: dict | None, theory: dict, host_device: dict | None = None,
                groups: list | None = None) -> dict | None:
    """summary.json's `comm`: the profiled step's collectives (rank 0's), the theory, their ratio,
    its host<->device copies, the calls of each process group (`groups`) and the traffic by link
    (inside a node, between nodes: core.comm.by_link)."""
    if measured is None:
        return None
    sizes: dict[str, int] = {}
    for kind, v in theory["by_kind"].items():  # a kind's first term names its group ("kind:label" ones after)
        sizes.setdefault(comm.base_kind(kind), v["group_size"])
    measured = comm.in_groups(measured, sizes, theory["world_size"])
    total, bus = comm.totals(measured)
    calls = [(tuple(g["ranks"]), g["calls"]) for g in groups] if groups is not None else None
    return {"collectives": measured, "bytes": total, "bus_bytes": bus, "theory": theory,
            "measured_over_theory": bus / theory["bus_bytes"] if theory["bus_bytes"] else None,
            "host_device": host_device, "groups": groups, "links": comm.by_link(measured, calls, theory)}


def quartiles(rates: list[float]) -> tuple[float, float]:
    """The first and third quartiles of the timed steps' rates (both the rate itself for one step)."""
    if len(rates) < 2:
        return rates[0], rates[0]
    q1, _, q3 = statistics.quantiles(rates, n=4, method="inclusive")
    return q1, q3


def finished_summary(base: RunSummary, result: LoopResult, ranks: list[dict], workload, world_size: int,
                     budget_gb: float | None, started: float, comm_theory: dict,
                     count_flops: Callable[[], dict | None] | None) -> RunSummary:
    """The summary of a run whose every step ran (raises MemoryBudgetExceeded over the budget,
    before `count_flops`, the FLOPs per sample, is called: None on the ranks that do not write it)."""
    source = "cuda_allocator" if result.allocator else ("torch_profiler" if "peak_bytes" in result.profiled else None)
    key = "allocator" if result.allocator else "profiled"
    peak = max(r[key]["peak_bytes"] for r in ranks) if source else None
    if budget_gb and peak is not None and peak > budget_gb * 2**30:
        raise MemoryBudgetExceeded(f"peak {peak / 2**30:.3f} GiB > --mem_budget_gb {budget_gb:g}", peak)
    sample_flops = count_flops() if count_flops else None
    peak_rank = max(ranks, key=lambda r: r[key].get("peak_bytes", 0)) if source else None
    samples_per_s = statistics.median(result.timed_rates) if result.timed_rates else None
    tokens = workload.tokens_per_sample
    tokens_per_s = samples_per_s * tokens if samples_per_s and tokens else None
    model_flops = sample_flops["model"] if sample_flops else None
    hardware_flops = model_flops + sample_flops["recomputed"] if sample_flops else None
    states = {k: max(r["state"].get(k, 0) for r in ranks) for k in STATE_KEYS}
    states["total"] = states["params"] + states["params_gathered"] + states["grads"] + states["optimizer"]
    p25, p75 = quartiles(result.timed_rates) if result.timed_rates else (None, None)
    return dataclasses.replace(
        base,
        status="ok",
        error=None,
        timed_steps=len(result.timed_rates),
        samples_per_s=samples_per_s,
        samples_per_s_p25=p25,
        samples_per_s_p75=p75,
        tokens_per_s=tokens_per_s,
        mfu=flops.utilisation(samples_per_s, model_flops, base.device_name, world_size),
        hfu=flops.utilisation(samples_per_s, hardware_flops, base.device_name, world_size),
        flops_per_sample=sample_flops,
        mem_source=source,
        mem_peak_bytes=peak,
        mem_avg_bytes=max(r[key]["avg_bytes"] for r in ranks) if source else None,
        mem_reserved_peak_bytes=max(r["allocator"]["reserved_peak_bytes"] for r in ranks) if result.allocator else None,
        mem_rss_peak_bytes=max(r["rss_peak"] for r in ranks),
        mem_breakdown=peak_rank["profiled"].get("breakdown") if peak_rank and result.profiled else None,
        mem_activation_peak_bytes=max((r["profiled"].get("activation_peak_bytes", 0) for r in ranks), default=None)
        if result.profiled else None,
        comm=comm_record(ranks[0]["profiled"].get("collectives"), comm_theory, ranks[0]["profiled"].get("transfers"),
                         ranks[0]["profiled"].get("groups")),
        model_state_bytes=states,
        final_loss=result.final_loss,
        val_loss=result.val_loss,
        wall_time_s=time.time() - started,
    )
