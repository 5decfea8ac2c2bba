"""Activation checkpointing of every k-th transformer block.

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
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper, offload_wrapper)

from core.config import TORCH_CKPT_IMPLS

TORCH_IMPLS = dict(zip(TORCH_CKPT_IMPLS, (CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT)))


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


def _non_reentrant(module: nn.Module) -> nn.Module:
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                              context_fn=lambda: (contextlib.nullcontext(), buffers_restored(module)))


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


def torch_wrapper(impl: str, offload: bool):
    """checkpoint_wrapper with `impl`; with `offload`, the kept inputs also go to host memory."""
    if impl not in TORCH_IMPLS:
        raise ValueError(f"ckpt_impl must be one of {', '.join(TORCH_IMPLS)} here (got {impl!r})")
    wrap = _non_reentrant if TORCH_IMPLS[impl] == CheckpointImpl.NO_REENTRANT else _reentrant
    if offload:
        # offload_wrapper runs the block under save_on_cpu: what autograd keeps for the block
        # (under checkpointing, just its input) waits in host memory until backward needs it.
        return lambda module: offload_wrapper(wrap(module))
    return wrap


def apply_ac(model: nn.Module, blocks: Sequence[nn.Module], interval: int, impl: str, offload: bool,
             wrapper=None, offloader=None) -> dict:
    """Checkpoint blocks[i] for i % interval == 0, wherever they sit inside `model`.

    `blocks` are the model's Block modules as they were before the backend wrapped the model
    (wrappers keep the same module objects inside). With an `offloader`
    (backends/activation_offload.py) each checkpointed block's saved inputs go through it.
    Returns what was done, for the run record.
    """
    indices = checkpointed_indices(len(blocks), interval)
    if not indices:
        return {"interval": 0, "impl": None, "offload": False, "prefetch_offload": None, "blocks": []}
    index_of = {id(blocks[i]): i for i in indices}
    checkpoint = wrapper or torch_wrapper(impl, offload)
    if offloader is not None:
        inner = checkpoint

        def checkpoint(module):
            return offloader.wrap(inner(module), index_of[id(module)])

    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint, check_fn=lambda m: id(m) in index_of)
    return {"interval": interval, "impl": impl, "offload": offload,
            "prefetch_offload": offloader.describe() if offloader is not None else None, "blocks": indices}
