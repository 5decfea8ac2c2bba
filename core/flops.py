"""Model FLOPs, hardware FLOPs, MFU and HFU.

Model FLOPs per token (PaLM's accounting): 6 x the parameters that take part in matmuls (all but
the embedding tables, which are lookups) for forward and backward, plus attention's
12 x n_layer x n_embd x T (the QK^T and AV matmuls, causal masking not subtracted). Recomputation
by activation checkpointing is not counted: that is hardware FLOPs (HFU), not model FLOPs.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils import flop_counter as fc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from core.blocks import find_blocks
from gptlite.model import GPTConfig, meta_model

# Dense bf16 tensor-core peak FLOP/s by device name substring, from the vendors' datasheets.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
}


# Ops that do a model's multiply-adds. One of these that torch's FlopCounterMode has no formula for
# would count 0; such ops are named (uncounted_ops), never dropped silently.
_FLOP_OP = ("mm", "matmul", "attention", "conv", "einsum", "linear", "_scaled_dot_product")


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch._grouped_mm (transformers' mixture-of-experts layers): each output element is a dot
    product over the contraction; groups split the rows (2-D x 3-D), batch them (3-D x 3-D) or, in
    backward's weight gradient (2-D x 2-D), split the contraction."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    n = 1
    for d in out_shape:
        n *= d
    return 2 * n * a_shape[-1]


@functools.cache
def _register_formulas() -> None:
    """Formulas torch's counter lacks, registered once: the CPU flash attention kernel that
    scaled_dot_product_attention runs on a CPU (counted as the other sdpa kernels are) and
    _grouped_mm."""
    aten = torch.ops.aten
    extra = {
        "_scaled_dot_product_flash_attention_for_cpu":
            lambda q, k, v, *a, out_shape=None, **kw: fc.sdpa_flop_count(q, k, v),
        "_scaled_dot_product_flash_attention_for_cpu_backward":
            lambda g, q, k, v, *a, out_shape=None, **kw: fc.sdpa_backward_flop_count(g, q, k, v),
        "_grouped_mm": _grouped_mm_flop,
    }
    for name, formula in extra.items():
        op = getattr(aten, name, None)
        if op is not None and op not in fc.flop_registry:
            fc.register_flop_formula(op)(formula)


def uncounted_ops(names) -> list[str]:
    """Of the aten ops that ran (`names`), those that do multiply-adds but that no formula counts."""
    _register_formulas()
    counted = {str(op).removeprefix("aten.") for op in fc.flop_registry}
    return sorted(n for n in set(names) if n not in counted and any(k in n for k in _FLOP_OP))


class _OpNames(TorchDispatchMode):
    """Notes the name of every op that reaches it (set outside FlopCounterMode, it sees what the
    counter ran, after the counter's own decompositions)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def counted_flops(model, *inputs, modules: dict | None = None,
                  kept_ops: tuple[str, ...] = (), ran: set | None = None) -> int | tuple[int, dict]:
    """FLOPs of one forward and backward of `model` on `inputs` as torch.utils.flop_counter counts
    them: every matmul, convolution and attention kernel (elementwise work is not counted, as in
    the formula above), whatever the model. `model(*inputs)` returns the loss, or a tuple whose
    last element is. On the meta device it costs no memory and little time.

    With `modules` ({name: module} of submodules of `model`): also the forward FLOPs of each,
    ({name: forward FLOPs}), what activation checkpointing runs again in backward; a selective checkpoint
    keeps the outputs of `kept_ops` (aten names) and does not run those again, so they are left out.
    With `ran` (a set): the names of the ops that ran are added to it (see uncounted_ops)."""
    _register_formulas()
    seen = _OpNames() if ran is not None else None
    with seen if seen else contextlib.nullcontext():
        with FlopCounterMode(display=False) as forward:
            out = model(*inputs)
        loss = out[-1] if isinstance(out, tuple) else out
        with FlopCounterMode(display=False) as backward:
            loss.backward()
    if seen:
        ran.update(seen.names)
    total = forward.get_total_flops() + backward.get_total_flops()
    if modules is None:
        return total
    counts = forward.get_flop_counts()
    # FlopCounterMode names modules by their path under the root's class name: "GPTLite.blocks.0".
    root = type(model).__name__
    return total, {name: sum(n for op, n in counts.get(f"{root}.{name}", {}).items()
                             if getattr(op, "__name__", str(op)) not in kept_ops) for name in modules}


def counted_flops_per_token(cfg: GPTConfig) -> float:
    """GPT-lite's FLOPs per token, counted (counted_flops) on the meta device over one sequence."""
    model = meta_model(cfg)
    idx = torch.zeros(1, cfg.block_size, dtype=torch.long, device="meta")
    return counted_flops(model, idx, idx) / cfg.block_size


def sample_flops(workload, block_class: str | None, ckpt_interval: int, kept_ops: tuple[str, ...] | None = None) -> dict:
    """FLOPs of one sample's forward and backward: `model` (the formula where the model has one, GPT-lite;
    else counted) and `recomputed`, the forward FLOPs of the checkpointed blocks, which activation
    checkpointing runs again in backward, but for the ops a selective checkpoint keeps (`kept_ops`):
    hardware FLOPs are model + recomputed. Counted on fake tensors (models.Workload.fake; real ones
    where the forward reads data) over two samples, halved."""
    def count(mode, model, x, y):
        blocks = find_blocks(model, block_class)
        names = {id(m): n for n, m in model.named_modules()}
        wanted = {names[id(b)]: b for i, b in enumerate(blocks) if ckpt_interval and i % ckpt_interval == 0}
        with mode:
            return counted_flops(model, x, y, modules=wanted, kept_ops=tuple(kept_ops or ()), ran=ran)

    ran: set = set()
    counted, per_block = workload.traced(2, count)
    formula = workload.flops_formula
    return {"model": formula if formula is not None else counted / 2, "source": "formula" if formula else "counted",
            "counted": counted / 2, "recomputed": sum(per_block.values()) / 2, "uncounted": uncounted_ops(ran)}


def planned_sample_flops(workload, block_class: str | None, choices, kept_ops) -> dict:
    """sample_flops for a plan (--ckpt_plan): `choices` per block, none, selective (keeping the outputs
    of `kept_ops`) or full."""
    flops = sample_flops(workload, block_class, 0)
    recomputed = sum(f for block, c in zip(block_flops_by_op(workload, block_class), choices) if c != "none"
                     for op, f in block.items() if c == "full" or op not in set(kept_ops or ()))
    return {**flops, "recomputed": recomputed}


def peak_flops(device_name: str) -> float | None:
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return None


def utilisation(samples_per_s: float | None, flops_per_sample: float | None, device_name: str,
                world_size: int) -> float | None:
    """FLOPs utilisation of all devices together (MFU with model FLOPs, HFU with hardware FLOPs), or
    None when the peak is unknown."""
    peak = peak_flops(device_name)
    if peak is None or samples_per_s is None or flops_per_sample is None:
        return None
    return samples_per_s * flops_per_sample / (peak * world_size)


def block_flops_by_op(workload, block_class: str | None) -> list[dict[str, float]]:
    """Each block's forward FLOPs of one sample by aten operator name ({"mm": ..., "bmm": ...}): what
    checkpointing the block runs again in backward, all of it (full) or the operators a selective
    checkpoint does not keep. Counted on fake tensors over two samples, halved, as sample_flops."""
    def count(mode, model, x, y):
        blocks = find_blocks(model, block_class)
        names = {id(m): n for n, m in model.named_modules()}
        with mode, FlopCounterMode(display=False) as counter:
            model(x, y)
        counts = counter.get_flop_counts()
        root = type(model).__name__
        return [{getattr(op, "__name__", str(op)).split(".")[0]: n / 2
                 for op, n in counts.get(f"{root}.{names[id(b)]}", {}).items()} for b in blocks]

    return workload.traced(2, count)
