"""How a backend holds the model's states on each rank: what the estimator (estimator/estimate.py)
needs to know of a backend, answered by the backend itself (Backend.memory_layout).

A Layout says what is kept per rank (`kind`, `shards`), what is gathered and when (FSDP1's root
after forward, FSDP2's post-forward group, ZeRO++'s hpZ copy), how gradients are reduced (DDP's
buckets, FSDP's units, ZeRO's flattened buffers) and where mixed precision lives (autocast over fp32
weights, or a cast module). The estimator adds up the bytes; it never asks a backend's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

F32 = 4


def compute_bytes(precision: str) -> int:
    """Bytes of an element in the run's compute precision."""
    return 2 if precision in ("bf16", "fp16") else F32


@dataclass
class Layout:
    """How a backend holds the model: the inputs of the estimate that depend on the backend."""

    kind: str  # replicated | full_shard | shard_grad_op | zero12 | zero3
    shards: int = 1
    ddp_bucket: bool = False  # DDP keeps a gradient bucket the size of all gradients
    grads_beside_buckets: bool = False  # and the gradients apart from it (not bucket views)
    fsdp1_root_gathered: bool = False
    # FSDP2 resharding to a group of this many ranks after forward (reshard_after_forward as an
    # integer): each parameter's 1/post_forward kept from its forward until its backward.
    post_forward: int = 0
    # ZeRO++ hpZ: a secondary copy of the parameters partitioned over this many ranks.
    hpz: int = 1
    offload: bool = False
    compute_bytes: int = F32  # bytes of the parameters the forward computes with
    ds: dict = field(default_factory=dict)
    # Mixed precision as autocast over fp32 weights (single, ddp, accelerate), not a cast module:
    # the residual stream and LayerNorm outputs stay fp32.
    autocast: bool = False
    # The module in 16 bits with an fp32 master copy kept by the optimizer (DeepSpeed: ZeRO-0 in 16
    # bits holds c P parameters, c P gradients and 12 P of optimizer state).
    master_in_optimizer: bool = False
    # The parameter shards go to the host with the offload (FSDP's CPU offload, ZeRO-Infinity's
    # offload_param), not only the optimizer state.
    offload_params: bool = False
    # Shards by wrapped unit (FSDP1 and FSDP2): each unit's gradients reduce-scattered at the end
    # of its backward.
    sharded_units: bool = False
    # FSDP1's FlatParameter: a unit's gradients flattened whole before its reduce-scatter.
    flat_unit_grads: bool = False
    # FSDP2: the reduce-scatter input of the unit above kept until this unit reduces, and, on gloo,
    # each unit's forward all-gather through gloo's flat buffer.
    holds_reduce_scatter_input: bool = False
    # ZeRO-0: gradients all-reduced flattened into one buffer after backward.
    flat_allreduce: bool = False
    # ZeRO-1 in torch (ZeroRedundancyOptimizer): the parameters, gradients and DDP's buckets whole on
    # every rank, the optimizer state of 1/shards of the parameters.
    optimizer_shards: int = 1
