"""A model's activation terms for the estimator (estimator/estimate.py): GPT-lite's by formula
(estimator/memory_model.py), any other model's traced (estimator/traced_model.py), and what each block
keeps under its checkpointing choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.activation_checkpointing import SELECTIVE_SAVE_OPS
from core.config import CKPT_CHOICES, interval_choices
from estimator.memory_model import F32, activation_per_block, backward_transient, head_activations
from gptlite.errors import ConfigError
from gptlite.model import GPTConfig


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
    # with the convolutions' allowance), and the speech encoder's 32 (tests/support/speech_ctc_peaks.json)
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
