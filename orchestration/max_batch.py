"""The largest micro-batch a configuration fits in, by doubling then bisection.

"Fits" means a short run ends `ok`: on CUDA within the device memory (or --mem_budget_gb, which
caps the allocator), on CPU with a measured peak within --mem_budget_gb (a peak above it ends
the run as `oom`). The throughput at the largest batch is then measured with a full-length run.
This is how the suite tests the articles' claim that checkpointing frees memory which a larger
batch turns into throughput.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core.records import atomic_write_json
from orchestration.runner import Outcome, Runner
from orchestration.sweep import SweepRun


class SearchError(RuntimeError):
    """A probe neither fit nor ran out of memory (it failed or timed out): no answer."""


def largest_fitting(fits: Callable[[int], bool], start: int = 1, limit: int = 4096) -> int | None:
    """The largest n in [start, limit] with fits(n), assuming fits is monotone (true, then false).

    Doubling from `start` brackets the limit, bisection finds it: about 2 log2(n) probes.
    None if even `start` does not fit.
    """
    if not fits(start):
        return None
    good, bad = start, None
    while bad is None:
        candidate = min(good * 2, limit)
        if candidate == good:
            return good  # reached the limit
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


@dataclass
class SearchResult:
    config: str
    budget_gb: float | None
    best_micro_batch: int | None
    samples_per_s: float | None = None
    mem_peak_bytes: int | None = None
    final_run: str | None = None
    probes: list[dict] = field(default_factory=list)


def search(base: SweepRun, runner: Runner, budget_gb: float | None, probe_steps: int, full_steps: int,
           limit: int, report: Callable[[Outcome], None] = lambda outcome: None) -> SearchResult:
    """The largest micro-batch of `base`'s configuration, and its throughput over `full_steps`."""
    stem = base.config_key
    result = SearchResult(stem, budget_gb, None)
    budget = {"mem_budget_gb": budget_gb} if budget_gb else {}

    def fits(micro: int) -> bool:
        probe = base.with_flags(f"{stem}-probe-mb{micro}", micro_batch=micro, steps=probe_steps, warmup_steps=1,
                                mem_profile_steps=1, eval_batches=1, **budget)
        outcome = runner.run(probe)
        report(outcome)
        result.probes.append({"micro_batch": micro, "status": outcome.status,
                              "mem_peak_bytes": outcome.summary.mem_peak_bytes})
        if outcome.status not in ("ok", "oom"):
            raise SearchError(f"{probe.name}: {outcome.status}: {outcome.summary.error}")
        return outcome.status == "ok"

    result.best_micro_batch = largest_fitting(fits, limit=limit)
    if result.best_micro_batch is not None:
        final = base.with_flags(f"{stem}-best-mb{result.best_micro_batch}", micro_batch=result.best_micro_batch,
                                steps=full_steps, **budget)
        outcome = runner.run(final)
        report(outcome)
        result.final_run = final.name
        result.samples_per_s = outcome.summary.samples_per_s
        result.mem_peak_bytes = outcome.summary.mem_peak_bytes
    return result


def write_results(path: Path, results: list[SearchResult]) -> None:
    atomic_write_json(path, [asdict(r) for r in results])
