"""torch.compile for every backend: each transformer block's forward, compiled in place.

Why blocks, and why their `forward`:
- The blocks are identical, so one graph (forward and backward) serves them all: compile time is
  that of one block, not of the model, and a graph break in one place costs one block's worth.
- What a backend does around a block stays outside the compiled code: DDP's gradient hooks,
  FSDP1's and FSDP2's gathers and reshards (module hooks and wrappers on the block), activation
  checkpointing's wrapper (torch's checkpoint then reruns the compiled forward in backward).
  ZeRO-3 is the exception: DeepSpeed fetches parameters in hooks on each layer inside the block,
  which it keeps out of dynamo, so its blocks compile in pieces (the graph breaks are recorded;
  DeepSpeed's DeepCompile, which moves the fetches into the graph, needs its CUDA ops).
  Compiling `module.forward`, rather than
  `module.compile()` (which compiles `_call_impl`, hooks included) or `torch.compile(module)`
  (an OptimizedModule wrapper, `_orig_mod.` in every parameter name), leaves the module, its hooks
  and its state-dict keys exactly as they were: checkpoints, export and init_from are unchanged.
- The same placement works under every backend, so compiled runs compare backends as eager ones
  do. (torchtitan compiles per block too, before sharding.)

What the run records: the target, backend and mode (the plan), and, from dynamo's own compilation
metrics (torch._dynamo.utils.get_compilation_metrics, counters), the frames compiled, the graphs,
the graph breaks, the recompilations and the seconds spent compiling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn


# inductor's modes that replay CUDA graphs (cudagraph trees, on a CUDA device): a replay's outputs live
# in the graphs' memory pool, and the replays of the next generation overwrite them, so the first forward
# of each training step (and each evaluation forward) is marked as a new generation (mark_step, torch's
# own torch.compiler.cudagraph_mark_step_begin). Without the mark, the H200's first warm-up step under
# --compile_mode reduce-overhead failed: "accessing tensor output of CUDAGraphs that has been overwritten
# by a subsequent run" (2026-12-04, runs/reference/nvidia-h200/README.md); with it, not yet run on a GPU.
# Once a step, not once a micro-step: the compiled backward's gradients are pool outputs too, which
# .grad may hold (AccumulateGrad keeps the first), and a new generation between two micro-steps would
# overwrite the gradients accumulated so far (torch's cudagraph_trees.py: "accessing gradient tensor
# output of CUDAGraphs that has been overwritten ... with gradient accumulation"). The optimizer's
# zero_grad(set_to_none=True) lets them go before the next step's mark.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def uses_cudagraphs(backend: str, mode: str) -> bool:
    """Whether torch.compile with `backend` and `mode` replays CUDA graphs (on a CUDA device)."""
    return backend == "inductor" and mode in CUDAGRAPH_MODES


def mark_step() -> None:
    """A new step for cudagraph trees: the outputs of the replays before it may be overwritten now."""
    torch.compiler.cudagraph_mark_step_begin()


def apply_compile(blocks: Sequence[nn.Module], backend: str, mode: str, memory_budget: float | None = None) -> dict:
    """Compile each block's forward in place; what was done, for the run record. `memory_budget`
    (--compile_memory_budget): torch's activation_memory_budget for inductor's partitioner, set for
    the process (a run is one process; graphs are partitioned lazily, at their first backward, so
    a context around the compile call would be gone by then)."""
    if backend not in ("inductor", "aot_eager", "eager"):
        raise ValueError(f"compile backend must be inductor, aot_eager or eager (got {backend!r})")
    import torch._dynamo
    import torch._functorch.config

    torch._dynamo.reset()  # this run's compilation metrics only
    # torch's default (1.0) unless given: the setting is process-wide, and must not outlive a run.
    torch._functorch.config.activation_memory_budget = 1.0 if memory_budget is None else float(memory_budget)
    options = {"backend": backend, **({"mode": mode} if backend == "inductor" and mode != "default" else {})}
    for block in blocks:
        block.forward = torch.compile(block.forward, **options)
    return {"target": f"forward of each of the {len(blocks)} blocks, in place", "backend": backend, "mode": mode,
            "activation_memory_budget": torch._functorch.config.activation_memory_budget}


def compile_stats() -> dict:
    """What dynamo did in this process so far: frames compiled, graphs, graph breaks, recompilations
    (frames compiled again after a guard failed, with the first reasons) and compile seconds
    (dynamo's per-frame compile times, which include the backend's forward compilation, plus the
    backward graphs compiled at the first backward)."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    metrics = list(get_compilation_metrics())
    recompiles = [m.recompile_reason for m in metrics if m.recompile_reason]
    seconds = sum(m.entire_frame_compile_time_s or 0.0 for m in metrics)
    seconds += sum((m.backward_cumulative_compile_time_us or 0) for m in metrics) / 1e6
    return {
        "frames": len(metrics),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": len(recompiles),
        "recompile_reasons": [r.splitlines()[0][:200] for r in recompiles[:5]],
        "compile_s": round(seconds, 3),
    }
