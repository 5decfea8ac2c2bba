"""What the memory estimator needs to know about any model, traced once without real memory.

GPT-lite's activations have explicit formulas (estimator/memory_model.py); another model's are
measured by running its forward once on fake tensors (torch's FakeTensorMode: shapes, dtypes and
storages, no memory, no data) with autograd's saved-tensor hooks: every tensor the forward keeps
for backward is counted once, by storage, against the block that saved it first, a block's input
against the block (parameters and buffers left out). Traced in fp32 at micro-batches 2 and 4 (batch normalisation refuses one sample
in training); everything the estimator uses is linear in the micro-batch, so other sizes are
extrapolated from the two. A model whose construction reads data (ViT's weight init, ConvNeXt's
`linspace().tolist()`) is built on the meta device and given fake storage; one whose forward reads
data is traced on the model built for real, at those two micro-batches (models.Workload.traced).

Per block: `full` (bytes kept for backward), `kept` (its input: what a checkpointed block keeps),
`largest` (its largest saved tensor), and `ops`, the bytes of the new tensors each aten operator
made in the block's forward, by operator name (a dispatch mode under the same trace): what a
selective checkpoint keeps besides the input is the outputs of the operators it saves. Outside the blocks: `before` (saved before the first block,
alive through all of backward) and `after` (saved after the last: alive until backward leaves the
head), `output` (the output's fp32 gradient, the first thing backward makes), and `batch` (the
input and target tensors). Parameters: the counts the model-state formulas need.

The same trace then runs backward (each parameter's gradient dropped as it is made: the backend
holds gradients, counted apart): `backward_peak`, per block, the most alive at once while backward
is in the block (from the first of its saved tensors backward reads to the next block's), of the
tensors its forward made or saved (its input, which the block before made) and those the backward
made (the gradient flowing in, the block's own buffers); `head_backward_peak`, the same for the
head; `front_backward_peak`, for the layers before the blocks (a convolutional front end, an
embedding), the most alive at once from the first of their saved tensors backward reads to its end.
At a convolution's backward each also counts the buffers its kernel allocates for itself
(`kernel_buffers`), which fake tensors cannot show. (Until 2026-12-04 a block's input, made in the block before, was left out: one input-sized
tensor under every traced block's backward, which the estimator's allowance for kernels' buffers
covered on most models and overshot on others: the zoo's frozen_tied, 13% over at world 1.) Every
storage an operator returns is held weakly, so it counts while it is alive. A model whose backward
fails on fake tensors has none of them (None), and the estimator counts its backward by rule.
"""

from __future__ import annotations

import functools
import json
import weakref
from dataclasses import dataclass, fields

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import models
from core.blocks import find_blocks
from core.config import RunConfig
from estimator.memory_model import Counts
from gptlite.model import GPTConfig, GPTLite, meta_model
from models.workload import Workload


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def trace(workload, micro_batch: int, block_class: str | None = None) -> dict:
    """One fp32 forward of `workload`'s model on `micro_batch` fake samples (real ones for a model
    whose forward reads data, models.Workload.traced): saved bytes by place."""
    return workload.traced(micro_batch, functools.partial(_trace, block_class=block_class))


class _Tracer:
    """What one traced forward and backward of a model keeps, by place (_trace): the hooks on its
    blocks, the saved-tensor hooks and each operator's outputs, and the bytes they add up."""

    def __init__(self, model, x, y, block_class: str | None):
        self.blocks = blocks = find_blocks(model, block_class)
        self.owned = {p.untyped_storage() for p in (*model.parameters(), *model.buffers())}
        # The batch is counted apart (`batch`): a first layer that saves its input for its weight's
        # gradient (a convolution on the image, an embedding on the token ids) keeps the batch itself,
        # not a new tensor (ViT and the CNN at micro-batch 8 were estimated 12-20% high counting it twice).
        self.owned |= {t.untyped_storage() for t in (x, y) if isinstance(t, torch.Tensor)}
        self.seen: set = set()
        self.keep = []  # the storages stay alive (and their ids unique) until the forward ends
        self.out = {"full": [0] * len(blocks), "kept": [0] * len(blocks), "largest": [0] * len(blocks), "before": 0,
                    "after": 0, "largest_after": 0, "ops": [{} for _ in blocks]}
        self.made: set = set()  # the storages an operator made (outputs that are views of older tensors are not new)
        # In forward, the block running; in backward (`backward_in`), the place whose saved tensor it read last.
        self.state = {"block": None, "finished": 0, "backward": False, "backward_in": None}
        # Every storage an operator makes: (weak reference, bytes, where it was made: a block's index,
        # "before" or "after" in forward, or "backward"); what is alive at each operator of the backward.
        self.live: dict[int, tuple] = {}
        # The place whose forward saved each storage first: a block's input is made in the block before it
        # (or before the blocks) and saved by it, alive in its backward as what it saved.
        self.saved_in: dict[int, object] = {}

    def where(self) -> object:
        i = self.state["block"]
        return i if i is not None else ("before" if self.state["finished"] < len(self.blocks) else "after")

    def pre(self, i, module, args):
        out, saved_in = self.out, self.saved_in
        self.state["block"] = i
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        out["kept"][i] = _nbytes(first) if first is not None else 0
        # The block's input is the block's, whoever saved it first: alive in its backward (what a
        # checkpoint keeps of it), and where the place before saved it too (a block that ends in a
        # ReLU saves its output), the place before keeps it only as long as this block does. Left
        # there, a checkpointed block's backward was an input short (the zoo's CNN).
        storage = first.untyped_storage() if first is not None else None
        place = saved_in.get(id(storage)) if storage is not None and storage in self.seen else None
        if place is not None and place != i:
            size = storage.nbytes()
            if isinstance(place, int):
                out["full"][place] -= size
            else:
                out[place] -= size
            out["full"][i] += size
            out["largest"][i] = max(out["largest"][i], size)
            saved_in[id(storage)] = i

    def post(self, i, module, args, output):
        self.state["block"] = None
        self.state["finished"] = max(self.state["finished"], i + 1)

    def pack(self, t: torch.Tensor):
        out = self.out
        storage = t.untyped_storage()
        if storage in self.owned or storage in self.seen:
            return self.where(), t
        self.seen.add(storage)
        self.keep.append(storage)
        self.saved_in[id(storage)] = self.where()
        size, i = storage.nbytes(), self.state["block"]
        if i is not None:
            out["full"][i] += size
            out["largest"][i] = max(out["largest"][i], size)
        else:
            w = self.where()
            out[w] += size
            if w == "after":
                out["largest_after"] = max(out["largest_after"], size)
        return self.where(), t

    def unpack(self, packed):
        # Backward is in the place whose saved tensor it reads.
        self.state["backward_in"] = packed[0]
        return packed[1]

    def alive(self, place) -> int:
        """The bytes alive of what `place`'s forward made or saved, and of what backward made."""
        return sum(size for key, (ref, size, made_in) in self.live.items()
                   if ref() is not None and (made_in in (place, "backward") or self.saved_in.get(key) == place))

    def operator_ran(self, func, args, result) -> None:
        """The bytes of an operator's new outputs, per block and operator name; in backward, the most
        alive at once in each block (its forward's tensors and backward's)."""
        out, state, live = self.out, self.state, self.live
        i = state["block"]
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage in self.owned:
                    continue
                entry = live.get(id(storage))
                if entry is None or entry[0]() is not storage:
                    live[id(storage)] = (weakref.ref(storage), storage.nbytes(),
                                         "backward" if state["backward"] else self.where())
                    self.saved_in.pop(id(storage), None)  # a new storage where a freed one's id was
                if i is not None and not state["backward"] and storage not in self.made:
                    self.made.add(storage)
                    self.keep.append(storage)
                    name = func.overloadpacket.__name__
                    out["ops"][i][name] = out["ops"][i].get(name, 0) + storage.nbytes()
        place = state["backward_in"]
        if place is None:
            return
        held = self.alive(place) + (kernel_buffers(func, args) if state["backward"] else 0)
        if isinstance(place, int):
            out["backward_peak"][place] = max(out["backward_peak"][place], held)
        elif place == "after":
            out["head_backward_peak"] = max(out["head_backward_peak"], held)
        else:  # the layers before the blocks (a convolutional front end, an embedding)
            out["front_backward_peak"] = max(out["front_backward_peak"], held)


class _OpOutputs(TorchDispatchMode):
    """Every operator the traced forward and backward run, reported to the tracer."""

    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.tracer.operator_ran(func, args, result)
        return result


def _trace(mode, model, x, y, block_class: str | None) -> dict:
    tracer = _Tracer(model, x, y, block_class)
    out, blocks = tracer.out, tracer.blocks
    handles = [b.register_forward_pre_hook(functools.partial(tracer.pre, i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(functools.partial(tracer.post, i)) for i, b in enumerate(blocks)]
    try:
        with torch.random.fork_rng(devices=[]), mode, _OpOutputs(tracer), \
                torch.autograd.graph.saved_tensors_hooks(tracer.pack, tracer.unpack):
            output, loss = model(x, y)
            out["output"] = output.numel() * 4
            out["batch"] = _nbytes(x) + _nbytes(y)
            # The backward, its gradients of parameters dropped as they are made (the backend's
            # part): what is alive at once in each block's backward, of its own forward's tensors and
            # the backward's (the gradient flowing in, the block's temporaries).
            tracer.seen.clear(), tracer.made.clear(), tracer.keep.clear()
            del output
            out.update(backward_peak=[0] * len(blocks), head_backward_peak=0, front_backward_peak=0)
            tracer.state["backward"] = True
            grads = [p.register_post_accumulate_grad_hook(_drop_grad) for p in model.parameters() if p.requires_grad]
            try:
                loss.backward()
            except Exception:  # noqa: BLE001 - a model fake tensors cannot run backward on: the rule instead
                out.update(backward_peak=None, head_backward_peak=None, front_backward_peak=None)
            finally:
                for h in grads:
                    h.remove()
    finally:
        for h in handles:
            h.remove()
    return out


def kernel_buffers(func, args) -> int:
    """The bytes an operator's kernel allocates for itself while it runs, beside the outputs it returns
    (fake tensors run no kernel, so the trace cannot see them): a convolution's backward. oneDNN's
    (torch's CPU convolutions) reorders the input into its own layout, and the input's gradient too
    where it is needed, else the output's gradient: measured on this suite's CPU (1-D and 2-D, stride 1
    and 2, 32 channels), the backward held 3.0 inputs at once beside what it read where it made the
    input's gradient (the gradient and two buffers), and one input and one output (1.2-2.0 inputs)
    where it made the weight's alone. Zero for any other operator."""
    if func.overloadpacket is not torch.ops.aten.convolution_backward:
        return 0
    grad_output, inp, mask = args[0], args[1], args[-1]

    def size(t) -> int:
        return t.numel() * t.element_size()

    return size(inp) + (size(inp) if mask[0] else size(grad_output))


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


@dataclass
class TracedModel:
    """A model's parameter counts and its traced activations at micro-batches 2 and 4."""

    name: str
    counts: Counts
    at2: dict
    at4: dict

    @classmethod
    def of(cls, workload, block_class: str | None = None) -> "TracedModel":
        model = workload.meta()
        blocks = find_blocks(model, block_class)
        sizes = [p.numel() for p in model.parameters()]
        per_block = [sum(p.numel() for p in b.parameters()) for b in blocks]
        root = sum(sizes) - sum(per_block)
        frozen = [p.numel() for p in model.parameters() if not p.requires_grad]
        frozen_per_block = [sum(p.numel() for p in b.parameters() if not p.requires_grad) for b in blocks]
        # FSDP's root unit; the part of it after the blocks (the head) is approximated as half.
        counts = Counts(sum(sizes), per_block, root, root // 2, len(sizes), sizes,
                        frozen_per_block if any(frozen_per_block) else [], sum(frozen) - sum(frozen_per_block),
                        len(frozen))
        return cls(workload.name, counts, trace(workload, 2, block_class), trace(workload, 4, block_class))

    @classmethod
    def of_gptlite(cls, cfg) -> "TracedModel":
        """GPT-lite of GPTConfig `cfg`, traced as any other model (its own activations are by formula;
        this gives what the formulas do not: each operator's outputs, for selective checkpointing)."""
        return _gptlite_cached(json.dumps(cfg.to_dict(), sort_keys=True))

    @property
    def n_blocks(self) -> int:
        return len(self.counts.per_block)

    def at(self, micro_batch: int) -> dict:
        """The traced quantities at `micro_batch`, on the line through the traces at 2 and 4."""
        def line(a, b):
            if a is None or b is None:  # not traced (a model whose backward failed on fake tensors)
                return None
            if isinstance(a, dict):
                return {k: line(a.get(k, 0), b.get(k, 0)) for k in {**a, **b}}
            if isinstance(a, list):
                return [line(u, v) for u, v in zip(a, b)]
            return max(0, int(a + (b - a) * (micro_batch - 2) / 2))
        return {k: line(self.at2[k], self.at4[k]) for k in self.at2}


class _Tokens:
    """Token ids of zeros, in CharDataset's batch interface: what tracing GPT-lite needs of data."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def batch(self, split, step, rank, world, micro_batch, batch):
        x = torch.zeros(batch, self.block_size, dtype=torch.long)
        return x, x


def _gptlite_workload(cfg):
    """GPT-lite of GPTConfig `cfg` as a workload, to count its FLOPs by operator."""
    return Workload("gptlite", {"name": "gptlite", **cfg.to_dict()}, _Tokens(cfg.block_size), lambda: GPTLite(cfg),
                    _meta=meta_model(cfg))


@functools.lru_cache(maxsize=16)
def _gptlite_cached(key: str) -> TracedModel:
    return TracedModel.of(_gptlite_workload(GPTConfig(**json.loads(key))))


@functools.lru_cache(maxsize=16)
def _cached(key: str) -> TracedModel:
    run = json.loads(key)
    cfg = RunConfig(**run)
    return TracedModel.of(models.load(cfg.model_request()), cfg.block_class)


def traced_for_run(run: dict) -> TracedModel:
    """The traced model of a config.json's `run` (every train.py flag), traced once per model."""
    names = {f.name for f in fields(RunConfig)}
    wanted = ("model", "model_name_or_path", "model_args", "data", "preset", "block_size", "dropout", "block_class")
    return _cached(json.dumps({k: run.get(k) for k in wanted if k in names and k in run}, sort_keys=True))
