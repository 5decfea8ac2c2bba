"""The moments of one training step whose live bytes can set its peak, for the estimator
(estimator/estimate.py, whose docstring gives the formulas and their accuracy): the model states a
backend's layout holds per rank (Backend.memory_layout), what lives through the whole step, and the
bytes at the start of backward, in each block's backward and gradient reduction, before the blocks,
at the gradient reduction after backward and at the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.activation_checkpointing import SELECTIVE_SAVE_OPS
from backends.memory_layout import Layout
from estimator.activations import Activations, ckpt_choices, gptlite_activations, traced_activations
from estimator.memory_model import DS_MAX_LIVE, DS_PERSISTENCE, DS_PREFETCH_BUCKET, DS_REDUCE_BUCKET, F32, Counts
from estimator.traced_model import TracedModel


def model_states(lay: Layout, n: Counts) -> tuple[int, int, int, int, int]:
    """(params, gathered, grads, optimizer, persistent) per rank, as the run records count them
    (model_state_bytes); `persistent`: ZeRO-3's small parameters every rank keeps whole."""
    P, W, c = n.total, lay.shards, lay.compute_bytes
    # Gradients and optimizer states are the trainable parameters' (Pt): a frozen parameter has neither.
    Pt = n.trainable
    if lay.kind == "replicated" and lay.master_in_optimizer and c != F32:
        # ZeRO-0 in 16 bits: the module in 16 bits, the fp32 master copy with the optimizer.
        params, gathered, grads, optimizer = c * P, 0, c * Pt, 12 * Pt
    elif lay.kind == "replicated":
        # ZeroRedundancyOptimizer (optimizer_shards > 1): each rank the Adam state of its share only.
        params, gathered, grads, optimizer = F32 * P, 0, F32 * Pt, 8 * Pt // lay.optimizer_shards
    elif lay.kind == "full_shard":
        params, grads, optimizer = F32 * P // W, F32 * Pt // W, 8 * Pt // W
        gathered = c * n.root if lay.fsdp1_root_gathered else 0
        if lay.post_forward:  # FSDP2 resharded to a smaller group: 1/post of each unit from forward to backward
            gathered = c * P // lay.post_forward
    elif lay.kind == "shard_grad_op":
        params, gathered, grads, optimizer = F32 * P // W, c * P, F32 * Pt // W, 8 * Pt // W
    elif lay.kind == "zero12":
        params, gathered, grads, optimizer = c * P, 0, c * Pt // W, 12 * Pt // W
    persistent = 0
    if lay.kind == "zero3":
        threshold = float(lay.ds.get("stage3_param_persistence_threshold", DS_PERSISTENCE))
        persistent = sum(s for s in n.small if s < threshold)
        params = c * ((P - persistent) // W + persistent)
        gathered = c * min(P - persistent, int(float(lay.ds.get("stage3_max_live_parameters", DS_MAX_LIVE))))
        grads, optimizer = c * Pt // W, 12 * Pt // W
        if (lay.ds.get("offload_optimizer") or {}).get("device", "none") != "none":
            grads += F32 * Pt // W  # the fp32 gradient partition the CPU optimizer steps with
    # Adam's step counters, one per trainable tensor
    optimizer += F32 * (n.tensors - n.frozen_tensors) // (W if lay.kind != "replicated" else lay.optimizer_shards)
    return params, gathered, grads, optimizer, persistent


@dataclass
class Step:
    """What every moment of one training step is built from (estimate's working state)."""

    lay: Layout
    n: Counts
    a: Activations
    per_block: list[int]  # what each block keeps for backward under its checkpointing choice
    checkpointed: list[bool]
    grad_accum: int
    on_cpu: bool
    params: int = 0
    gathered: int = 0
    grads: int = 0
    optimizer: int = 0
    persistent: int = 0
    offloading: bool = False
    params_host: bool = False
    grads_host: bool = False
    resident: int = 0
    buckets: int = 0
    carried: int = 0
    alone: bool = False

    @property
    def P(self) -> int:
        return self.n.total

    @property
    def Pt(self) -> int:
        return self.n.trainable

    @property
    def W(self) -> int:
        return self.lay.shards

    @property
    def c(self) -> int:
        return self.lay.compute_bytes

    @property
    def gloo(self) -> bool:
        # CPU runs communicate through gloo, whose all-gather fills a flat buffer of its output's size
        # and copies out of it, and whose reduce-scatter copies its input first (ProcessGroupGloo).
        return self.on_cpu

    @property
    def largest(self) -> int:
        return max(self.n.small, default=0)  # the largest parameter tensor

    @property
    def bucket(self) -> int:
        return int(float(self.lay.ds.get("reduce_bucket_size", DS_REDUCE_BUCKET)))

    @property
    def fsdp_unit(self) -> bool:
        return self.lay.kind in ("full_shard", "shard_grad_op") and self.lay.sharded_units

    @property
    def growing_grads(self) -> bool:
        # Where gradients are not held in buckets or partitions allocated up front, they grow as
        # backward goes: the head's first, then block by block (sharded under FSDP).
        return not (self.lay.ddp_bucket or self.lay.kind in ("zero12", "zero3"))

    @property
    def unsynced(self) -> bool:
        return self.grad_accum > 1 and self.lay.ddp_bucket and not self.lay.grads_beside_buckets

    @property
    def accumulated(self) -> bool:
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
        return self.grad_accum > 1 and self.growing_grads and self.lay.kind == "replicated"

    @property
    def accumulated_shards(self) -> bool:
        # Sharded (FSDP), the micro-batches before the last run under no_sync (FSDP2's
        # set_requires_gradient_sync(False)): each unit keeps its gradient whole, unreduced, until the
        # last micro-batch's backward reduce-scatters it into its shard and frees it. So that backward
        # starts with every gradient whole, and in block i holds the whole gradients of the root (reduced
        # when backward ends) and of the blocks not yet reduced (i and below), the shards of those above.
        # (Measured on the zoo, 2 ranks, micro-batch 4 x 2: counting shards alone put FSDP2 13-22% and
        # FSDP1 up to 16% under the measured peak: runs/reference at b423e114, docs/results/zoo_accuracy_2026-12-05.md.)
        return self.grad_accum > 1 and self.growing_grads and self.lay.kind in ("full_shard", "shard_grad_op")

    def grads_so_far(self, i: int, part: int) -> int:
        """The gradients made when backward is in block i: the head's, the blocks above, `part` of i's."""
        n, Pt = self.n, self.Pt
        grad_units = n.trainable_per_block
        grad_head = min(n.head, n.trainable_root)
        if self.accumulated:
            return F32 * (Pt + (0 if self.a.backward else self.largest))
        if self.accumulated_shards:
            return F32 * (n.trainable_root + sum(grad_units[:i + 1]) + part + sum(grad_units[i + 1:]) // self.W)
        if self.unsynced:  # made apart in the first micro-batch's backward, or not yet copied in the last's;
            made = grad_head + sum(grad_units[i + 1:]) + part  # every one of them in a micro-batch between
            return F32 * (Pt if self.grad_accum > 2 else max(made, Pt - made))
        return F32 * (grad_head + sum(grad_units[i + 1:]) + part) // self.W if self.growing_grads else 0


def activations(cfg, traced: bool, lay: Layout, micro_batch: int, precision: str, device: str, ckpt_interval: int,
                 ckpt_policy: str, save_ops, ckpt_plan, assumptions: list[str]) -> tuple[Activations, list[str], int]:
    """The model's activation terms, each block's checkpointing choice, and the activations' bytes."""
    act = 2 if precision in ("bf16", "fp16") else F32
    # single and ddp run mixed precision as autocast over fp32 weights (backends/torch_backend.py);
    # FSDP and DeepSpeed cast the module's parameters, so every activation is 16-bit there.
    autocast = act != F32 and lay.autocast
    residual = F32 if autocast else act
    mask = act if device == "cpu" else 1
    a = traced_activations(cfg, micro_batch, act, device) if traced else \
        gptlite_activations(cfg, micro_batch, act, mask, device, autocast, residual)
    if traced:
        assumptions.append("activations traced once in fp32 on fake tensors (estimator/traced_model.py)"
                           + (", scaled to 16 bits" if act != F32 else ""))
    choices = ckpt_choices(len(a.full), ckpt_interval, ckpt_policy, ckpt_plan)
    if "selective" in choices and a.ops is None:  # GPT-lite by formula: its operators' outputs traced
        a.ops = traced_activations(TracedModel.of_gptlite(cfg), micro_batch, act).ops
    if "selective" in choices:
        assumptions.append("selective checkpointing keeps a block's input and the outputs of "
                           + ", ".join(save_ops if save_ops is not None else SELECTIVE_SAVE_OPS))
    return a, choices, act


def resident(s: Step, device: str) -> None:
    """What lives through the whole step (s.resident), the buckets from backward's first gradient on
    (s.buckets) and what gradient accumulation carries into the last micro-batch (s.carried)."""
    lay, c, W, P, Pt = s.lay, s.c, s.W, s.P, s.Pt
    # On an accelerator, offloaded states live in host memory, not in the device's: the optimizer
    # state always; the parameter shards under FSDP's CPU offload and ZeRO-Infinity's offload_param;
    # ZeRO-3's gradient partitions under ZeRO-Offload.
    s.offloading = lay.offload and device != "cpu"
    s.params_host = s.offloading and lay.offload_params
    s.grads_host = s.offloading and lay.kind == "zero3"
    resident = (0 if s.params_host else s.params) + (0 if s.offloading else s.optimizer)
    # ZeRO-3 on one rank gathers nothing: a parameter's data is its partition, aliased (DeepSpeed's
    # NoGatherHandle), though the record counts it as gathered too (model_state_bytes); unless the
    # partition lives on the host (ZeRO-Infinity's offload_param on a GPU): copied to the device.
    s.alone = lay.kind == "zero3" and W == 1 and not s.params_host
    if lay.kind == "shard_grad_op" or (lay.kind == "zero3" and not s.alone) or lay.fsdp1_root_gathered \
            or lay.post_forward:
        resident += s.gathered
    if lay.hpz > 1:  # ZeRO++ hpZ: the secondary partition, each parameter's 1/hpz, kept beside the primary
        resident += c * ((P - s.persistent) // lay.hpz)
    if lay.ddp_bucket:
        resident += s.grads
    if lay.kind == "zero3":
        resident += 0 if s.grads_host else s.grads
        # The gradient bucket is allocated whole when contiguous_gradients is on, however small the model.
        resident += c * (s.bucket if lay.ds.get("contiguous_gradients", True) else min(P, s.bucket))
    if lay.kind == "zero12" and lay.offload:
        if s.on_cpu:
            # On a CPU-only machine the host is the device: ZeRO-Offload's fp32 gradient partition,
            # which the CPU optimizer steps with, and its 16-bit copy of the updated partition.
            # (Its two largest-parameter gradient buffers are allocated too, but no op touches them
            # without gradient accumulation, so the CPU measurement cannot see them.)
            resident += F32 * Pt // W + c * Pt // W
        else:
            resident += c * s.largest  # the device's buffer for one parameter's gradient on its way out
    s.resident = resident + s.a.before  # what the forward kept before the first block lives through backward
    # ZeRO-1/2's two gradient buckets, from the first gradient of backward on.
    s.buckets = 2 * c * s.bucket if lay.kind == "zero12" else 0

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
    stage = int(lay.ds.get("stage", 0))
    partitioned = s.grad_accum > 1 and lay.kind == "zero12" and not lay.offload and W > 1
    s.carried = c * Pt // W if partitioned and stage == 2 else 0
    if partitioned and stage == 1:
        # ZeRO-1 reduces at the last micro-batch only: the gradients accumulate whole in between
        # (measured on the zoo, 2 ranks, micro-batch 4 x 2: the records' gradients 0.98-1.0 of the
        # model's; without them GPT-lite's and the mixture of experts' runs were 8.8% and 9.2% under,
        # 10.7% once a block's traced backward held its input, runs/reference/cpu-2core-zoo-peaks).
        s.carried = c * Pt


def backward_start_moments(s: Step) -> list[tuple]:
    """The start of backward, the head's own backward, and ZeRO-3's end of forward."""
    a, per_block, blocks = s.a, s.per_block, len(s.a.full)
    moments = []
    # Backward starts in the head: every block's activations and the head's are alive.
    every_grad = s.unsynced or s.accumulated_shards or s.accumulated  # made whole before this backward
    kept_then = s.resident + s.carried + (F32 * s.Pt if every_grad else 0) + sum(per_block)
    moments.append((kept_then + a.head + a.logits_grad, "start of backward", sum(per_block) + a.head, blocks))
    own_head = a.own_head_backward()
    if own_head is not None:
        # The head's own backward (traced models), beside every block's activations. It sets the peak
        # of a model without blocks (the zoo's GRU: its DDP peaks were measured 8-12% above the start
        # of backward).
        moments.append((kept_then + own_head, "backward of the head", sum(per_block) + a.head, blocks))
    lay = s.lay
    if lay.kind == "zero3" and s.gloo and not s.alone:
        # The end of forward: everything gathered, and the last gathers still in flight through
        # gloo's buffers: the prefetch (up to stage3_prefetch_bucket_size elements: the whole model
        # of a small one) or at least the module fetched and the next one (a parameter can exceed
        # the bucket).
        prefetch = int(float(lay.ds.get("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET)))
        # DeepSpeed prefetches no more than stage3_max_live_parameters leaves room for
        # (PartitionedParameterCoordinator.fetch_sub_module): 0 of them, no prefetch.
        prefetch = min(prefetch, int(float(lay.ds.get("stage3_max_live_parameters", DS_MAX_LIVE))))
        in_flight = s.c * max(min(s.P - s.persistent, prefetch), 2 * s.largest)
        moments.append((s.resident + sum(per_block) + in_flight, "end of forward", sum(per_block), blocks))
    return moments


def block_moments(s: Step) -> list[tuple]:
    """Each block's backward, its gradients' reduction, and (FSDP2 on gloo) its forward all-gather."""
    lay, a, c, per_block, units = s.lay, s.a, s.c, s.per_block, s.n.per_block
    grad_units, blocks = s.n.trainable_per_block, len(s.a.full)
    moments = []
    for i in reversed(range(blocks)):
        # FULL_SHARD gathers the unit again for its backward and prefetches the next one's.
        regathered = c * (units[i] + (units[i - 1] if i else 0)) if lay.kind == "full_shard" else 0
        # Block i holds all its activations (kept, or recomputed if it is checkpointed) while its
        # backward runs; the blocks below still hold what they kept.
        below = sum(per_block[:i])
        # FSDP2 keeps the reduce-scatter input of the unit above until this unit reduces
        # (reduce_scatter_max_input_buffers, 1 by default).
        held = c * units[i + 1] if s.fsdp_unit and lay.holds_reduce_scatter_input and i + 1 < blocks else 0
        moments.append((s.resident + s.carried + s.grads_so_far(i, grad_units[i] // 3) + below + a.own_backward(i)
                        + s.buckets + regathered + held, f"backward of block {i}",
                        below + (0 if s.checkpointed[i] else a.full[i]), i))
        if s.fsdp_unit:
            # The end of the unit's backward, its activations gone: two unit-sized buffers of its
            # gradients at a time. FSDP1: op by op, then flattened (FlatParameter), then the flat
            # gradient and gloo's copy of it for the reduce-scatter, beside the unit's new gradient
            # shard. FSDP2: the gradients and the reduce-scatter's input they are copied into, before
            # it allocates the shard. A unit that stays gathered is freed here. (On gloo the
            # finished reduce-scatter's work, held by gloo's worker thread, may keep its input and
            # gloo's copy a while longer: not counted; the memory profile does not either, see
            # Accuracy. unfixed_bytes below keeps room for them where a plan is made.)
            shards = s.grads_so_far(i, grad_units[i] if lay.flat_unit_grads else 0)
            freed = c * units[i] if lay.kind == "shard_grad_op" else 0
            moments.append((s.resident + shards + below + regathered + 2 * c * units[i] - freed,
                            f"gradient reduction of block {i}", below, i))
            if lay.holds_reduce_scatter_input and s.gloo:
                # Its forward, on gloo: the unit's all-gather output and gloo's flat buffer of the
                # same size, the previous unit's output not yet freed; a unit that stays gathered
                # is counted in `resident` once copied out, so not yet here.
                gathering = c * (2 * units[i] + (units[i - 1] if i else 0))
                not_yet = c * sum(units[i:]) if lay.kind == "shard_grad_op" else 0
                moments.append((s.resident - not_yet + below + gathering, f"forward of block {i}", below, i))
        elif lay.kind == "zero12":
            # ZeRO-1/2 reduce each gradient as backward makes it, into this rank's gradient
            # partition (allocated at the first; ZeRO-Offload's is the fp32 one counted above): a
            # block's gradients, and their copies on the way (into a bucket, or gloo's for a
            # gradient larger than one), beside the two buckets.
            partition = 0 if lay.offload else c * s.Pt // s.W
            moments.append((s.resident + s.carried + partition + 2 * c * s.bucket + below + 2 * c * units[i],
                            f"gradient reduction of block {i}", below, i))
    return moments


def after_blocks_moments(s: Step) -> list[tuple]:
    """The layers before the blocks, the gradient reduction after backward, the optimizer step."""
    lay, a, c, W, Pt, units = s.lay, s.a, s.c, s.W, s.Pt, s.n.per_block
    moments = []
    if a.front_backward is not None:
        # The backward of the layers before the blocks (traced models), every block's activations gone:
        # what those layers kept (counted in `resident` until now) and are still holding, and their
        # backward's buffers. It sets the peak where they keep most (a convolutional front end over a
        # waveform or an image: its first layers run at the input's resolution), with or without
        # checkpointing, which does not touch them. Every gradient is made by then, theirs (the root's
        # but the head's) as they go (with accumulation under FSDP, the root's are counted whole already).
        # FSDP2 still holds the first block's reduce-scatter input (the root reduces after them).
        partition = c * Pt // W if lay.kind == "zero12" and not lay.offload else 0
        held = c * units[0] if s.fsdp_unit and lay.holds_reduce_scatter_input and len(a.full) else 0
        grad_head = min(s.n.head, s.n.trainable_root)
        front_grads = s.grads_so_far(-1, 0 if s.accumulated_shards else s.n.trainable_root - grad_head)
        moments.append((s.resident - a.before + s.carried + partition + front_grads + a.front_backward + s.buckets
                        + held, "backward of the layers before the blocks", 0, 0))
    # After backward, the gradients reduced: ZeRO-0 all-reduces them flattened into one buffer;
    # ZeRO-1/2 through two buckets, flattening each for the all-reduce, then copies this rank's
    # partition out in fp32 (kept on the host under ZeRO-Offload: counted above).
    if lay.flat_allreduce and lay.kind == "replicated":
        moments.append((s.resident + s.grads + c * Pt, "gradient reduction", 0, 0))
    elif lay.kind == "zero12":
        moments.append((s.resident + s.carried + 2 * c * s.bucket + c * min(Pt, s.bucket)
                        + (0 if lay.offload else F32 * Pt // W), "gradient reduction", 0, 0))
    elif lay.kind == "zero3" and not s.grads_host:
        # ZeRO-3 reduce-scatters its bucket of gradients coalesced: flattened into one buffer, and
        # this rank's part of it copied out (on one rank, the whole of it again). Measured on one
        # rank, 16 micro-batches of 1 (the zoo's mixture of experts): two model-sized fp32 buffers
        # alive at the peak beside every state.
        flat = c * min(Pt, s.bucket)
        moments.append((s.resident + flat + flat // W, "gradient reduction", 0, 0))
    # The optimizer step: every resident state with the gradients complete, and the update's
    # temporaries (torch's single-tensor AdamW: about two of the largest tensor's shard). It sets the
    # peak of models whose activations are small beside their states.
    separate_grads = not (lay.ddp_bucket or lay.kind == "zero3" or s.grads_host) or lay.grads_beside_buckets
    update_temporaries = 2 * F32 * s.largest // (1 if lay.kind == "replicated" else W)
    step = s.resident + (s.grads if separate_grads else 0) + update_temporaries
    if lay.kind == "zero12" and not lay.offload:
        step += F32 * Pt // W  # ZeRO-1/2's step flattens this rank's gradient partition (fp32) first
    moments.append((step, "optimizer step", 0, 0))
    if lay.kind == "zero12" and s.gloo:
        # ZeRO-1/2 all-gather the updated partitions into the parameters, through gloo's buffer.
        moments.append((s.resident + c * s.P, "parameter all-gather", 0, 0))
    return moments
