"""What the DeepSpeed backend needs from DeepSpeed beyond `deepspeed.initialize`.

Importing deepspeed is deferred to these functions: the torch backends run without it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging
import os
import warnings
from contextlib import redirect_stdout

import torch
import torch.nn as nn

from backends.activation_checkpointing import keep_buffers_on_recompute


@functools.lru_cache(maxsize=1)
def import_deepspeed():
    """deepspeed, imported with the CPU accelerator preset where there is no GPU (otherwise it
    probes and warns) and its logger limited to warnings (its INFO lines repeat the whole config)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with redirect_stdout(io.StringIO()):
        import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # ZeRO-3 calls torch's deprecated reduce_scatter_tensor / all_gather_into_tensor aliases.
    warnings.filterwarnings("ignore", category=FutureWarning, module="deepspeed")
    return deepspeed


def add_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    """--deepspeed and --deepspeed_config, from deepspeed.add_config_arguments when installed."""
    try:
        import_deepspeed().add_config_arguments(parser)
    except ImportError:
        group = parser.add_argument_group("DeepSpeed (not installed: pip install deepspeed)")
        group.add_argument("--deepspeed", action="store_true", help="Enable DeepSpeed.")
        group.add_argument("--deepspeed_config", default=None, help="DeepSpeed json configuration file.")


def async_io_available() -> bool:
    """Whether DeepSpeed's async_io op (NVMe offload) can build here; it needs libaio."""
    import_deepspeed()
    from deepspeed.ops.op_builder import AsyncIOBuilder

    with redirect_stdout(io.StringIO()):
        return bool(AsyncIOBuilder().is_compatible(verbose=False))


class DeepSpeedCheckpointed(nn.Module):
    """A block run under deepspeed.checkpointing (reentrant `checkpoint` or `non_reentrant_checkpoint`).

    Reentrant checkpointing of a segment whose inputs need no gradient computes none for the
    segment's parameters: silently (a chain of such blocks) or with "element 0 of tensors does not
    require grad" (DeepSpeed issues 4274, 4479, which made the article's repository turn
    checkpointing off). The input is therefore made to require grad when it does not; it has no
    graph behind it then, so nothing upstream changes.
    """

    def __init__(self, module: nn.Module, non_reentrant: bool):
        super().__init__()
        self.module = module
        self.non_reentrant = non_reentrant

    def forward(self, x: torch.Tensor, *args, **kwargs):
        checkpointing = import_deepspeed().checkpointing
        if torch.is_grad_enabled() and not x.requires_grad:
            x = x.detach().requires_grad_()
        run = checkpointing.non_reentrant_checkpoint if self.non_reentrant else checkpointing.checkpoint
        # DeepSpeed's checkpoint passes positional arguments only: keyword arguments (a transformers
        # layer's attention mask, position embeddings) are bound here. They need no gradient.
        function = functools.partial(self.module, **kwargs) if kwargs else self.module
        # Its recompute must leave the block's buffers (BatchNorm's statistics) as the forward left them.
        return run(keep_buffers_on_recompute(self.module, function), x, *args)


def unlink_shm_allreduce_buffer(rank: int) -> None:
    """Remove this rank's /dev/shm file of DeepSpeed's CPU shared-memory allreduce, once every
    rank has mapped it.

    DeepSpeed 0.19.8's shm comm op (csrc/cpu/comm/shm.cpp) creates a 66 MB
    `/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>` per rank and never unlinks
    it: every CPU run left its buffers behind, until /dev/shm (RAM) was full. Unlinking after
    the mappings exist is safe: the memory stays mapped in every rank until they exit, and
    nothing is left behind even when a rank is killed later.
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return
    path = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def deepspeed_wrapper(impl: str):
    return functools.partial(DeepSpeedCheckpointed, non_reentrant=impl == "deepspeed_nonreentrant")


def model_state_estimate(stage: int, n_params: int, largest_layer_params: int, world_size: int,
                         ranks_per_node: int, offload_optimizer: str, offload_param: str) -> dict:
    """DeepSpeed's own estimate of model-state memory (its estimators cover model states only:
    no activations, no communication buffers; they assume 16-bit parameters with fp32 optimizer
    state, 18 bytes per parameter)."""
    import_deepspeed()
    nodes = max(1, world_size // max(1, ranks_per_node))
    per_node = world_size // nodes
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, device, _ = estimate_zero3_model_states_mem_needs(
            n_params, largest_layer_params, num_gpus_per_node=per_node, num_nodes=nodes,
            cpu_offload=offload_optimizer != "none", cpu_offload_params=offload_param != "none",
            zero_init=False)
        function = "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs"
    elif stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, device = estimate_zero2_model_states_mem_needs(
            n_params, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload_optimizer != "none")
        function = "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs"
    else:
        return {"function": None, "device_bytes_per_rank": None, "host_bytes_per_node": None,
                "note": f"DeepSpeed has no model-state estimator for ZeRO stage {stage}"}
    return {"function": function, "device_bytes_per_rank": int(device), "host_bytes_per_node": int(cpu),
            "note": "model states only, assuming 16-bit parameters and fp32 optimizer state"}


def replay_adam_step_count(optimizer) -> None:
    """Make a resumed run's Adam steps bit-identical to those of the run that never stopped.

    DeepSpeed's C++ Adam (the CPU op behind FusedAdam on the CPU accelerator, and DeepSpeedCPUAdam;
    csrc/includes/cpu_adam.h, IncrementStep) keeps beta1^t and beta2^t as float32 running products,
    outside any state_dict. A fresh process starts them from std::pow(beta, t), which differs from
    the product in the last bit for some t (0.999: t = 6; 0.8: t = 7), so the bias correction and
    every weight after the resume differed by an ulp. Replaying steps 1..t through the same op on
    one-element dummy tensors rebuilds the products exactly (0.15 s for 100k steps). CUDA's kernel
    recomputes the powers each call: nothing to replay there."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    inner = getattr(optimizer, "optimizer", optimizer)
    steps = [state["step"] for state in inner.state.values() if isinstance(state.get("step"), int)]
    if not steps or not isinstance(inner, (FusedAdam, DeepSpeedCPUAdam)) or (
            isinstance(inner, FusedAdam) and next(iter(inner.state)).device.type != "cpu"):  # CUDA: no hidden state
        return
    p, g, m, v = (torch.zeros(1) for _ in range(4))
    for t in range(1, max(steps) + 1):
        for gr in inner.param_groups:
            if isinstance(inner, DeepSpeedCPUAdam):
                inner.ds_opt_adam.adam_update(inner.opt_id, t, gr["lr"], *gr["betas"], gr["eps"], gr["weight_decay"],
                                              gr["bias_correction"], p, g, m, v)
            else:
                inner.multi_tensor_adam(2048 * 32, inner._dummy_overflow_buf, [[g], [p], [m], [v]], gr["lr"],
                                        *gr["betas"], gr["eps"], t, inner.adam_w_mode, int(gr["bias_correction"]),
                                        gr["weight_decay"])
