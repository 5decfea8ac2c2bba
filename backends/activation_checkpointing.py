"""Activation checkpointing of every k-th transformer block.

Blocks i with i % k == 0 are wrapped so that only their inputs are kept in forward and their
activations are recomputed in backward. Wrapping happens after the backend has wrapped the model
(the FSDP activation-checkpointing tutorial's order: shard first, then checkpoint), with torch's
`apply_activation_checkpointing` and a `check_fn` that picks the chosen blocks by identity, so
the same code finds them inside DDP, FSDP units or FSDP2 modules. Whole blocks are checkpointed,
never their children (checkpointing each child saves more memory than it frees).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper, offload_wrapper)

from core.config import TORCH_CKPT_IMPLS

TORCH_IMPLS = dict(zip(TORCH_CKPT_IMPLS, (CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT)))


def checkpointed_indices(n_layer: int, interval: int) -> list[int]:
    """Indices of the blocks checkpointed at `interval` (0: none)."""
    return [i for i in range(n_layer) if interval and i % interval == 0]


def torch_wrapper(impl: str, offload: bool):
    """checkpoint_wrapper with `impl`; with `offload`, the kept inputs also go to host memory."""
    if impl not in TORCH_IMPLS:
        raise ValueError(f"ckpt_impl must be one of {', '.join(TORCH_IMPLS)} here (got {impl!r})")
    wrap = functools.partial(checkpoint_wrapper, checkpoint_impl=TORCH_IMPLS[impl])
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
