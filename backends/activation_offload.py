"""Activation offloading with a prefetch horizon, on torch's saved-tensor hooks.

What a checkpointed block keeps for backward (its inputs, which torch's checkpoints save through
autograd: `_NoopSaveInputs` for the non-reentrant one, `ctx.save_for_backward` for the reentrant
one) is packed into host memory as the
forward leaves the block, asynchronously on a side stream. Backward then walks the checkpointed
blocks from the last to the first; when block b's backward starts (the first unpack of its
inputs), the inputs of the next H checkpointed blocks in backward order are already being copied
back on the side stream, H being the activation loading horizon:

- the loss's gradient hook starts fetching the first H blocks of backward (the last H of forward)
  as backward begins;
- block b's first unpack starts the fetch of the H-th block after it, so the window moves one
  block per block;
- an unpack waits on its tensor's copy event (no use before the copy lands), hands the tensor to
  autograd and drops every reference the offloader had (each tensor is fetched once and freed
  after use); `record_stream` keeps the caching allocator from reusing memory a copy still reads
  or writes (no free before the copy leaves).

H = 0 fetches each block's inputs when its backward asks for them, as torch's own offload
(offload_wrapper, save_on_cpu) does. On a CPU-only machine the copies are host to host: the
mechanics run, the memory does not move (tests check the mechanics, not the speed).
DeepSpeed's checkpoints keep their inputs on the autograd context outside autograd's saved tensors,
out of the hooks' reach: with them the run is refused (core/config.py); the torch checkpoints
run under the DeepSpeed backend instead.
SageMaker's model-parallel library had this (`activation_loading_horizon`); it is tied to SageMaker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from backends.activation_checkpointing import checkpointed_indices


@dataclass(eq=False)
class _Saved:
    """One tensor a checkpointed block saved: its host copy and, once fetched, its device copy."""

    block: int
    host: torch.Tensor | None
    offloaded: object = None  # CUDA event: the host copy is complete
    device_tensor: torch.Tensor | None = None
    fetched: object = None  # CUDA event: the device copy is complete


@dataclass
class ScheduleEvent:
    """What the offloader did, in order (for tests and for anyone tuning the horizon)."""

    kind: str  # "offload" | "fetch" | "use" | "release"
    block: int
    during: int | None  # the block whose backward was running (None: before any block's backward)
    saved_id: int = 0


@dataclass
class ActivationOffloader:
    device: torch.device
    horizon: int
    checkpointed: list[int]  # indices of the checkpointed blocks, in forward order
    record: bool = False  # keep the ScheduleEvents of the last step
    events: list[ScheduleEvent] = field(default_factory=list)

    def __post_init__(self):
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.saved: dict[int, list[_Saved]] = {}
        self.current: int | None = None  # the block whose backward runs now

    # -------------------------------------------------------------------------------- forward
    def wrap(self, module: nn.Module, block: int) -> nn.Module:
        return _OffloadedBlock(module, self, block)

    def start_step(self) -> None:
        """Forget the previous step (its tensors are all released by now)."""
        self.saved = {b: [] for b in self.checkpointed}
        self.current = None
        if self.record:
            self.events = []

    def pack(self, block: int, tensor: torch.Tensor) -> _Saved | torch.Tensor:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return tensor  # indices, masks, the empty marker of torch's checkpoint: not worth a copy
        if self.cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
                offloaded = torch.cuda.Event()
                offloaded.record(self.stream)
            tensor.record_stream(self.stream)  # not reused before the copy has read it
        else:
            host, offloaded = tensor.detach().clone(memory_format=torch.preserve_format), None
        entry = _Saved(block, host, offloaded)
        self.saved[block].append(entry)
        self._log("offload", block, entry)
        return entry

    # ------------------------------------------------------------------------------- backward
    def backward_started(self, grad: torch.Tensor) -> torch.Tensor:
        """Gradient hook on the loss: backward begins; fetch the first `horizon` blocks."""
        self.current = None
        for block in self._backward_order()[:self.horizon]:
            self._fetch_block(block)
        return grad

    def unpack(self, entry: _Saved | torch.Tensor) -> torch.Tensor:
        if isinstance(entry, torch.Tensor):
            return entry
        if self.current != entry.block:  # this block's backward starts now
            self.current = entry.block
            order = self._backward_order()
            position = order.index(entry.block)
            ahead = order[position + 1: position + 1 + self.horizon]
            if ahead:
                self._fetch_block(ahead[-1])  # the window's new edge; the blocks before it already left
            for block in ahead:  # after on-demand fetches (horizon 0 at first), keep the window full
                self._fetch_block(block)
        if entry.device_tensor is None:
            self._fetch(entry)  # on demand: not prefetched (horizon 0)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(entry.fetched)
            entry.device_tensor.record_stream(torch.cuda.current_stream(self.device))
        tensor = entry.device_tensor
        self._log("use", entry.block, entry)
        entry.device_tensor = entry.host = None  # autograd holds the only reference now
        self.saved[entry.block].remove(entry)
        self._log("release", entry.block, entry)
        return tensor

    def _backward_order(self) -> list[int]:
        return [b for b in reversed(self.checkpointed) if self.saved.get(b)]

    def _fetch_block(self, block: int) -> None:
        for entry in self.saved.get(block, ()):
            if entry.device_tensor is None:
                self._fetch(entry)

    def _fetch(self, entry: _Saved) -> None:
        self._log("fetch", entry.block, entry)
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(entry.offloaded)  # the offload copy has landed in host memory
                entry.device_tensor = entry.host.to(self.device, non_blocking=True)
                entry.fetched = torch.cuda.Event()
                entry.fetched.record(self.stream)
        else:
            entry.device_tensor = entry.host.clone()

    def _log(self, kind: str, block: int, entry: _Saved) -> None:
        if self.record:
            self.events.append(ScheduleEvent(kind, block, self.current, id(entry)))

    def describe(self) -> dict:
        return {"horizon": self.horizon, "blocks": self.checkpointed, "side_stream": self.cuda,
                "pinned_host_memory": self.cuda}


class _OffloadedBlock(nn.Module):
    """A (checkpointed) block whose saved tensors go through the offloader."""

    def __init__(self, module: nn.Module, offloader: ActivationOffloader, block: int):
        super().__init__()
        self.module = module
        self.offloader = offloader
        self.block = block

    def forward(self, *args, **kwargs):
        offloader, block = self.offloader, self.block
        with torch.autograd.graph.saved_tensors_hooks(lambda t: offloader.pack(block, t), offloader.unpack):
            return self.module(*args, **kwargs)


def attach(model: nn.Module, offloader: ActivationOffloader) -> None:
    """Start each step afresh and begin fetching when the loss's backward begins."""

    def pre_forward(module, args):
        if torch.is_grad_enabled():
            offloader.start_step()

    def post_forward(module, args, output):
        loss = output[1] if isinstance(output, tuple) else None
        if loss is not None and loss.requires_grad:
            loss.register_hook(offloader.backward_started)

    model.register_forward_pre_hook(pre_forward)
    model.register_forward_hook(post_forward)


def make_offloader(cfg, device: torch.device, model: nn.Module,
                   blocks: list[nn.Module]) -> ActivationOffloader | None:
    """The offloader a run asks for (--offload_activations), attached to `model` (its `blocks`), or None."""
    if not cfg.offload_activations:
        return None
    offloader = ActivationOffloader(device, cfg.activation_loading_horizon,
                                    checkpointed_indices(len(blocks), cfg.ckpt_interval))
    attach(model, offloader)
    return offloader
