"""Activation checkpointing of every k-th transformer block, whole (full) or op by op (selective).

Blocks i with i % k == 0 are wrapped so that only their inputs are kept in forward and their
activations are recomputed in backward. Wrapping happens after the backend has wrapped the model
(the FSDP activation-checkpointing tutorial's order: shard first, then checkpoint), with torch's
`apply_activation_checkpointing` and a `check_fn` that picks the chosen blocks by identity, so
the same code finds them inside DDP, FSDP units or FSDP2 modules. Whole blocks are checkpointed,
never their children (checkpointing each child saves more memory than it frees).

A recompute must not touch the module's buffers: it runs in training mode, so without care each
BatchNorm in a checkpointed block updated its running statistics (and `num_batches_tracked`) twice
per micro-batch, and the validation loss changed with --ckpt_interval. Every recompute therefore
runs under `buffers_restored`, which puts back every buffer the recompute wrote, at the end of
the backward that ran it. Restoring, rather than freezing BatchNorm (momentum 0, or
track_running_stats off), holds for any module that writes a buffer in forward (momentum 0 would
still count `num_batches_tracked`, and with momentum None the average is cumulative; without
running statistics batch_norm saves other tensors, which the non-reentrant checkpoint's
determinism check compares), and the recompute computes what the forward computed
(training-mode BatchNorm normalises by the batch's statistics either way).
torch's non-reentrant checkpoint runs its recompute under the second context of `context_fn`; the
reentrant checkpoints (torch's, DeepSpeed's) have no such hook and DeepSpeed's non-reentrant one
neither: there the checkpointed function itself tells its recompute from its forward by running
inside the autograd engine's backward (`keep_buffers_on_recompute`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper, offload_wrapper)

from core.config import TORCH_CKPT_IMPLS, interval_choices

TORCH_IMPLS = dict(zip(TORCH_CKPT_IMPLS, (CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT)))

# What a selective checkpoint (--ckpt_policy selective) keeps, by aten operator: the expensive ops.
# A matmul with a weight reaches the dispatcher as mm or addmm (nn.Linear, HF's Conv1D), a
# convolution as convolution, fused attention as its kernel. The naive attention core's QK^T and
# AV are batched matmuls of two activations (bmm): recomputed with the softmax and dropout between
# them, Megatron's selective recompute: the T x T scores are the largest activations and the
# cheapest per byte to recompute. Everything else (norms, activations, elementwise, dropout, views)
# is recomputed from the kept outputs.
SELECTIVE_SAVE_OPS = ("mm", "addmm", "convolution", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention")


def checkpointed_indices(n_layer: int, interval: int) -> list[int]:
    """Indices of the blocks checkpointed at `interval` (0: none)."""
    return [i for i in range(n_layer) if interval and i % interval == 0]


@contextlib.contextmanager
def buffers_restored(module: nn.Module):
    """Run a recompute of `module` and put back each buffer it wrote, once the backward that ran
    it has finished (early stop and errors included).

    Not at the recompute's end: what the recompute saved for backward may alias a buffer
    (batch_norm saves the running statistics), and autograd refuses a saved tensor written since.
    Only buffers whose values changed are copied back (version counters cannot tell: batch_norm's
    kernel writes the running statistics without moving them), so a buffer the recompute only read
    is left alone."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]

    def restore():
        with torch.no_grad():
            for buffer, value in saved:
                if not torch.equal(buffer, value):
                    buffer.copy_(value)

    try:
        yield
    finally:
        if in_backward():
            torch.autograd.Variable._execution_engine.queue_callback(restore)
        else:
            restore()


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (where checkpoints recompute)."""
    return torch._C._current_graph_task_id() != -1


def keep_buffers_on_recompute(module: nn.Module, function: Callable) -> Callable:
    """`function` (which runs `module`), whose calls from inside a backward (the recompute of a
    checkpoint that has no recompute hook) leave `module`'s buffers as they found them."""

    def run(*args, **kwargs):
        if not in_backward():
            return function(*args, **kwargs)
        with buffers_restored(module):
            return function(*args, **kwargs)

    return run


def selective_policy(save_ops: Sequence[str]) -> Callable:
    """torch's selective-checkpoint policy: the outputs of `save_ops` (aten names) kept, the rest recomputed.
    MUST_SAVE, so that a compiled region would honour it too; PREFER_RECOMPUTE, torch's own default."""
    keep = {getattr(torch.ops.aten, name) for name in save_ops}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if getattr(op, "overloadpacket", None) in keep \
            else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@contextlib.contextmanager
def _all_of(*managers):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def _non_reentrant(module: nn.Module, save_ops: Sequence[str] | None = None) -> nn.Module:
    """torch's non-reentrant checkpoint of `module`; with `save_ops`, selective: the recompute reuses the
    outputs of those ops, kept in forward (create_selective_checkpoint_contexts), and runs the rest.
    The non-reentrant checkpoint restores the RNG state before it recomputes: dropout draws the masks
    of the forward (preserve_rng_state)."""
    def contexts():
        if save_ops is None:
            return contextlib.nullcontext(), buffers_restored(module)
        forward, recompute = create_selective_checkpoint_contexts(selective_policy(save_ops))
        # buffers_restored first: its copies of the buffers must not run under the selective
        # recompute's dispatch mode, which takes any op the forward did not run for nondeterminism.
        return forward, _all_of(buffers_restored(module), recompute)

    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=contexts)


def _needing_grad(args: tuple) -> tuple:
    """`args`, the first floating-point tensor made to require grad when none does. Reentrant
    checkpointing of a block fed by data (a vision model's first convolution) otherwise computes no
    gradient for the block's parameters: silently in one process, "parameters that were not used in
    producing loss" under DDP. The tensor has no graph behind it, so nothing upstream changes."""
    if not torch.is_grad_enabled() or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return args
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return (*args[:k], a.detach().requires_grad_(), *args[k + 1:])
    return args


def _reentrant(module: nn.Module) -> nn.Module:
    def checkpoint_fn(function, *args, **kwargs):
        return torch_checkpoint(keep_buffers_on_recompute(module, function), *_needing_grad(args),
                                use_reentrant=True, **kwargs)

    # checkpoint_impl still REENTRANT: the wrapper then packs keyword arguments for it.
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.REENTRANT, checkpoint_fn=checkpoint_fn)


def torch_wrapper(impl: str, offload: bool, save_ops: Sequence[str] | None = None):
    """checkpoint_wrapper with `impl`; with `offload`, the kept inputs also go to host memory; with
    `save_ops` (non-reentrant only), selective."""
    if impl not in TORCH_IMPLS:
        raise ValueError(f"ckpt_impl must be one of {', '.join(TORCH_IMPLS)} here (got {impl!r})")
    if save_ops is not None:
        if TORCH_IMPLS[impl] != CheckpointImpl.NO_REENTRANT or offload:
            raise ValueError("a selective checkpoint is non-reentrant and not offloaded")
        return lambda module: _non_reentrant(module, tuple(save_ops))
    wrap = _non_reentrant if TORCH_IMPLS[impl] == CheckpointImpl.NO_REENTRANT else _reentrant
    if offload:
        # offload_wrapper runs the block under save_on_cpu: what autograd keeps for the block
        # (under checkpointing, just its input) waits in host memory until backward needs it.
        return lambda module: offload_wrapper(wrap(module))
    return wrap


def save_ops_for(policy: str, save_ops: Sequence[str] | None) -> tuple[str, ...] | None:
    """The ops a checkpointed block keeps under `policy` (None: full, inputs only), raising on an unknown
    policy; `save_ops` (RunConfig.save_ops(), --ckpt_save_ops) replaces the selective default."""
    if policy == "full":
        return None
    if policy == "selective":
        return tuple(save_ops) if save_ops is not None else SELECTIVE_SAVE_OPS
    raise ValueError(f"unknown checkpointing policy {policy!r} (full, selective)")


def apply_ac(model: nn.Module, blocks: Sequence[nn.Module], interval: int, impl: str, offload: bool,
             wrapper=None, offloader=None, policy: str = "full", save_ops: Sequence[str] | None = None,
             choices: Sequence[str] | None = None) -> dict:
    """Checkpoint blocks[i] for i % interval == 0, wherever they sit inside `model`.

    `blocks` are the model's Block modules as they were before the backend wrapped the model
    (wrappers keep the same module objects inside). With an `offloader`
    (backends/activation_offload.py) each checkpointed block's saved inputs go through it. `policy`
    full keeps a block's inputs; selective also the outputs of `save_ops` (default SELECTIVE_SAVE_OPS).
    `choices` (a plan: --ckpt_plan, --ckpt_policy auto) instead names each block's: none, selective
    or full. Returns what was done, for the run record.
    """
    if choices is None:
        choices = interval_choices(len(blocks), interval, policy)
    elif len(choices) != len(blocks) or any(c not in ("none", "selective", "full") for c in choices):
        raise ValueError(f"a checkpointing plan has one of none, selective, full per block ({len(blocks)}): {choices}")
    indices = [i for i, c in enumerate(choices) if c != "none"]
    if not indices:
        return {"interval": 0, "impl": None, "offload": False, "prefetch_offload": None, "blocks": [],
                "policy": None, "save_ops": None, "plan": list(choices)}
    index_of = {id(blocks[i]): i for i in indices}
    kept = save_ops_for("selective", save_ops) if "selective" in choices else None
    if kept is not None and (wrapper is not None or offloader is not None or offload):
        raise ValueError("a selective checkpoint is torch's non-reentrant one, without an offloader")
    whole = wrapper or torch_wrapper(impl, offload)
    by_op = torch_wrapper(impl, False, kept) if kept is not None else None

    def checkpoint(module):
        wrapped = (by_op if choices[index_of[id(module)]] == "selective" else whole)(module)
        return offloader.wrap(wrapped, index_of[id(module)]) if offloader is not None else wrapped

    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint, check_fn=lambda m: id(m) in index_of)
    planned = len(set(choices) - {"none"}) > 1 or indices != checkpointed_indices(len(blocks), interval)
    return {"interval": 0 if planned else interval, "impl": impl, "offload": offload,
            "prefetch_offload": offloader.describe() if offloader is not None else None, "blocks": indices,
            "policy": "plan" if planned else choices[indices[0]], "save_ops": list(kept) if kept is not None else None,
            "plan": list(choices)}
