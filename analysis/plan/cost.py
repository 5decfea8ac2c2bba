"""Each candidate priced: its memory (the estimator), its step time (compute, recompute, communication
and what of it waits), its command; the candidates ranked."""

from __future__ import annotations

import shlex
import sys

from tqdm import tqdm

from gptlite.data import DataError
from gptlite.errors import ConfigError
from core.config import RunConfig, interval_choices
from core.flops import sample_flops
from estimator.estimate import estimate_from_record
from training.cli import config_from_argv
from simulation.describe import MODEL_FIELDS, resolve_config
from simulation.fake_world import DEFAULT_FLAGS as COUNT_FLAGS
from orchestration.launch import launcher_for
from training.run import Setup
from analysis import project
from analysis.project import Assumptions, kept_ops, offload_seconds, price_comm
from analysis.plan.backend_costs import cost_seconds, items, trainable_params
from analysis.plan.candidates import CKPT, Candidate, GiB, MARGIN, candidates, configurations
from analysis.plan.device import Device


_FLOPS: dict[tuple, dict] = {}
_ITEMS: dict[tuple, tuple[int, int]] = {}


def resolve_candidate(cand: Candidate, model: RunConfig, world: int, per_node: int, gpu: bool = False) -> Setup:
    """The candidate's run as train.py resolves it for rank 0 of `world` ranks, `per_node` to a node:
    the model's RunConfig with the candidate's choices (on a GPU: --device cuda); ConfigError or
    DataError with train.py's reason where it refuses it."""
    return resolve_config(cand.run_config(model, **({"device": "cuda"} if gpu else {})), world, per_node)


def evaluate(cand: Candidate, train_argv: list[str], world: int, per_node: int, budget_gb: float,
             device: Device, bucket_mib: float = 25.0, counted: dict | None = None,
             model: RunConfig | None = None) -> dict:
    """One candidate: resolved as train.py would (refused: `refused` says why), its peak estimated
    against the budget, its step time predicted part by part; its communication the theory's bytes cut
    by its buckets, or with `counted` (analysis.project.count_flags) the calls and bytes counted.
    `model`: train_argv's RunConfig, where the caller parsed it once."""
    row = {"config": cand.config, "micro x accum": f"{cand.micro_batch}x{cand.grad_accum}", "ckpt": cand.ckpt,
           "candidate": cand, **({"base": cand.base} if cand.base else {})}
    try:
        setup = resolve_candidate(cand, config_from_argv(train_argv) if model is None else model, world, per_node,
                                  device.flops_per_s is not None)
    except (ConfigError, DataError) as e:
        return {**row, "refused": str(e)}
    return price(row, cand, setup, train_argv, world, per_node, budget_gb, device, bucket_mib, counted)


def price(row: dict, cand: Candidate, setup: Setup, train_argv: list[str], world: int, per_node: int,
          budget_gb: float, device: Device, bucket_mib: float = 25.0, counted: dict | None = None) -> dict:
    """`row` with the resolved candidate's peak against the budget, its step's parts and its command."""
    cfg, resolved = setup.cfg, setup.resolved
    gpu = device.flops_per_s is not None
    est = estimate_from_record({**setup.record(), "environment": {"device": str(setup.env.device)}})
    limit = budget_gb * GiB * (1 - MARGIN)
    parts = {"model states": est.model_states_bytes, "activations": est.activation_bytes}
    parts["other"] = max(0, est.total_bytes - sum(parts.values()))
    breaks = max(parts, key=parts.get)
    row.update(est_peak_gb=est.total_bytes / GiB, margin_gb=budget_gb - est.total_bytes / GiB,
               fits=est.total_bytes <= limit,
               **({} if est.total_bytes <= limit else {"breaks": f"{breaks} {parts[breaks] / GiB:.3g} GiB of "
                                                              f"{est.total_bytes / GiB:.3g} GiB"}))
    samples = setup.layout.global_batch // world
    micro_steps = 0.0  # the calibrated fixed cost of the micro-steps (a named GPU's compute has none apart)
    if gpu:
        key = (tuple(getattr(cfg, f) for f in MODEL_FIELDS), cfg.ckpt_interval, cfg.ckpt_policy)
        if key not in _FLOPS:
            # The ops a selective checkpoint keeps, as the run resolves them (its default set
            # unless --ckpt_save_ops): their forward is not run again.
            _FLOPS[key] = sample_flops(setup.workload, cfg.block_class, cfg.ckpt_interval,
                                       kept_ops(cfg))
        flops = _FLOPS[key]
        compute = (flops["model"] + flops["recomputed"]) * samples / device.flops_per_s
    else:
        share = 0.0
        if cfg.ckpt_interval:  # the measured recompute of every block, for the share of blocks checkpointed
            n = len(est.activations.full) if est.activations is not None else 0
            checkpointed = sum(c != "none" for c in interval_choices(n, cfg.ckpt_interval))
            share = device.recompute.get(cfg.ckpt_policy, 0.0) * (checkpointed / n if n else 1.0)
        micro_steps = cand.grad_accum * device.micro_step_s * (1 + share)  # refit apart when accumulations differ
        compute = micro_steps + samples * device.sample_s * (1 + share) + device.optimizer_s
    traffic, comm, wait = price_comm(setup, world, per_node, (device.inside.gb_s, device.inside.latency_us),
                                     (device.between.gb_s, device.between.latency_us), bucket_mib, counted)
    offload = 0.0
    if device.pcie_gb_s is not None:
        offload = offload_seconds(resolved, setup.n_params, world, {"pcie_gb_s": device.pcie_gb_s},
                                   Assumptions(cpu_adam_gparams_s=device.cpu_adam_gparams_s))
    own = 0.0  # the configuration's own cost, measured on this machine (backend_costs), where it was
    costs = device.backend_costs.get(cand.base or cand.config)
    if costs:
        ikey = (tuple(getattr(cfg, f) for f in MODEL_FIELDS), cfg.block_class, cfg.backend)
        if ikey not in _ITEMS:
            _ITEMS[ikey] = (items(setup, cfg.backend)[1], trainable_params(setup))
        own = cost_seconds(costs, cand.grad_accum, *_ITEMS[ikey])
    step = compute + (1 - device.overlap) * comm + wait + offload + own
    row.update(own_ms=own * 1e3, backend=cfg.backend, bytes="counted" if counted is not None else "theory", calls=sum(t[2] for t in traffic.values()),
               comm_bus_bytes=sum(t[1] for t in traffic.values()),
               compute_ms=compute * 1e3, micro_steps_ms=micro_steps * 1e3,
               comm_ms=comm * 1e3, wait_ms=wait * 1e3,
               offload_ms=offload * 1e3,
               step_ms=step * 1e3, pred_samples_per_s=setup.layout.global_batch / step,
               # the candidate's argv, made once, where its command is printed
               command=command([*train_argv, *cand.flags(), *(["--device", "cuda"] if gpu else [])], cfg.backend,
                               world, per_node))
    return row


def command(flags: list[str], backend: str, world: int, per_node: int) -> str:
    """How a user launches the candidate (per node where it spans nodes)."""
    nproc = min(world, per_node)
    nodes = "" if world <= per_node else f" (on each of {world // per_node} nodes, with --nnodes and a rendezvous)"
    launcher = "python" if world == 1 else launcher_for(backend)
    # the launcher's own flags: python none, torchrun --nproc_per_node, deepspeed --num_gpus
    ranks = {"python": [], "torchrun": ["--nproc_per_node", str(nproc)]}.get(launcher, ["--num_gpus", str(nproc)])
    return shlex.join([launcher, *ranks, "train.py", *flags]) + nodes


def plan(train_argv: list[str], world: int, per_node: int, budget_gb: float, global_batch: int, device: Device,
         configs: list[str] | None = None, ckpt: tuple[str, ...] = CKPT, micro_batches: list[int] | None = None,
         progress: bool = False, bases: dict[str, str] | None = None, counted: bool = False,
         model: RunConfig | None = None) -> list[dict]:
    """Every candidate evaluated; the ones that fit ranked by predicted samples/s first, then those
    over the budget, then those train.py refuses. `bases`: {a variant file: the configuration it varies}.
    `counted`: each fitting candidate's collectives counted as rank 0 of `world` under the fake process
    group (analysis.project.count_flags: a few seconds each, with its own flags); a count that fails
    leaves that candidate on the theory's bytes, saying why (`bytes`). `model`: train_argv's RunConfig,
    parsed once (by the caller, or here: where train.py refuses the flags, every candidate says why)."""
    cands = candidates(configs or configurations(world, per_node), world, global_batch, ckpt, micro_batches, bases)
    if model is None:
        try:
            model = config_from_argv(train_argv)
        except (ConfigError, DataError):
            pass  # each candidate refused with train.py's reason (evaluate)
    rows = []
    iterator = cands
    if progress:
        iterator = tqdm(cands, desc="candidates", unit="", file=sys.stderr, leave=False)
    for cand in iterator:
        row = evaluate(cand, train_argv, world, per_node, budget_gb, device, model=model)
        if counted and row.get("fits"):
            if progress:
                iterator.set_description(f"counting {cand.run_name()}")
            try:
                # fake_world's own short run, whatever --steps the user's flags carry
                count = project.count_flags([*train_argv, *cand.flags(), *COUNT_FLAGS], world, per_node, cand.run_name())
                row = evaluate(cand, train_argv, world, per_node, budget_gb, device, counted=count, model=model)
            except RuntimeError as e:
                row["bytes"] = f"theory ({e})"
            if progress:
                iterator.set_description("candidates")
        rows.append(row)
    return rank(rows)


def rank(rows: list[dict]) -> list[dict]:
    """Fitting candidates by predicted samples/s (then the lower peak), then those over the budget, then the refused."""
    return sorted(rows, key=lambda r: (0 if r.get("fits") else 1 if "refused" not in r else 2,
                                       -r.get("pred_samples_per_s", 0.0), r.get("est_peak_gb", 0.0)))
