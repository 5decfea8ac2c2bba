"""A Workload: the model a run trains, its data, and what the harness needs to know about both."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from gptlite.data import DataError
from gptlite.errors import ConfigError, one_line
from gptlite.model import on_meta
from models.spec import format_model_args

# The largest model (fp32 parameter bytes) that check() builds for real where the meta device cannot
# run it: every rank builds it, before any memory check of the run itself.
REAL_CHECK_BYTES = 2**30
IGNORE_INDEX = -100  # cross-entropy's targets that count for nothing (Hugging Face's padding labels)


def logits_of(output):
    """The logits in a model's output: the output itself, or its `.logits` (transformers' ModelOutput,
    what a model loaded with from_pretrained returns)."""
    logits = getattr(output, "logits", None)
    return logits if not isinstance(output, torch.Tensor) and isinstance(logits, torch.Tensor) else output


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of logits `output` (..., classes; or a ModelOutput's `.logits`) against
    class ids `target` (...), in fp32 (as GPT-lite computes its own): token prediction and image
    classification alike. Targets of IGNORE_INDEX (padding) count for nothing: the mean is over the others."""
    output = logits_of(output)
    return F.cross_entropy(output.reshape(-1, output.size(-1)).float(), target.reshape(-1),
                           ignore_index=IGNORE_INDEX)


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


# FakeTensorMode logs an op it cannot run on fake tensors at error level, with a traceback (transformers'
# Mixtral: grouped_mm's meta kernel takes bf16 only), though the caller goes on with real tensors (traced):
# a user reads that as the run failing.
FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


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
    # A causal language model: its logits at position t must not depend on the tokens after t (the
    # targets are those tokens). check() holds a built model to that where it is small enough.
    causal: bool = False
    # Builds the module without its weights where `make` loads them (a checkpoint: models/pretrained.py):
    # what meta() and fake() build instead of loading.
    structure: Callable[[], nn.Module] | None = None
    # A checkpoint a backend may load its own way (models/pretrained.PretrainedModel; Backend.build_model).
    pretrained: object | None = field(default=None, repr=False)
    _meta: nn.Module | None = field(default=None, repr=False)
    # Set by check(): the trainable parameters without a gradient on the check's samples (_without_gradient).
    unused_parameters: tuple[str, ...] = field(default=(), repr=False)

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
                with on_meta():
                    self._meta = (self.structure or self.make)()
            except ConfigError:
                raise
            except Exception:  # noqa: BLE001 - a user model that creates tensors on a named device
                try:
                    self._meta = self.build(0)
                except ConfigError:
                    raise
                except Exception as e:  # noqa: BLE001 - settings the model's own code refuses (HF's checks)
                    args = self.description.get("args")
                    settings = f" with --model_args {format_model_args(args)}" if args else ""
                    raise ConfigError(f"model {self.name}{settings} cannot be built: {one_line(e)}") from None
        return self._meta

    def fake(self, batch: int = 2):
        """(context, model, x, y): the model and `batch` samples as fake tensors (torch's FakeTensorMode:
        shapes and dtypes, no memory, no data), for counting FLOPs and tracing memory; run the model
        inside `context`. Unlike the meta device, libraries treat fake tensors as tracing (transformers
        skips its data-dependent checks). Two samples by default: batch normalisation refuses one in
        training mode."""
        mode = FakeTensorMode(allow_non_fake_inputs=False)
        x, y = self.example(batch)
        try:
            with torch.random.fork_rng(devices=[]), mode:
                model = (self.structure or self.make)()
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
            with _quiet(FAKE_TENSOR_LOG):
                return run(*self.fake(batch))
        except Exception:  # noqa: BLE001 - any failure on fake tensors; a real error recurs below
            x, y = self.example(batch)
            return run(contextlib.nullcontext(), self.build(0), x, y)

    def check(self) -> None:
        """The model and its data fit together, checked before anything is recorded (ConfigError or
        DataError, one line): a few samples of each split (their layout and shapes: SampledDataset.check),
        the model built (on the meta device), one forward and loss on two training samples (on the meta
        device; for real, on those two samples, where the meta device cannot run the model), a loss that
        is a scalar tensor with a gradient, and with the default cross-entropy, targets that are class ids
        of the model's output. Torch's RNG is left as it was: the run draws the same numbers with or
        without the check (a dataset or forward that draws from it)."""
        with torch.random.fork_rng(devices=[]):
            self._check()
            if self.causal and self.n_params * 4 <= REAL_CHECK_BYTES:
                self._check_causal()

    def _check_causal(self) -> None:
        """Change the last token of a real sample: the logits before it must stay as they were, or the
        model sees the tokens it is trained to predict (an encoder built as a language model)."""
        x, _ = self.example(1)
        changed = x.clone()
        changed[:, -1] = (x[:, -1] + 1) % max(int(x.max()) + 2, 2)
        model = self.build(0).eval()
        with torch.no_grad():
            before, after = model(x)[0], model(changed)[0]
        if not torch.allclose(before[:, :-1], after[:, :-1]):
            raise ConfigError(f"model {self.name}: its logits at a position change with the tokens after it: it is "
                              "not causal, and would learn from the tokens it is asked to predict (an encoder type "
                              "without a decoder mode); choose a causal language model type")

    def _check(self) -> None:
        check = getattr(self.data, "check", None)
        samples = check() if check is not None else []
        try:
            x, y = self.example(2)
        except DataError:
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the dataset is the user's code
            raise DataError(f"{self.name}: reading the first training batch failed: {one_line(e)}") from None
        ran = self._forward_once(x, y)
        if ran is None:
            return
        model, output, loss = ran
        custom = isinstance(self.meta(), WithLoss) and self.meta()._loss is not cross_entropy
        what = f"{self.name}: loss_fn" if custom else f"{self.name}: the loss"
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            got = f"a {loss.dtype} tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) \
                else type(loss).__name__
            raise ConfigError(f"model: {what} must return a scalar float tensor (got {got})")
        if not loss.requires_grad:
            raise ConfigError(f"model: {what} returned a tensor without a gradient: it does not depend on the "
                              "model's output (computed from numbers taken out of the graph, or under no_grad)")
        output = logits_of(output) if not custom else output
        if not custom and isinstance(self.meta(), WithLoss) and isinstance(output, torch.Tensor) and output.ndim:
            classes = output.shape[-1]
            for target in [y, *(torch.as_tensor(t) for _, t in samples)]:
                if target.is_floating_point() or not target.numel():
                    continue
                wrong = target[(target != IGNORE_INDEX) & ((target < 0) | (target >= classes))]
                if wrong.numel():
                    raise DataError(f"{self.name}: target {int(wrong[0])} is not a class of the model's output "
                                    f"({classes} classes: 0..{classes - 1}); with the default cross-entropy the "
                                    "targets are class ids (make the model's output cover them: its vocab_size or number of classes; "
                                    "or give a model file a loss_fn)")
        self.unused_parameters = _without_gradient(model, loss)

    def _forward_once(self, x: torch.Tensor, y: torch.Tensor):
        """(model, output, loss) of the model on (x, y): on the meta device (shapes only, no memory), else
        for real where the model is small enough to build here; None where neither can be done (the run's
        first step is then the check)."""
        try:
            with contextlib.ExitStack() as patches:
                for patch in self.fake_patches:
                    patches.enter_context(patch())
                model = self.meta()
                return (model, *model(x.to("meta"), y.to("meta")))
        except (Exception, SystemExit):  # noqa: BLE001 - e.g. data-dependent code (.item()): run it for real, below
            pass
        if self.n_params * 4 > REAL_CHECK_BYTES:
            return None
        try:
            model = self.build(0)
            return (model, *model(x, y))
        except ConfigError:
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the model's forward or loss_fn: the user's code
            raise ConfigError(f"model: {self.name}: the model and its data do not fit: forward and loss on 2 "
                              f"training samples (input {_shape(x)}, target {_shape(y)}) failed: {one_line(e)}") \
                from None

    @cached_property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.meta().parameters())

    @cached_property
    def param_sizes(self) -> list[int]:
        """Elements of each trainable parameter tensor, in the model's order (DDP buckets them)."""
        return [p.numel() for p in self.meta().parameters() if p.requires_grad]

    @cached_property
    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of the model's buffers, persistent or not, by dtype (BatchNorm's running statistics and
        its int64 count, a rotary table): what DDP broadcasts from rank 0 before each step's first forward."""
        out: dict[str, int] = {}
        for b in self.meta().buffers():
            dtype = str(b.dtype).removeprefix("torch.")
            out[dtype] = out.get(dtype, 0) + b.numel() * b.element_size()
        return out

    @cached_property
    def n_trainable(self) -> int:
        """The parameters that get a gradient: what the gradients' collectives carry."""
        return sum(self.param_sizes)

    def example(self, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `batch` training samples of step 0 (x, y), for tracing and counting."""
        return self.data.batch("train", 0, 0, 0, batch, batch)


def _without_gradient(model: nn.Module, loss: torch.Tensor) -> tuple[str, ...]:
    """The trainable parameters the loss's backward gives no gradient on the check's samples: conditional
    computation (experts of a mixture that got no token, a branch or a parameter the forward never uses).
    One process leaves them alone; the backends differ (training/run.py check_unused). autograd.grad, so
    no .grad is left on the model."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    try:
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    except Exception:  # noqa: BLE001 - a backward the meta device cannot run: nothing learned here
        return ()
    return tuple(n.removeprefix("net.") for (n, _), g in zip(named, grads) if g is None)


def _shape(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


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
