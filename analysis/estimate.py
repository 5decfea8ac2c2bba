"""Memory per rank for a configuration, before running it: model states and activations.

    python -m analysis.estimate --preset paper --world 8 --config ds_configs/z3.json
    python -m analysis.estimate --preset small --world 2 --fsdp_config fsdp_configs/shard_grad_op.yaml \\
        --ckpt_interval 1 --micro_batch 8 --json
    python -m analysis.estimate --model hf:llama --model_args num_hidden_layers=4,hidden_size=256 --world 8 \\
        --config ds_configs/z3.json --micro_batch 4

DeepSpeed's estimators cover model states only; the peak of a training step is usually set by
activations. This estimator adds them, from the tensors GPT-lite's forward keeps for backward
(counted op by op and checked against autograd's saved tensors), and walks backward block by block
for the peak, where activations are freed while gradients and temporaries appear.

Model states (per rank, fp32 master weights everywhere; c = bytes of the compute dtype):
- replicated (single, ddp, FSDP NO_SHARD, ZeRO-0): params 4P, grads 4P, Adam state 8P;
- FSDP FULL_SHARD / HYBRID_SHARD, FSDP2 resharding: everything / shard group, plus (FSDP1) the root
  unit gathered after forward; SHARD_GRAD_OP / FSDP2 without resharding: all parameters gathered;
- ZeRO-1/2: parameters whole (c P), gradients partitioned, fp32 master + Adam state partitioned
  (12 P / world); ZeRO-3: parameters partitioned, gathered from forward until backward while
  stage3_max_live_parameters allows (DeepSpeed's 1e9 default: the whole model here).
Offloaded states count the same bytes, in host memory (`host_bytes`).

Activations per block (B micro-batch, T block size, C width, H heads, e bytes per activation,
m bytes per dropout mask: e on CPU, 1 on CUDA): 12 BTC e (block input, two LayerNorm outputs,
q, k, v, attention output, FFN input and the 4C-wide ReLU output) + 16 BT (LayerNorm statistics);
naive attention, or sdpa with dropout on CPU (its math kernel): + B H T^2 e (softmax), + T^2 (the
causal mask, naive only); with dropout: + 2 BTC m + B H T^2 (e + m). A checkpointed block keeps its input
(BTC e) and recomputes the rest in backward.

Mixed precision: 16-bit activations where the backend computes in 16 bits (FSDP and DeepSpeed
cast the module); under autocast (single, ddp) the residual stream and LayerNorm outputs stay fp32
and q, k, v each save their own 16-bit cast. On CUDA the activations of the head (final LayerNorm,
lm_head, log-softmax) count at the start of backward, and one block's backward with fused
attention holds about 10 B T C elements of gradients at once. Offloaded states are on the host.

Accuracy: within 5% for model states and 15% for the peak against every fp32 configuration of
sweeps/cpu_quick.yaml measured on CPU; within 10% of the allocator's peak for every bf16 run on the
H100 in runs/reference/ (tests/test_estimate.py checks both).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from analysis.memory_model import (DS_MAX_LIVE, DS_PERSISTENCE, DS_PREFETCH_BUCKET, DS_REDUCE_BUCKET, F32, Counts,
                                   activation_per_block, backward_transient, head_activations, layout_for)
from gptlite.data import DataError
from gptlite.errors import ConfigError
from gptlite.model import PRESETS, GPTConfig, preset


@dataclass
class Estimate:
    params: int
    params_gathered: int
    grads: int
    optimizer: int
    activation_bytes: int  # what forward keeps for backward, at the peak
    total_bytes: int  # the peak of a training step per rank
    host_bytes: int = 0  # of the model states, the part offloaded to host memory
    terms: dict = field(default_factory=dict)  # the named pieces of the peak
    assumptions: list[str] = field(default_factory=list)

    @property
    def model_states_bytes(self) -> int:
        return self.params + self.params_gathered + self.grads + self.optimizer


@dataclass
class Activations:
    """A model's activation terms at one micro-batch, in bytes (per block: lists)."""

    full: list[int]  # what each block keeps for backward
    kept: list[int]  # what a checkpointed block keeps instead (its input)
    transient: int  # the largest short-lived buffers of one block's backward
    head: int  # kept after the blocks, alive until backward leaves the head
    before: int  # kept before the blocks, alive through all of backward
    logits_grad: int  # the output's gradient, made first in backward
    batch: int  # inputs and targets


def gptlite_activations(cfg: GPTConfig, micro_batch: int, act: int, mask: int, device: str, autocast: bool,
                        residual: int) -> Activations:
    """GPT-lite's, by formula (analysis/memory_model.py)."""
    full = activation_per_block(cfg, micro_batch, act, mask, device, autocast=autocast)
    return Activations(
        full=[full] * cfg.n_layer, kept=[micro_batch * cfg.block_size * cfg.n_embd * residual] * cfg.n_layer,
        transient=backward_transient(cfg, micro_batch, act, device),
        head=head_activations(cfg, micro_batch, act, residual), before=0,
        logits_grad=micro_batch * cfg.block_size * cfg.vocab_size * F32,
        batch=2 * micro_batch * cfg.block_size * 8)  # token ids of inputs and targets


def traced_activations(traced, micro_batch: int, act: int) -> Activations:
    """Any model's, traced (analysis/traced_model.py), scaled to 16 bits where the run computes in 16."""
    t = traced.at(micro_batch)

    def scale(value: int) -> int:
        return value * act // F32

    transient = max((2 * big + inp for big, inp in zip(t["largest"], t["kept"])), default=0)
    return Activations(full=[scale(v) for v in t["full"]], kept=[scale(v) for v in t["kept"]],
                       transient=scale(transient), head=scale(t["after"]), before=scale(t["before"]),
                       logits_grad=t["output"], batch=t["batch"])


def estimate(cfg, backend: str, world: int = 1, micro_batch: int = 1, precision: str = "fp32",
             ckpt_interval: int = 0, device: str = "cpu", fsdp_options=None, ds_config: dict | None = None,
             ranks_per_node: int | None = None) -> Estimate:
    """The per-rank memory of one training step of a model under a backend configuration.

    `cfg`: GPT-lite's GPTConfig (activations by formula), or any model traced once
    (analysis/traced_model.TracedModel)."""
    for name, value, minimum in (("world", world, 1), ("micro_batch", micro_batch, 1),
                                 ("ckpt_interval", ckpt_interval, 0)):
        if not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name} must be an integer >= {minimum} (got {value!r})")
    lay = layout_for(backend, world, precision, fsdp_options, ds_config, ranks_per_node)
    traced = not isinstance(cfg, GPTConfig)
    n = cfg.counts if traced else Counts.of(cfg)
    P, W, c = n.total, lay.shards, lay.compute_bytes
    assumptions = ["fp32 master weights and AdamW state (exp_avg, exp_avg_sq) in every backend"]
    if precision != "fp32":
        assumptions.append(f"{precision}: 16-bit activations (an fp32 residual stream under autocast); calibrated "
                           "against the H100 reference runs (runs/reference/)")

    # Model states, as the run records count them (model_state_bytes).
    if lay.kind == "replicated" and backend == "deepspeed" and c != F32:
        # ZeRO-0 in 16 bits: the module in 16 bits, the fp32 master copy with the optimizer.
        params, gathered, grads, optimizer = c * P, 0, c * P, 12 * P
    elif lay.kind == "replicated":
        params, gathered, grads, optimizer = F32 * P, 0, F32 * P, 8 * P
    elif lay.kind == "full_shard":
        params, grads, optimizer = F32 * P // W, F32 * P // W, 8 * P // W
        gathered = c * n.root if lay.fsdp1_root_gathered else 0
    elif lay.kind == "shard_grad_op":
        params, gathered, grads, optimizer = F32 * P // W, c * P, F32 * P // W, 8 * P // W
    elif lay.kind == "zero12":
        params, gathered, grads, optimizer = c * P, 0, c * P // W, 12 * P // W
    else:  # zero3
        threshold = float(lay.ds.get("stage3_param_persistence_threshold", DS_PERSISTENCE))
        persistent = sum(s for s in n.small if s < threshold)
        params = c * ((P - persistent) // W + persistent)
        gathered = c * min(P - persistent, int(float(lay.ds.get("stage3_max_live_parameters", DS_MAX_LIVE))))
        grads, optimizer = c * P // W, 12 * P // W
        if (lay.ds.get("offload_optimizer") or {}).get("device", "none") != "none":
            grads += F32 * P // W  # the fp32 gradient partition the CPU optimizer steps with
    optimizer += F32 * n.tensors // (W if lay.kind != "replicated" else 1)  # Adam's step counters

    # Activations and the peak: walk backward from the last block.
    on_cpu = device == "cpu"
    act = 2 if precision in ("bf16", "fp16") else F32
    # single and ddp run mixed precision as autocast over fp32 weights (backends/torch_backend.py);
    # FSDP and DeepSpeed cast the module's parameters, so every activation is 16-bit there.
    autocast = act != F32 and backend in ("single", "ddp", "accelerate")
    residual = F32 if autocast else act
    mask = act if on_cpu else 1
    a = traced_activations(cfg, micro_batch, act) if traced else \
        gptlite_activations(cfg, micro_batch, act, mask, device, autocast, residual)
    if traced:
        assumptions.append("activations traced once in fp32 on fake tensors (analysis/traced_model.py)"
                           + (", scaled to 16 bits" if act != F32 else ""))
    blocks = len(a.full)
    transient, head = a.transient, a.head
    checkpointed = [bool(ckpt_interval) and i % ckpt_interval == 0 for i in range(blocks)]
    per_block = [a.kept[i] if ck else a.full[i] for i, ck in enumerate(checkpointed)]

    # On an accelerator, offloaded states live in host memory, not in the device's: the optimizer
    # state always; the parameter shards under FSDP's CPU offload and ZeRO-Infinity's offload_param;
    # ZeRO-3's gradient partitions under ZeRO-Offload.
    offloading = lay.offload and device != "cpu"
    params_host = offloading and (backend in ("fsdp", "fsdp2")
                                  or (lay.ds.get("offload_param") or {}).get("device", "none") != "none")
    grads_host = offloading and lay.kind == "zero3"
    host = (optimizer if offloading else 0) + (params if params_host else 0) + (grads if grads_host else 0)
    resident = (0 if params_host else params) + (0 if offloading else optimizer)
    if lay.kind in ("shard_grad_op", "zero3") or lay.fsdp1_root_gathered:
        resident += gathered
    if lay.ddp_bucket:
        resident += grads
    if lay.kind == "zero3":
        resident += 0 if grads_host else grads
        # The gradient bucket is allocated whole when contiguous_gradients is on, however small the model.
        bucket = int(float(lay.ds.get("reduce_bucket_size", DS_REDUCE_BUCKET)))
        resident += c * (bucket if lay.ds.get("contiguous_gradients", True) else min(P, bucket))
        resident += c * min(P, int(float(lay.ds.get("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET))))
    if lay.kind == "zero12" and lay.offload and on_cpu:
        resident += F32 * P // W  # ZeRO-Offload's fp32 gradient partition for the CPU optimizer (host memory)
    if lay.kind == "zero12":
        # ZeRO-1/2 reduce gradients through two buckets of reduce_bucket_size elements.
        transient += 2 * F32 * int(float(lay.ds.get("reduce_bucket_size", DS_REDUCE_BUCKET)))
    if lay.kind in ("full_shard",):
        # In a unit's backward: its parameters gathered again and the next unit's prefetched, and its
        # whole gradients (FSDP2 copies them into the reduce-scatter's input as well). The largest
        # unit bounds it: it sets the peak of models whose blocks are large beside their activations
        # (ResNet's last stage).
        unit = max(n.per_block, default=0)
        transient += 2 * c * unit + (2 if backend == "fsdp2" else 1) * c * unit
    grad_bytes = F32 if lay.kind != "zero12" else c
    # FSDP's CPU offload copies each gradient shard to host memory asynchronously and waits for
    # the copies at the end of backward: until then the fp32 shards stay on the device as well.
    # Backward starts in the head: every block's activations and the head's are alive.
    resident += a.before  # what the forward kept before the first block lives through backward
    peak, where = resident + sum(per_block) + head + a.logits_grad, blocks
    for i in reversed(range(blocks)):
        grads_so_far = 0 if (lay.ddp_bucket or lay.kind in ("zero12", "zero3")) else grad_bytes * (
            n.head + sum(n.per_block[i + 1:]) + n.per_block[i] // 3) // W
        # Blocks below i still hold what they kept; block i holds all its activations (kept, or
        # recomputed if it is checkpointed) while its backward runs.
        total = resident + grads_so_far + sum(per_block[:i]) + a.full[i] + transient
        if total > peak:
            peak, where = total, i
    # The optimizer step: every resident state with the gradients complete, and the update's
    # temporaries (torch's single-tensor AdamW: about two of the largest tensor's shard). It sets the
    # peak of models whose activations are small beside their states.
    separate_grads = not (lay.ddp_bucket or lay.kind == "zero3" or grads_host) or lay.grads_beside_buckets
    step = resident + (grads if separate_grads else 0) + \
        2 * F32 * max(n.small, default=0) // (1 if lay.kind == "replicated" else W)
    if backend == "deepspeed" and lay.kind == "replicated":
        step += c * P  # ZeRO-0 all-reduces the gradients flattened into one buffer after backward
    elif lay.kind == "zero12" and not lay.offload:
        step += F32 * P // W  # ZeRO-1/2's step flattens this rank's gradient partition (fp32) first
    if step > peak:
        peak, where = step, -1
    batch = a.batch
    if where == -1:
        activation_at_peak = 0
    elif where == blocks:
        activation_at_peak = sum(per_block) + head
    else:
        activation_at_peak = sum(per_block[:where]) + (0 if checkpointed[where] else a.full[where])
    return Estimate(
        params=int(params), params_gathered=int(gathered), grads=int(grads), optimizer=int(optimizer),
        activation_bytes=int(activation_at_peak), total_bytes=int(peak + batch),
        host_bytes=int(host),
        terms={"resident_model_states": int(resident), "activation_per_block": int(max(a.full, default=0)),
               "checkpointed_block_input": int(max(a.kept, default=0)), "backward_transient": int(transient),
               "head_activations": int(head),
               # the block count: at the start of backward, in the head; -1: in the optimizer step
               "peak_in_backward_of_block": where},
        assumptions=assumptions)


def estimate_run(run) -> Estimate:
    """The estimate for a run record (a row of analysis.load_runs): from its config.json alone."""
    return estimate_from_record(json.loads((Path(run["run_dir"]) / "config.json").read_text()))


def estimate_from_record(config: dict) -> Estimate:
    """The estimate for a config.json (or `train.py --dry_run`'s output): the model, the run's
    precision and the backend's recorded plan, never the config files named in it, which may have
    changed since (or be another machine's). Records written before the plan was recorded keep
    the same information in `backend.options` (FSDP) and `backend.config` (DeepSpeed)."""
    from backends import fsdp_config

    run = config["run"]
    if config["model"].get("name", "gptlite") == "gptlite":
        model = GPTConfig(**{k: config["model"][k] for k in GPTConfig.field_names()})
    else:  # any other model: traced once from the run's own flags
        from analysis.traced_model import traced_for_run

        model = traced_for_run(run)
    backend = run["backend"]
    plan = config.get("plan")
    described = config.get("backend") or {}
    options = ds = None
    if backend in ("fsdp", "fsdp2"):
        options = fsdp_config.from_record(plan if plan is not None else described["options"])
    elif backend == "deepspeed":
        ds = plan["config"] if plan is not None else described["config"]
    device = "cuda" if str((config.get("environment") or {}).get("device", "cpu")).startswith("cuda") else "cpu"
    return estimate(model, backend, int(config["world_size"]), int(run["micro_batch"]), run["precision"],
                    int(run.get("ckpt_interval") or 0), device, options, ds)


def main(argv=None) -> int:
    from training.cli import OneLineParser

    p = OneLineParser(prog="python -m analysis.estimate", description=__doc__.splitlines()[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[2:5]))
    p.add_argument("--preset", default="paper", choices=tuple(PRESETS))
    p.add_argument("--model", default="gptlite",
                   help="gptlite (by formula), or any train.py --model (traced once on fake tensors)")
    p.add_argument("--model_args", default=None, help="the model's settings, as train.py's --model_args")
    p.add_argument("--block_size", type=int, default=None, help="context length of hf: text models "
                   "(default: the preset's)")
    p.add_argument("--world", type=int, default=1, help="ranks")
    p.add_argument("--ranks_per_node", type=int, default=None,
                   help="ranks (GPUs) per node: HYBRID_SHARD's default shard group (default: --world)")
    p.add_argument("--backend", default=None, help="single, ddp, fsdp, fsdp2 (inferred from a config file)")
    p.add_argument("--config", default=None, help="DeepSpeed JSON (ds_configs/*.json)")
    p.add_argument("--fsdp_config", default=None, help="FSDP YAML (fsdp_configs/*.yaml)")
    p.add_argument("--ckpt_interval", type=int, default=0)
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--attention", default="naive", choices=("naive", "sdpa"))
    p.add_argument("--dropout", type=float, default=None, help="default: the preset's")
    p.add_argument("--vocab_size", type=int, default=65)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda: dropout masks are bool; cpu: they take the activations' dtype")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    from backends import deepspeed_config, fsdp_config

    try:
        if args.config and args.fsdp_config:
            raise ConfigError("--config (DeepSpeed) and --fsdp_config exclude each other: one backend at a time")
        if args.model == "gptlite":
            cfg = preset(args.preset, attention=args.attention, dropout=args.dropout, vocab_size=args.vocab_size)
        else:
            import models
            from analysis.traced_model import TracedModel
            from core.config import RunConfig

            run = RunConfig(model=args.model, model_args=args.model_args, preset=args.preset,
                            block_size=args.block_size, dropout=args.dropout)
            cfg = TracedModel.of(models.load(run.model_request()))
        options = fsdp_config.load(args.fsdp_config) if args.fsdp_config else None
        ds = deepspeed_config.read(args.config) if args.config else None
        backend = "deepspeed" if ds else (options.backend if options else args.backend or "single")
        if args.backend and args.backend != backend:
            raise ConfigError(f"--backend {args.backend} does not match the config file's backend {backend}")
        est = estimate(cfg, backend, args.world, args.micro_batch, args.precision, args.ckpt_interval, args.device,
                       options, ds, args.ranks_per_node)
    except (ConfigError, DataError) as e:
        print(f"estimate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(est), "model_states_bytes": est.model_states_bytes}, indent=2))
        return 0
    gib = 2**30
    what = f"{args.preset} preset" if args.model == "gptlite" else args.model
    print(f"{what}, {backend}, {args.world} rank(s), micro-batch {args.micro_batch}, {args.precision}, "
          f"checkpoint interval {args.ckpt_interval}, per rank:")
    for name, value in (("parameters", est.params), ("gathered parameters", est.params_gathered),
                        ("gradients", est.grads), ("optimizer state", est.optimizer),
                        ("model states", est.model_states_bytes), ("activations at the peak", est.activation_bytes),
                        ("peak (total)", est.total_bytes)):
        print(f"  {name:<26}{value / gib:10.3f} GiB")
    if est.host_bytes:
        print(f"  {'of the states, in host memory':<26}{est.host_bytes / gib:10.3f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
