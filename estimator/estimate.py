"""Memory per rank for a configuration, before running it: model states and activations.

    python -m analysis.estimate_cli --world 8 --preset paper --deepspeed_config ds_configs/z3.json --device cuda
    python -m analysis.estimate_cli --world 2 --fsdp_config fsdp_configs/shard_grad_op.yaml --ckpt_interval 1 --json
    python -m analysis.estimate_cli --world 8 --model hf:llama --model_args num_hidden_layers=4,hidden_size=256 \\
        --deepspeed_config ds_configs/z3.json --micro_batch 4 --device cuda

DeepSpeed's estimators cover model states only; the peak of a training step is usually set by
activations, and otherwise by the buffers a backend reduces gradients through. This estimator adds
both: the tensors the forward keeps for backward (GPT-lite's by formula, counted op by op and
checked against autograd's saved tensors; any other model's traced once, estimator/traced_model.py),
and the live bytes at each moment of the step that can set its peak, the largest of which is the
estimate (`peak_moment` names it):
- the start of backward (every activation kept, the head's, the output's gradient);
- the backward of each block (its activations, recomputed if checkpointed, and their gradients;
  a traced model's, the most its traced backward holds at once; FULL_SHARD's unit gathered again
  with the next one prefetched);
- a traced model's backward of the layers before the blocks (what they keep and their backward's
  buffers, every block's activations gone: a convolutional front end's peak, which checkpointing
  the blocks does not lower);
- the end of each FSDP unit's backward (its gradients on their way into the reduce-scatter), and,
  on gloo, each FSDP2 unit's forward all-gather;
- ZeRO-3's end of forward (every parameter gathered, the last gathers in flight; on one rank a
  parameter's data is its partition: nothing gathered), and its coalesced reduce-scatter of the
  gradient bucket (the flattened bucket and this rank's part copied out);
- ZeRO-1/2's reduction of each block's gradients into this rank's partition, and the gradient
  reduction after backward (ZeRO-0's flattened all-reduce buffer; ZeRO-1/2's two buckets, the
  flattened bucket and the fp32 gradient partition);
- the optimizer step (every state, the gradients, the update's temporaries), and ZeRO-1/2's
  all-gather of the updated parameters after it.
On CPU the collectives run on gloo, which copies through buffers of its own: an all-gather's flat
output, a reduce-scatter's input (ProcessGroupGloo); those copies are counted there.

Model states (per rank, fp32 master weights everywhere; c = bytes of the compute dtype):
- replicated (single, ddp, FSDP NO_SHARD, ZeRO-0): params 4P, grads 4P, Adam state 8P;
- FSDP FULL_SHARD / HYBRID_SHARD, FSDP2 resharding (on a mesh: its shard group): everything / shard
  group, plus (FSDP1) the root unit gathered after forward; FSDP2 resharding to a group of R ranks:
  plus c P / R kept from forward to backward; SHARD_GRAD_OP / _HYBRID_SHARD_ZERO2 / FSDP2 without
  resharding: all parameters gathered;
- ZeRO-1/2: parameters whole (c P), gradients partitioned, fp32 master + Adam state partitioned
  (12 P / world); ZeRO-3: parameters partitioned, gathered from forward until backward while
  stage3_max_live_parameters allows (DeepSpeed's 1e9 default: the whole model here); ZeRO++'s hpZ
  keeps a second copy, c P / zero_hpz_partition_size.
Offloaded states count the same bytes, in host memory (`host_bytes`).

Activations per block (B micro-batch, T block size, C width, H heads, e bytes per activation,
m bytes per dropout mask: e on CPU, 1 on CUDA): 12 BTC e (block input, two LayerNorm outputs,
q, k, v, attention output, FFN input and the 4C-wide ReLU output) + 16 BT (LayerNorm statistics);
naive attention, or sdpa with dropout on CPU (its math kernel): + B H T^2 e (softmax), + T^2 (the
causal mask, naive only); with dropout: + 2 BTC m + B H T^2 (e + m). A checkpointed block keeps its input
(BTC e) and recomputes the rest in backward; a selective checkpoint (--ckpt_policy selective) keeps its
input and the outputs of the operators it saves (matmuls with a weight, convolutions, fused attention
by default), counted per block and operator on the traced forward of any model, GPT-lite's included
(tests/unit/test_estimate.py holds each policy's per-block bytes within 10% of what the real model keeps).

Mixed precision: 16-bit activations where the backend computes in 16 bits (FSDP and DeepSpeed
cast the module); under autocast (single, ddp) the residual stream and LayerNorm outputs stay fp32
and q, k, v each save their own 16-bit cast. On CUDA the activations of the head (final LayerNorm,
lm_head, log-softmax) count at the start of backward, and one block's backward with fused
attention holds about 10 B T C elements of gradients at once. Offloaded states are on the host.

Accuracy (tests/unit/test_estimate.py, tests/distributed/test_model_parity.py): model states within 5% and the peak
within 10% of every fp32 configuration of sweeps/cpu_quick.yaml measured on CPU (GPT-lite), and of
the four models of sweeps/models_estimate.yaml (HF GPT-2, HF Llama, HF ResNet-18, a user file)
under the same 15 configurations; within 10% of the allocator's peak for every bf16 run on the
H100 in runs/reference/; under FSDP2 and FSDP1 on CPU too. (Their measured peaks used to vary from
run to run by up to two or three units, ResNet-18 129, 147 or 165 MiB: the memory profile counted
gloo's collective buffers, freed by gloo's worker thread where the profiler does not see a free, as
alive to the step's end. Since 2026-11-29 it ends them at their last use (core/memory_profile.py)
and identical runs measure the same peak; the quick matrix's FSDP runs and the four models'
FSDP2 runs lie within 10%.) The hybrid family at 4 ranks as 2 nodes of 2 (tests/distributed/test_hybrid.py): within
-3.0% and -0.6% of the measured peak. The zoo: docs/estimator.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import backends
from estimator import moments as moments_of
from estimator.activations import (CUDA_KERNEL_BUFFER_OPS, Activations, ckpt_choices,  # noqa: F401 - the API, as before
                                   gptlite_activations, traced_activations)
from estimator.memory_model import Counts, activation_per_block  # noqa: F401 - the API, as before
from estimator.moments import model_states  # noqa: F401 - the API
from estimator.traced_model import traced_for_run
from gptlite.errors import ConfigError
from gptlite.model import GPTConfig


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
    peak_moment: str = ""  # when in the step the peak falls: "backward of block 3", "optimizer step", ...
    assumptions: list[str] = field(default_factory=list)
    # For a checkpointing plan (estimator/checkpointing_plan.py): each moment of the step as (bytes besides the
    # activations kept by the first k blocks, k, name), the batch's bytes, and the activation terms.
    moment_bases: list = field(default_factory=list, repr=False)
    batch_bytes: int = field(default=0, repr=False)
    activations: "Activations | None" = field(default=None, repr=False)
    # What the program's order does not fix, which a measured peak may add to the estimate (FSDP on
    # CPU: one reduce-scatter still in flight on gloo's thread); --ckpt_policy auto plans below it.
    unfixed_bytes: int = 0

    @property
    def model_states_bytes(self) -> int:
        return self.params + self.params_gathered + self.grads + self.optimizer



def _check_sizes(world: int, micro_batch: int, ckpt_interval: int, grad_accum: int) -> None:
    for name, value, minimum in (("world", world, 1), ("micro_batch", micro_batch, 1),
                                 ("ckpt_interval", ckpt_interval, 0), ("grad_accum", grad_accum, 1)):
        if not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name} must be an integer >= {minimum} (got {value!r})")


def estimate(cfg, backend: str, world: int = 1, micro_batch: int = 1, precision: str = "fp32",
             ckpt_interval: int = 0, device: str = "cpu", fsdp_options=None, ds_config: dict | None = None,
             ranks_per_node: int | None = None, grad_accum: int = 1, ckpt_policy: str = "full",
             save_ops=None, ckpt_plan=None, data_bytes: int = 0) -> Estimate:
    """The per-rank memory of one training step of a model under a backend configuration.

    `cfg`: GPT-lite's GPTConfig (activations by formula), or any model traced once
    (estimator/traced_model.TracedModel). `backend`: its registered name; the backend says how it
    holds the model (Backend.memory_layout) from its options, `fsdp_options` or `ds_config` (the one
    its record gives: Backend.estimator_options). Checkpointing: `ckpt_policy` (full, selective,
    keeping the outputs of `save_ops`, default SELECTIVE_SAVE_OPS) for the blocks `ckpt_interval`
    picks, or `ckpt_plan`, one of CKPT_CHOICES per block. `data_bytes`: the tensors the dataset holds
    in the run's device memory (its record's data.held_tensor_bytes; on a CPU run, a user's
    TensorDataset), alive through the whole step and counted as the memory profile counts them (`data`)."""
    _check_sizes(world, micro_batch, ckpt_interval, grad_accum)
    options = fsdp_options if fsdp_options is not None else ds_config
    lay = backends.get_backend(backend).memory_layout(world, precision, options, ranks_per_node)
    traced = not isinstance(cfg, GPTConfig)
    n = cfg.counts if traced else Counts.of(cfg)
    assumptions = ["fp32 master weights and AdamW state (exp_avg, exp_avg_sq) in every backend"]
    if precision != "fp32":
        assumptions.append(f"{precision}: 16-bit activations (an fp32 residual stream under autocast); calibrated "
                           "against the H100 reference runs (runs/reference/)")
    params, gathered, grads, optimizer, persistent = moments_of.model_states(lay, n)
    # Activations and the peak: walk backward from the last block.
    a, choices, _ = moments_of.activations(cfg, traced, lay, micro_batch, precision, device, ckpt_interval, ckpt_policy,
                                 save_ops, ckpt_plan, assumptions)
    s = moments_of.Step(lay, n, a, [a.retained(i, c, save_ops) for i, c in enumerate(choices)],
              [c != "none" for c in choices], grad_accum, device == "cpu", params, gathered, grads, optimizer,
              persistent)
    moments_of.resident(s, device)
    host = (optimizer if s.offloading else 0) + (params if s.params_host else 0) + (grads if s.grads_host else 0)
    # The moments of a step whose live bytes can set its peak: (bytes, moment, activations then, blocks below).
    moments = (moments_of.backward_start_moments(s) + moments_of.block_moments(s)
               + moments_of.after_blocks_moments(s))
    peak, moment, activation_at_peak, _ = max(moments, key=lambda m: m[0])
    # Each moment as the bytes besides the kept activations of the blocks below it, for planning.
    bases = [(int(b - sum(s.per_block[:k])), k, name) for b, name, _, k in moments]
    # An FSDP reduce-scatter's work held by gloo's worker thread keeps its input and gloo's copy of it
    # for a time that varies from run to run (see Accuracy): two of the largest unit's gradient.
    unfixed = 2 * s.c * max(n.per_block, default=0) if s.fsdp_unit and s.gloo else 0
    blocks = len(a.full)
    return Estimate(
        params=int(params), params_gathered=int(gathered), grads=int(grads), optimizer=int(optimizer),
        activation_bytes=int(activation_at_peak), total_bytes=int(peak + a.batch + data_bytes),
        host_bytes=int(host),
        terms={"resident_model_states": int(s.resident), "activation_per_block": int(max(a.full, default=0)),
               "checkpointed_block_input": int(max(a.kept, default=0)), "backward_transient":
                   int(max((a.own_backward(i) - a.full[i] for i in range(blocks)), default=a.transient) + s.buckets),
               "head_activations": int(a.head), "data": int(data_bytes)},
        peak_moment=moment,
        # The dataset's tensors are alive all step, like the batch: a plan's peak counts both.
        assumptions=assumptions, moment_bases=bases, batch_bytes=int(a.batch + data_bytes), activations=a,
        unfixed_bytes=int(unfixed))


def estimate_run(run) -> Estimate:
    """The estimate for a run record (a row of analysis.load_runs): from its config.json alone."""
    return estimate_from_record(json.loads((Path(run["run_dir"]) / "config.json").read_text()))


def estimate_from_record(config: dict) -> Estimate:
    """The estimate for a config.json (or `train.py --dry_run`'s output): the model, the run's
    precision and the backend's recorded plan, never the config files named in it, which may have
    changed since (or be another machine's). Records written before the plan was recorded keep
    the same information in `backend.options` (FSDP) and `backend.config` (DeepSpeed)."""
    model, args, kwargs = record_arguments(config)
    return estimate(model, *args, **kwargs)


def record_arguments(config: dict) -> tuple:
    """(model, args, kwargs) of `estimate` for a config.json (estimate_from_record)."""
    run = config["run"]
    done = (config.get("backend") or {}).get("activation_checkpointing") or {}
    if config["model"].get("name", "gptlite") == "gptlite":
        model = GPTConfig(**{k: config["model"][k] for k in GPTConfig.field_names()})
    else:  # any other model: traced once from the run's own flags
        model = traced_for_run(run)
    backend = run["backend"]
    # The backend's own options, from its recorded spec (or the `backend` section of older records).
    options = backends.get_backend(backend).estimator_options(config.get("plan"), config.get("backend") or {})
    device = "cuda" if str((config.get("environment") or {}).get("device", "cpu")).startswith("cuda") else "cpu"
    plan = run.get("ckpt_plan")
    policy = run.get("ckpt_policy") or "full"
    save_ops = done.get("save_ops") or (run["ckpt_save_ops"].split(",") if run.get("ckpt_save_ops") else None)
    return model, (backend, int(config["world_size"]), int(run["micro_batch"]), run["precision"],
                   int(run.get("ckpt_interval") or 0), device, options.get("fsdp_options"),
                   options.get("ds_config")), dict(
        grad_accum=int(run.get("grad_accum") or 1), ckpt_policy=policy if policy != "auto" else "full",
        save_ops=save_ops, ckpt_plan=[c.strip() for c in plan.split(",")] if plan else None,
        # A record from before ranks_per_node was kept: HYBRID_SHARD's default group is then the world's.
        ranks_per_node=config.get("ranks_per_node"),
        data_bytes=int(((config.get("data") or {}).get("held_tensor_bytes") or {}).get(device, 0)))
