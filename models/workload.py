"""A Workload: the model a run trains, its data, and what the harness needs to know about both."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn as nn
import torch.nn.functional as F


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of logits `output` (..., classes) against class ids `target` (...),
    in fp32 (as GPT-lite computes its own): token prediction and image classification alike."""
    return F.cross_entropy(output.reshape(-1, output.size(-1)).float(), target.reshape(-1))


class WithLoss(nn.Module):
    """A model with GPT-lite's contract, `forward(x, y) -> (output, loss)`, around any module:
    `call(net, x)` gives the output (logits), `loss(output, y)` the mean loss. The wrapped module
    is `net`, so its parameters are named `net.<its own names>`."""

    def __init__(self, net: nn.Module, call: Callable | None = None, loss: Callable | None = None):
        super().__init__()
        self.net = net
        self._call = call
        self._loss = loss or cross_entropy

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        out = self._call(self.net, x) if self._call is not None else self.net(x)
        return out, (self._loss(out, y) if y is not None else None)


@dataclass
class Workload:
    """Everything a run knows about its model and data.

    name: the --model value; description: the record's `model` section (config.json); data: a
    batch source with CharDataset's interface (`batch`, `describe`); make: builds the module (with
    the (x, y) -> (output, loss) contract) from torch's current RNG state; tokens_per_sample: for
    text models (tokens/s), None otherwise.
    """

    name: str
    description: dict
    data: object
    make: Callable[[], nn.Module]
    tokens_per_sample: int | None = None
    # Model FLOPs of one sample's forward and backward by formula, where the model has one
    # (GPT-lite); otherwise counted (core/flops.py) on the meta device.
    flops_formula: float | None = None
    # Context managers the model needs to run on fake tensors as it runs on real ones (see hf.py).
    fake_patches: tuple = ()
    _meta: nn.Module | None = field(default=None, repr=False)

    def __post_init__(self):
        # As config.json and checkpoint metadata will read it back (tuples become lists), so that
        # a resumed run compares equal descriptions.
        self.description = json.loads(json.dumps(self.description, default=str))

    def build(self, seed: int) -> nn.Module:
        """The model with weights that depend on `seed` alone: every rank and backend starts equal."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.make()

    def meta(self) -> nn.Module:
        """The model's structure without memory (on the meta device, or the CPU for a model that
        places its own tensors), built once."""
        if self._meta is None:
            try:
                with torch.device("meta"):
                    self._meta = self.make()
            except Exception:  # noqa: BLE001 - a user model that creates tensors on a named device
                self._meta = self.build(0)
        return self._meta

    def fake(self, batch: int = 2):
        """(context, model, x, y): the model and `batch` samples as fake tensors (torch's FakeTensorMode:
        shapes and dtypes, no memory, no data), for counting FLOPs and tracing memory; run the model
        inside `context`. Unlike the meta device, libraries treat fake tensors as tracing (transformers
        skips its data-dependent checks). Two samples by default: batch normalisation refuses one in
        training mode."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=False)
        x, y = self.example(batch)
        try:
            with torch.random.fork_rng(devices=[]), mode:
                model = self.make()
        except Exception:  # noqa: BLE001 - its construction reads data (ViT's weight init, ConvNeXt's
            # linspace().tolist()): its structure instead (the meta device), given fake storage.
            model = copy.deepcopy(self.meta())
            with mode:
                model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=x.device))
        return _FakeRun(mode, self.fake_patches), model, mode.from_tensor(x), mode.from_tensor(y)

    def traced(self, batch: int, run: Callable):
        """`run(context, model, x, y)` on fake tensors (`fake`), or, for a model whose forward reads
        data (fake tensors have none), on the model built for real and `batch` real samples: a few
        samples of real memory, so that every model that trains can be traced and counted."""
        try:
            return run(*self.fake(batch))
        except Exception:  # noqa: BLE001 - any failure on fake tensors; a real error recurs below
            x, y = self.example(batch)
            return run(contextlib.nullcontext(), self.build(0), x, y)

    @cached_property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.meta().parameters())

    def example(self, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `batch` training samples of step 0 (x, y), for tracing and counting."""
        return self.data.batch("train", 0, 0, 0, batch, batch)


class _FakeRun:
    """Enters a FakeTensorMode and the workload's patches together (reusable)."""

    def __init__(self, mode, patches: tuple):
        self.mode, self.patches = mode, patches

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        for patch in self.patches:
            self.stack.enter_context(patch())
        return self.stack.enter_context(self.mode)

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)
