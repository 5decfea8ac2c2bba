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
(tests/test_estimate.py holds each policy's per-block bytes within 10% of what the real model keeps).

Mixed precision: 16-bit activations where the backend computes in 16 bits (FSDP and DeepSpeed
cast the module); under autocast (single, ddp) the residual stream and LayerNorm outputs stay fp32
and q, k, v each save their own 16-bit cast. On CUDA the activations of the head (final LayerNorm,
lm_head, log-softmax) count at the start of backward, and one block's backward with fused
attention holds about 10 B T C elements of gradients at once. Offloaded states are on the host.

Accuracy (tests/test_estimate.py, tests/test_model_parity.py): model states within 5% and the peak
within 10% of every fp32 configuration of sweeps/cpu_quick.yaml measured on CPU (GPT-lite), and of
the four models of sweeps/models_estimate.yaml (HF GPT-2, HF Llama, HF ResNet-18, a user file)
under the same 15 configurations; within 10% of the allocator's peak for every bf16 run on the
H100 in runs/reference/; under FSDP2 and FSDP1 on CPU too. (Their measured peaks used to vary from
run to run by up to two or three units, ResNet-18 129, 147 or 165 MiB: the memory profile counted
gloo's collective buffers, freed by gloo's worker thread where the profiler does not see a free, as
alive to the step's end. Since 2026-11-29 it ends them at their last use (core/memory_profile.py)
and identical runs measure the same peak; the quick matrix's FSDP runs and the four models'
FSDP2 runs lie within 10%.) The hybrid family at 4 ranks as 2 nodes of 2 (tests/test_hybrid.py): within
-3.0% and -0.6% of the measured peak. The zoo: docs/estimator.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from estimator.memory_model import (DS_MAX_LIVE, DS_PERSISTENCE, DS_PREFETCH_BUCKET, DS_REDUCE_BUCKET, F32, Counts,
                                   activation_per_block, backward_transient, head_activations, layout_for)
from backends.activation_checkpointing import SELECTIVE_SAVE_OPS
from core.config import CKPT_CHOICES, interval_choices
from gptlite.data import DataError
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
    # For a checkpointing plan (estimator/ckpt_plan.py): each moment of the step as (bytes besides the
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
    ops: list[dict] | None = None  # per block, the bytes of each aten operator's new outputs (traced)
    head_transient: int = 0  # the largest short-lived buffers of the head's backward (traced)
    # Traced backward (estimator/traced_model.py): the most each block's backward holds at once, of
    # its forward's tensors and the backward's; the head's, of the head's and the
    # backward's. None where the trace could not run backward: the rule above instead.
    backward: list[int] | None = None
    head_backward: int | None = None
    # The same for the layers before the blocks (a convolutional front end, an embedding): what they
    # keep, still alive when backward reaches them, and their backward's buffers. None where not traced.
    front_backward: int | None = None

    def own_backward(self, i: int) -> int:
        """The most block i's backward holds at once, of its activations and its backward's buffers."""
        return self.backward[i] if self.backward else self.full[i] + self.transient

    def own_head_backward(self) -> int | None:
        """The most the head's backward holds at once, of what it keeps and its backward's buffers
        (traced models; by rule, what it keeps and two of its largest saved tensor where the backward
        was not traced); None for a model by formula (its head's backward is the start of backward's)."""
        if self.head_backward is not None:
            return self.head_backward
        return self.head + self.head_transient if self.head_transient else None

    def retained(self, i: int, choice: str, save_ops=None) -> int:
        """What block i keeps for backward under `choice` (CKPT_CHOICES): everything it saves (none),
        its input (full), or its input and the outputs of the operators a selective checkpoint keeps."""
        if choice == "none":
            return self.full[i]
        if choice == "full":
            return self.kept[i]
        if choice == "selective":
            if self.ops is None:
                raise ValueError("selective checkpointing needs the traced operator outputs (Activations.ops)")
            keep = set(save_ops if save_ops is not None else SELECTIVE_SAVE_OPS)
            return self.kept[i] + sum(b for op, b in self.ops[i].items() if op in keep)
        raise ValueError(f"unknown checkpointing choice {choice!r} ({', '.join(CKPT_CHOICES)})")


def gptlite_activations(cfg: GPTConfig, micro_batch: int, act: int, mask: int, device: str, autocast: bool,
                        residual: int) -> Activations:
    """GPT-lite's, by formula (estimator/memory_model.py)."""
    full = activation_per_block(cfg, micro_batch, act, mask, device, autocast=autocast)
    return Activations(
        full=[full] * cfg.n_layer, kept=[micro_batch * cfg.block_size * cfg.n_embd * residual] * cfg.n_layer,
        transient=backward_transient(cfg, micro_batch, act, mask, device, autocast, residual),
        head=head_activations(cfg, micro_batch, act, residual), before=0,
        logits_grad=micro_batch * cfg.block_size * cfg.vocab_size * F32,
        batch=2 * micro_batch * cfg.block_size * 8)  # token ids of inputs and targets


# The operators whose kernels allocate buffers of their own in backward that the trace does not count
# where they run (a convolution's it does: estimator/traced_model.kernel_buffers), by the names the
# traced forward records: aten overload packets of the CPU's kernels, which the trace runs on fake
# tensors. On CUDA, fused attention (traced as the CPU's): FlashAttention's backward accumulates the
# query's gradient in an fp32 buffer of its own (dq_accum, with the softmax's row sums); a block that
# ran it is allowed one of its largest saved tensor. Not measured on a traced model on a GPU yet
# (benchmarks/gpu_zoo.sh asks it); the CPU's fused attention, measured, allocates nothing more (the
# zoo's llama, vit and mixtral on one process).
CUDA_KERNEL_BUFFER_OPS = frozenset({"_scaled_dot_product_flash_attention_for_cpu"})


def traced_activations(traced, micro_batch: int, act: int, device: str = "cpu") -> Activations:
    """Any model's, traced (estimator/traced_model.py), scaled to 16 bits where the run computes in 16,
    for a run on `device` (its kernels' own buffers: traced_model.kernel_buffers, CUDA_KERNEL_BUFFER_OPS)."""
    t = traced.at(micro_batch)

    def scale(value: int) -> int:
        return value * act // F32

    transient = max((2 * big + inp for big, inp in zip(t["largest"], t["kept"])), default=0)
    # The traced backward sees the tensors operators return, not the buffers kernels allocate inside
    # (fake tensors have no memory to allocate). A convolution's do (oneDNN's input and gradients in
    # its own layout): the trace counts them at the convolution's backward, from its shapes
    # (traced_model.kernel_buffers; until 2026-12-06 a block that ran one was allowed one of its largest
    # saved tensor instead, and the layers before the blocks nothing: the zoo's speech encoder, its
    # peak in its feature extractor's backward, was up to 19% under with every block checkpointed).
    # Matmuls, elementwise operators and the CPU's fused attention allocate nothing but their outputs
    # (an allowance on every block put frozen_tied's one-process runs 13% over, docs/estimator.md).
    # Measured (2026-12-06) against the zoo's 276 runs of runs/reference/cpu-2core-zoo-peaks,
    # -peaks-deepspeed-world1 and -peaks-single: within -7.7% and +5.4% (median 1.0%; -7.7% and +9.5%
    # with the convolutions' allowance), and the speech encoder's 32 (tests/speech_ctc_peaks.json)
    # within -9.9% and +4.3%. The head keeps its allowance: the zoo's GRU, all its activations the
    # head's, runs its recurrent kernel there (4-9% under without it, one process).
    buffered = CUDA_KERNEL_BUFFER_OPS if device.startswith("cuda") else frozenset()
    backward = head_backward = front_backward = None
    if t.get("backward_peak") is not None:
        backward = [scale(v + (big if buffered & ops.keys() else 0))
                    for v, big, ops in zip(t["backward_peak"], t["largest"], t["ops"])]
        head_backward = scale(t["head_backward_peak"] + t["largest_after"])
    if t.get("front_backward_peak") is not None:
        front_backward = scale(t["front_backward_peak"])
    return Activations(full=[scale(v) for v in t["full"]], kept=[scale(v) for v in t["kept"]],
                       transient=scale(transient), head=scale(t["after"]), before=scale(t["before"]),
                       logits_grad=t["output"], batch=t["batch"], head_transient=scale(2 * t["largest_after"]),
                       ops=[{op: scale(b) for op, b in block.items()} for block in t["ops"]],
                       backward=backward, head_backward=head_backward, front_backward=front_backward)


def ckpt_choices(blocks: int, interval: int, policy: str = "full", plan=None) -> list[str]:
    """What each block does under checkpointing (CKPT_CHOICES): `plan` (one choice per block) where
    given, else `policy` for the blocks `interval` picks (i % interval == 0) and none elsewhere."""
    if plan is not None:
        plan = list(plan)
        if len(plan) != blocks or any(c not in CKPT_CHOICES for c in plan):
            raise ConfigError(f"a checkpointing plan has one of {', '.join(CKPT_CHOICES)} per block ({blocks} blocks; "
                              f"got {plan})")
        return plan
    if policy not in ("full", "selective"):
        raise ConfigError(f"ckpt_policy must be full or selective here (got {policy!r})")
    return interval_choices(blocks, interval, policy)


def estimate(cfg, backend: str, world: int = 1, micro_batch: int = 1, precision: str = "fp32",
             ckpt_interval: int = 0, device: str = "cpu", fsdp_options=None, ds_config: dict | None = None,
             ranks_per_node: int | None = None, grad_accum: int = 1, ckpt_policy: str = "full",
             save_ops=None, ckpt_plan=None, data_bytes: int = 0) -> Estimate:
    """The per-rank memory of one training step of a model under a backend configuration.

    `cfg`: GPT-lite's GPTConfig (activations by formula), or any model traced once
    (estimator/traced_model.TracedModel). Checkpointing: `ckpt_policy` (full, selective, keeping the
    outputs of `save_ops`, default SELECTIVE_SAVE_OPS) for the blocks `ckpt_interval` picks, or
    `ckpt_plan`, one of CKPT_CHOICES per block. `data_bytes`: the tensors the dataset holds in the
    run's device memory (its record's data.held_tensor_bytes; on a CPU run, a user's TensorDataset),
    alive through the whole step and counted as the memory profile counts them (`data`)."""
    for name, value, minimum in (("world", world, 1), ("micro_batch", micro_batch, 1),
                                 ("ckpt_interval", ckpt_interval, 0), ("grad_accum", grad_accum, 1)):
        if not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name} must be an integer >= {minimum} (got {value!r})")
    lay = layout_for(backend, world, precision, fsdp_options, ds_config, ranks_per_node)
    traced = not isinstance(cfg, GPTConfig)
    n = cfg.counts if traced else Counts.of(cfg)
    P, W, c = n.total, lay.shards, lay.compute_bytes
    # Gradients and optimizer states are the trainable parameters' (Pt): a frozen parameter has neither.
    Pt = n.trainable
    assumptions = ["fp32 master weights and AdamW state (exp_avg, exp_avg_sq) in every backend"]
    if precision != "fp32":
        assumptions.append(f"{precision}: 16-bit activations (an fp32 residual stream under autocast); calibrated "
                           "against the H100 reference runs (runs/reference/)")

    # Model states, as the run records count them (model_state_bytes).
    if lay.kind == "replicated" and backend == "deepspeed" and c != F32:
        # ZeRO-0 in 16 bits: the module in 16 bits, the fp32 master copy with the optimizer.
        params, gathered, grads, optimizer = c * P, 0, c * Pt, 12 * Pt
    elif lay.kind == "replicated":
        params, gathered, grads, optimizer = F32 * P, 0, F32 * Pt, 8 * Pt
    elif lay.kind == "full_shard":
        params, grads, optimizer = F32 * P // W, F32 * Pt // W, 8 * Pt // W
        gathered = c * n.root if lay.fsdp1_root_gathered else 0
        if lay.post_forward:  # FSDP2 resharded to a smaller group: 1/post of each unit from forward to backward
            gathered = c * P // lay.post_forward
    elif lay.kind == "shard_grad_op":
        params, gathered, grads, optimizer = F32 * P // W, c * P, F32 * Pt // W, 8 * Pt // W
    elif lay.kind == "zero12":
        params, gathered, grads, optimizer = c * P, 0, c * Pt // W, 12 * Pt // W
    persistent = 0  # ZeRO-3: the small parameters every rank keeps whole
    if lay.kind == "zero3":
        threshold = float(lay.ds.get("stage3_param_persistence_threshold", DS_PERSISTENCE))
        persistent = sum(s for s in n.small if s < threshold)
        params = c * ((P - persistent) // W + persistent)
        gathered = c * min(P - persistent, int(float(lay.ds.get("stage3_max_live_parameters", DS_MAX_LIVE))))
        grads, optimizer = c * Pt // W, 12 * Pt // W
        if (lay.ds.get("offload_optimizer") or {}).get("device", "none") != "none":
            grads += F32 * Pt // W  # the fp32 gradient partition the CPU optimizer steps with
    # Adam's step counters, one per trainable tensor
    optimizer += F32 * (n.tensors - n.frozen_tensors) // (W if lay.kind != "replicated" else 1)

    # Activations and the peak: walk backward from the last block.
    on_cpu = device == "cpu"
    act = 2 if precision in ("bf16", "fp16") else F32
    # single and ddp run mixed precision as autocast over fp32 weights (backends/torch_backend.py);
    # FSDP and DeepSpeed cast the module's parameters, so every activation is 16-bit there.
    autocast = act != F32 and backend in ("single", "ddp", "accelerate")
    residual = F32 if autocast else act
    mask = act if on_cpu else 1
    a = traced_activations(cfg, micro_batch, act, device) if traced else \
        gptlite_activations(cfg, micro_batch, act, mask, device, autocast, residual)
    if traced:
        assumptions.append("activations traced once in fp32 on fake tensors (estimator/traced_model.py)"
                           + (", scaled to 16 bits" if act != F32 else ""))
    blocks = len(a.full)
    head = a.head
    choices = ckpt_choices(blocks, ckpt_interval, ckpt_policy, ckpt_plan)
    checkpointed = [c != "none" for c in choices]
    if "selective" in choices and a.ops is None:  # GPT-lite by formula: its operators' outputs traced
        from estimator.traced_model import TracedModel

        a.ops = traced_activations(TracedModel.of_gptlite(cfg), micro_batch, act).ops
    if "selective" in choices:
        assumptions.append("selective checkpointing keeps a block's input and the outputs of "
                           + ", ".join(save_ops if save_ops is not None else SELECTIVE_SAVE_OPS))
    per_block = [a.retained(i, c, save_ops) for i, c in enumerate(choices)]

    # On an accelerator, offloaded states live in host memory, not in the device's: the optimizer
    # state always; the parameter shards under FSDP's CPU offload and ZeRO-Infinity's offload_param;
    # ZeRO-3's gradient partitions under ZeRO-Offload.
    offloading = lay.offload and device != "cpu"
    params_host = offloading and (backend in ("fsdp", "fsdp2")
                                  or (lay.ds.get("offload_param") or {}).get("device", "none") != "none")
    grads_host = offloading and lay.kind == "zero3"
    host = (optimizer if offloading else 0) + (params if params_host else 0) + (grads if grads_host else 0)
    # CPU runs communicate through gloo, whose all-gather fills a flat buffer of its output's size
    # and copies out of it, and whose reduce-scatter copies its input first (ProcessGroupGloo).
    gloo = on_cpu
    largest = max(n.small, default=0)  # the largest parameter tensor
    units = n.per_block
    # What of each block and of the root makes gradients; the head's part of them at most the root's.
    grad_units, grad_root = n.trainable_per_block, n.trainable_root
    grad_head = min(n.head, grad_root)
    bucket = int(float(lay.ds.get("reduce_bucket_size", DS_REDUCE_BUCKET)))

    # What lives through the whole step.
    resident = (0 if params_host else params) + (0 if offloading else optimizer)
    # ZeRO-3 on one rank gathers nothing: a parameter's data is its partition, aliased (DeepSpeed's
    # NoGatherHandle), though the record counts it as gathered too (model_state_bytes); unless the
    # partition lives on the host (ZeRO-Infinity's offload_param on a GPU): copied to the device.
    alone = lay.kind == "zero3" and W == 1 and not params_host
    if lay.kind == "shard_grad_op" or (lay.kind == "zero3" and not alone) or lay.fsdp1_root_gathered \
            or lay.post_forward:
        resident += gathered
    if lay.hpz > 1:  # ZeRO++ hpZ: the secondary partition, each parameter's 1/hpz, kept beside the primary
        resident += c * ((P - persistent) // lay.hpz)
    if lay.ddp_bucket:
        resident += grads
    if lay.kind == "zero3":
        resident += 0 if grads_host else grads
        # The gradient bucket is allocated whole when contiguous_gradients is on, however small the model.
        resident += c * (bucket if lay.ds.get("contiguous_gradients", True) else min(P, bucket))
    if lay.kind == "zero12" and lay.offload:
        if on_cpu:
            # On a CPU-only machine the host is the device: ZeRO-Offload's fp32 gradient partition,
            # which the CPU optimizer steps with, and its 16-bit copy of the updated partition.
            # (Its two largest-parameter gradient buffers are allocated too, but no op touches them
            # without gradient accumulation, so the CPU measurement cannot see them.)
            resident += F32 * Pt // W + c * Pt // W
        else:
            resident += c * largest  # the device's buffer for one parameter's gradient on its way out
    resident += a.before  # what the forward kept before the first block lives through backward
    # ZeRO-1/2's two gradient buckets, from the first gradient of backward on.
    buckets = 2 * c * bucket if lay.kind == "zero12" else 0

    # With gradient accumulation, what the micro-batches before the last leave for the last one's
    # backward. DDP's gradients are views into its buckets only once a synchronized backward has put
    # them there (gradient_as_bucket_view): under no_sync the micro-batches before the last make
    # them apart from the buckets, and the last one's backward copies them in one by one. ZeRO-2
    # copies each reduced gradient into this rank's partition (grads_in_partition), a new one each
    # micro-batch: the previous micro-batches' stays alive as the accumulator (all_grad_tensors)
    # until the last one's backward ends. (Measured: HF Llama, 2.7M parameters, 2 ranks, micro-batch
    # 4 x 2, fp32: DDP's records 10 MB above the estimate without this, one fp32 gradient; ZeRO-2's
    # 6 to 10 MB, against its 5.4 MB partition. ZeRO-1 reduces only at the last micro-batch, its
    # gradients accumulating whole in between: below.) On one rank every parameter lies whole in the
    # partition, its gradient a view of it that the next micro-batch adds into: nothing carried (the zoo's one-rank records: ZeRO-2's peaks equal
    # ZeRO-1's within 3% at accumulation 2 to 16, runs/reference/cpu-2core-zoo-deepspeed-world1).
    unsynced = grad_accum > 1 and lay.ddp_bucket and not lay.grads_beside_buckets
    stage = int(lay.ds.get("stage", 0))
    carried = c * Pt // W if (grad_accum > 1 and lay.kind == "zero12" and not lay.offload and W > 1
                             and stage == 2) else 0
    if grad_accum > 1 and lay.kind == "zero12" and not lay.offload and W > 1 and stage == 1:
        # ZeRO-1 reduces at the last micro-batch only: the gradients accumulate whole in between
        # (measured on the zoo, 2 ranks, micro-batch 4 x 2: the records' gradients 0.98-1.0 of the
        # model's; without them GPT-lite's and the mixture of experts' runs were 8.8% and 9.2% under,
        # 10.7% once a block's traced backward held its input, runs/reference/cpu-2core-zoo-peaks).
        carried = c * Pt
    fsdp_unit = lay.kind in ("full_shard", "shard_grad_op") and backend in ("fsdp", "fsdp2")
    # Where gradients are not held in buckets or partitions allocated up front, they grow as
    # backward goes: the head's first, then block by block (sharded under FSDP).
    growing_grads = not (lay.ddp_bucket or lay.kind in ("zero12", "zero3"))

    # With gradient accumulation in one process, the micro-batches after the first run backward
    # with every gradient already made, from its start (the head's backward too), and each new
    # gradient is made whole before it is added in: measured (HF ResNet-18, single, 2 micro-batches)
    # the backward then holds all gradients and the new gradient of the 512x512x3x3 weight (with
    # oneDNN's convolutions, also its copy in oneDNN's layout: not counted, it depends on the CPU's
    # kernel). A traced backward holds the new gradients already (an operator's output, alive until
    # it is added in): counted there, not again. (The zoo's one-process runs, world 1, micro-batches
    # 2 x 8 to 8 x 2: the GRU, all its activations the head's, was 8-15% under without the gradients
    # at its head's backward; frozen_tied up to 13% over and HF GPT-2 and the user file 1-2 points
    # nearer with the new gradient counted once.)
    accumulated = grad_accum > 1 and growing_grads and lay.kind == "replicated"
    # Sharded (FSDP), the micro-batches before the last run under no_sync (FSDP2's
    # set_requires_gradient_sync(False)): each unit keeps its gradient whole, unreduced, until the
    # last micro-batch's backward reduce-scatters it into its shard and frees it. So that backward
    # starts with every gradient whole, and in block i holds the whole gradients of the root (reduced
    # when backward ends) and of the blocks not yet reduced (i and below), the shards of those above.
    # (Measured on the zoo, 2 ranks, micro-batch 4 x 2: counting shards alone put FSDP2 13-22% and
    # FSDP1 up to 16% under the measured peak: runs/reference at b423e114, docs/results/zoo_accuracy_2026-12-05.md.)
    accumulated_shards = grad_accum > 1 and growing_grads and lay.kind in ("full_shard", "shard_grad_op")
    # The moments of a step whose live bytes can set its peak: (bytes, moment, activations then).
    moments = []
    # Backward starts in the head: every block's activations and the head's are alive.
    every_grad = unsynced or accumulated_shards or accumulated  # made whole before this backward
    kept_then = resident + carried + (F32 * Pt if every_grad else 0) + sum(per_block)
    moments.append((kept_then + head + a.logits_grad, "start of backward", sum(per_block) + head, blocks))
    own_head = a.own_head_backward()
    if own_head is not None:
        # The head's own backward (traced models), beside every block's activations. It sets the peak
        # of a model without blocks (the zoo's GRU: its DDP peaks were measured 8-12% above the start
        # of backward).
        moments.append((kept_then + own_head, "backward of the head", sum(per_block) + head, blocks))
    if lay.kind == "zero3" and gloo and not alone:
        # The end of forward: everything gathered, and the last gathers still in flight through
        # gloo's buffers: the prefetch (up to stage3_prefetch_bucket_size elements: the whole model
        # of a small one) or at least the module fetched and the next one (a parameter can exceed
        # the bucket).
        prefetch = int(float(lay.ds.get("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET)))
        # DeepSpeed prefetches no more than stage3_max_live_parameters leaves room for
        # (PartitionedParameterCoordinator.fetch_sub_module): 0 of them, no prefetch.
        prefetch = min(prefetch, int(float(lay.ds.get("stage3_max_live_parameters", DS_MAX_LIVE))))
        in_flight = c * max(min(P - persistent, prefetch), 2 * largest)
        moments.append((resident + sum(per_block) + in_flight, "end of forward", sum(per_block), blocks))

    def grads_so_far(i: int, part: int) -> int:
        """The gradients made when backward is in block i: the head's, the blocks above, `part` of i's."""
        if accumulated:
            return F32 * (Pt + (0 if a.backward else largest))
        if accumulated_shards:
            return F32 * (grad_root + sum(grad_units[:i + 1]) + part + sum(grad_units[i + 1:]) // W)
        if unsynced:  # made apart in the first micro-batch's backward, or not yet copied in the last's;
            made = grad_head + sum(grad_units[i + 1:]) + part  # every one of them in a micro-batch between
            return F32 * (Pt if grad_accum > 2 else max(made, Pt - made))
        return F32 * (grad_head + sum(grad_units[i + 1:]) + part) // W if growing_grads else 0

    for i in reversed(range(blocks)):
        # FULL_SHARD gathers the unit again for its backward and prefetches the next one's.
        regathered = c * (units[i] + (units[i - 1] if i else 0)) if lay.kind == "full_shard" else 0
        # Block i holds all its activations (kept, or recomputed if it is checkpointed) while its
        # backward runs; the blocks below still hold what they kept.
        below = sum(per_block[:i])
        # FSDP2 keeps the reduce-scatter input of the unit above until this unit reduces
        # (reduce_scatter_max_input_buffers, 1 by default).
        held = c * units[i + 1] if fsdp_unit and backend == "fsdp2" and i + 1 < blocks else 0
        moments.append((resident + carried + grads_so_far(i, grad_units[i] // 3) + below + a.own_backward(i)
                        + buckets + regathered + held, f"backward of block {i}",
                        below + (0 if checkpointed[i] else a.full[i]), i))
        if fsdp_unit:
            # The end of the unit's backward, its activations gone: two unit-sized buffers of its
            # gradients at a time. FSDP1: op by op, then flattened (FlatParameter), then the flat
            # gradient and gloo's copy of it for the reduce-scatter, beside the unit's new gradient
            # shard. FSDP2: the gradients and the reduce-scatter's input they are copied into, before
            # it allocates the shard. A unit that stays gathered is freed here. (On gloo the
            # finished reduce-scatter's work, held by gloo's worker thread, may keep its input and
            # gloo's copy a while longer: not counted; the memory profile does not either, see
            # Accuracy. unfixed_bytes below keeps room for them where a plan is made.)
            shards = grads_so_far(i, grad_units[i] if backend == "fsdp" else 0)
            freed = c * units[i] if lay.kind == "shard_grad_op" else 0
            moments.append((resident + shards + below + regathered + 2 * c * units[i] - freed,
                            f"gradient reduction of block {i}", below, i))
            if backend == "fsdp2" and gloo:
                # Its forward, on gloo: the unit's all-gather output and gloo's flat buffer of the
                # same size, the previous unit's output not yet freed; a unit that stays gathered
                # is counted in `resident` once copied out, so not yet here.
                gathering = c * (2 * units[i] + (units[i - 1] if i else 0))
                not_yet = c * sum(units[i:]) if lay.kind == "shard_grad_op" else 0
                moments.append((resident - not_yet + below + gathering, f"forward of block {i}", below, i))
        elif lay.kind == "zero12":
            # ZeRO-1/2 reduce each gradient as backward makes it, into this rank's gradient
            # partition (allocated at the first; ZeRO-Offload's is the fp32 one counted above): a
            # block's gradients, and their copies on the way (into a bucket, or gloo's for a
            # gradient larger than one), beside the two buckets.
            partition = 0 if lay.offload else c * Pt // W
            moments.append((resident + carried + partition + 2 * c * bucket + below + 2 * c * units[i],
                            f"gradient reduction of block {i}", below, i))
    if a.front_backward is not None:
        # The backward of the layers before the blocks (traced models), every block's activations gone:
        # what those layers kept (counted in `resident` until now) and are still holding, and their
        # backward's buffers. It sets the peak where they keep most (a convolutional front end over a
        # waveform or an image: its first layers run at the input's resolution), with or without
        # checkpointing, which does not touch them. Every gradient is made by then, theirs (the root's
        # but the head's) as they go (with accumulation under FSDP, the root's are counted whole already).
        # FSDP2 still holds the first block's reduce-scatter input (the root reduces after them).
        partition = c * Pt // W if lay.kind == "zero12" and not lay.offload else 0
        held = c * units[0] if fsdp_unit and backend == "fsdp2" and blocks else 0
        front_grads = grads_so_far(-1, 0 if accumulated_shards else grad_root - grad_head)
        moments.append((resident - a.before + carried + partition + front_grads + a.front_backward + buckets + held,
                        "backward of the layers before the blocks", 0, 0))
    # After backward, the gradients reduced: ZeRO-0 all-reduces them flattened into one buffer;
    # ZeRO-1/2 through two buckets, flattening each for the all-reduce, then copies this rank's
    # partition out in fp32 (kept on the host under ZeRO-Offload: counted above).
    if backend == "deepspeed" and lay.kind == "replicated":
        moments.append((resident + grads + c * Pt, "gradient reduction", 0, 0))
    elif lay.kind == "zero12":
        moments.append((resident + carried + 2 * c * bucket + c * min(Pt, bucket) + (0 if lay.offload else F32 * Pt // W),
                        "gradient reduction", 0, 0))
    elif lay.kind == "zero3" and not grads_host:
        # ZeRO-3 reduce-scatters its bucket of gradients coalesced: flattened into one buffer, and
        # this rank's part of it copied out (on one rank, the whole of it again). Measured on one
        # rank, 16 micro-batches of 1 (the zoo's mixture of experts): two model-sized fp32 buffers
        # alive at the peak beside every state.
        flat = c * min(Pt, bucket)
        moments.append((resident + flat + flat // W, "gradient reduction", 0, 0))
    # The optimizer step: every resident state with the gradients complete, and the update's
    # temporaries (torch's single-tensor AdamW: about two of the largest tensor's shard). It sets the
    # peak of models whose activations are small beside their states.
    separate_grads = not (lay.ddp_bucket or lay.kind == "zero3" or grads_host) or lay.grads_beside_buckets
    update_temporaries = 2 * F32 * largest // (1 if lay.kind == "replicated" else W)
    step = resident + (grads if separate_grads else 0) + update_temporaries
    if lay.kind == "zero12" and not lay.offload:
        step += F32 * Pt // W  # ZeRO-1/2's step flattens this rank's gradient partition (fp32) first
    moments.append((step, "optimizer step", 0, 0))
    if lay.kind == "zero12" and gloo:
        # ZeRO-1/2 all-gather the updated partitions into the parameters, through gloo's buffer.
        moments.append((resident + c * P, "parameter all-gather", 0, 0))
    peak, moment, activation_at_peak, _ = max(moments, key=lambda m: m[0])
    # Each moment as the bytes besides the kept activations of the blocks below it, for planning.
    bases = [(int(b - sum(per_block[:k])), k, name) for b, name, _, k in moments]
    batch = a.batch
    # An FSDP reduce-scatter's work held by gloo's worker thread keeps its input and gloo's copy of it
    # for a time that varies from run to run (see Accuracy): two of the largest unit's gradient.
    unfixed = 2 * c * max(units, default=0) if fsdp_unit and gloo else 0
    return Estimate(
        params=int(params), params_gathered=int(gathered), grads=int(grads), optimizer=int(optimizer),
        activation_bytes=int(activation_at_peak), total_bytes=int(peak + batch + data_bytes),
        host_bytes=int(host),
        terms={"resident_model_states": int(resident), "activation_per_block": int(max(a.full, default=0)),
               "checkpointed_block_input": int(max(a.kept, default=0)), "backward_transient":
                   int(max((a.own_backward(i) - a.full[i] for i in range(blocks)), default=a.transient) + buckets),
               "head_activations": int(head), "data": int(data_bytes)},
        peak_moment=moment,
        # The dataset's tensors are alive all step, like the batch: a plan's peak counts both.
        assumptions=assumptions, moment_bases=bases, batch_bytes=int(batch + data_bytes), activations=a,
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
    from backends import fsdp_config

    run = config["run"]
    done = (config.get("backend") or {}).get("activation_checkpointing") or {}
    if config["model"].get("name", "gptlite") == "gptlite":
        model = GPTConfig(**{k: config["model"][k] for k in GPTConfig.field_names()})
    else:  # any other model: traced once from the run's own flags
        from estimator.traced_model import traced_for_run

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
    plan = run.get("ckpt_plan")
    policy = run.get("ckpt_policy") or "full"
    save_ops = done.get("save_ops") or (run["ckpt_save_ops"].split(",") if run.get("ckpt_save_ops") else None)
    return model, (backend, int(config["world_size"]), int(run["micro_batch"]), run["precision"],
                   int(run.get("ckpt_interval") or 0), device, options, ds), dict(
        grad_accum=int(run.get("grad_accum") or 1), ckpt_policy=policy if policy != "auto" else "full",
        save_ops=save_ops, ckpt_plan=[c.strip() for c in plan.split(",")] if plan else None,
        # A record from before ranks_per_node was kept: HYBRID_SHARD's default group is then the world's.
        ranks_per_node=config.get("ranks_per_node"),
        data_bytes=int(((config.get("data") or {}).get("held_tensor_bytes") or {}).get(device, 0)))
