"""Deterministic batches from any map-style dataset (`len(ds)`, `ds[i]`).

The same rule as GPT-lite's character windows (gptlite/data.py): the sample indices of a step's
global batch are a pure function of (seed, split, step), drawn with replacement, and each rank
reads its own contiguous slice of them. So every backend and world size sees the same samples at
every step, and resuming needs no sampler state.

A sample is an (input, target) pair, or a dict in one of Hugging Face datasets' layouts (ITEM_KEYS:
`{"input_ids", "labels"}` for text, `{"pixel_values", "labels"}` for images); input and target are
tensors, numpy arrays, numbers or (nested) lists of numbers, of the same shape in every sample.
`check()` reads a few samples of each split before anything runs, so that a dataset of another
shape is refused in one line (DataError) rather than at the first step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import default_collate

from gptlite.data import TRAIN_FRACTION, DataError, draw_indices
from gptlite.errors import one_line

# The dict layouts a sample may have (Hugging Face datasets' column names): (input key, target key).
ITEM_KEYS = (("input_ids", "labels"), ("pixel_values", "labels"))
LAYOUTS = "an (input, target) pair, or a dict {input_ids, labels} or {pixel_values, labels}"


def as_pair(item, where: str) -> tuple:
    """A sample as (input, target); lists become tensors (default_collate would transpose them)."""
    if isinstance(item, dict):
        keys = next((k for k in ITEM_KEYS if set(item) == set(k)), None)
        if keys is None:
            raise DataError(f"{where} is a dict with keys {sorted(item)}; a sample must be {LAYOUTS}")
        item = (item[keys[0]], item[keys[1]])
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        got = f"a {type(item).__name__} of {len(item)}" if isinstance(item, (tuple, list)) else type(item).__name__
        raise DataError(f"{where} is {got}; a sample must be {LAYOUTS}")
    return tuple(_tensor(v, f"{where}: its {part}") for v, part in zip(item, ("input", "target")))


def _tensor(value, where: str):
    if isinstance(value, (torch.Tensor, np.ndarray, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise DataError(f"{where} is a list that is not a rectangular array of numbers ({one_line(e)})") from None
    raise DataError(f"{where} is a {type(value).__name__}; inputs and targets must be tensors, numpy arrays, "
                    "numbers or lists of numbers")


class SampledDataset:
    """A train and a validation dataset behind CharDataset's `batch` interface."""

    def __init__(self, train, val=None, source: str = "dataset"):
        if val is None:  # one dataset: the first 90% train, the rest validation, as for text
            n = _length(train, source)
            cut = int(TRAIN_FRACTION * n)
            if cut < 1 or cut >= n:
                raise DataError(f"{source}: {n} samples are too few to split into training and validation")
            train, val = torch.utils.data.Subset(train, range(cut)), torch.utils.data.Subset(train, range(cut, n))
        self.splits = {"train": train, "val": val}
        self.source = source
        for split, ds in self.splits.items():
            if _length(ds, f"{source} ({split})") < 1:
                raise DataError(f"{source}: the {split} dataset is empty")

    def sample(self, split: str, i: int) -> tuple:
        return as_pair(self.splits[split][int(i)], f"{self.source}: sample {int(i)} of the {split} split")

    def batch(self, split: str, seed: int, step: int, global_index: int, size: int, global_batch: int):
        """Samples [global_index, global_index + size) of `step`'s global batch: (x, y), batched."""
        ds = self.splits[split]
        indices = draw_indices(split, seed, step, global_batch, len(ds))[global_index: global_index + size]
        pairs = [self.sample(split, i) for i in indices]
        try:
            return default_collate([x for x, _ in pairs]), default_collate([y for _, y in pairs])
        except (TypeError, RuntimeError) as e:  # samples check() did not read differ from those it did
            raise DataError(f"{self.source}: samples {[int(i) for i in indices]} of the {split} split cannot be "
                            f"batched; every sample must have the same shape ({one_line(e)})") from None

    def check(self) -> list[tuple]:
        """Read the first, second and last sample of each split: each one a sample of a layout we
        accept, all of one shape and dtype, and batchable. Returns them ((x, y) pairs, train first).
        User code (the dataset's __getitem__) failing here is bad input too, said in one line."""
        samples, first = [], {}
        for split, ds in self.splits.items():
            n = len(ds)
            for i in sorted({0, min(1, n - 1), n - 1}):
                try:
                    x, y = self.sample(split, i)
                except DataError:
                    raise
                except (Exception, SystemExit) as e:  # noqa: BLE001 - the dataset is the user's code
                    raise DataError(f"{self.source}: reading sample {i} of the {split} split failed: "
                                    f"{one_line(e)}") from None
                for part, value in (("input", x), ("target", y)):
                    kind = _kind(value, f"{self.source}: the {part} of sample {i} of the {split} split")
                    where, expected = first.setdefault(part, (f"sample {i} of the {split} split", kind))
                    if kind != expected:
                        raise DataError(f"{self.source}: samples differ: the {part} of sample {i} of the {split} "
                                        f"split is {kind}, that of {where} {expected}; every sample must have the "
                                        "same shape (a batch stacks them)")
                samples.append((x, y))
        if all(_same_ids(x, y) for x, y in samples):
            raise DataError(f"{self.source}: the target equals the input in every sample read ({len(samples)}): "
                            "the target of position t is what the model must predict there; for next-token "
                            "prediction, the next token (labels[t] = input_ids[t + 1]): Hugging Face's models shift "
                            "labels inside, this suite's loss does not")
        try:
            default_collate([x for x, _ in samples]), default_collate([y for _, y in samples])
        except (TypeError, RuntimeError) as e:
            raise DataError(f"{self.source}: samples cannot be batched ({one_line(e)})") from None
        return samples

    def describe(self) -> dict:
        x, y = self.sample("train", 0)
        return {"source": self.source, "train_samples": len(self.splits["train"]),
                "val_samples": len(self.splits["val"]),
                "sample": {"input": list(getattr(x, "shape", ())), "target": list(getattr(y, "shape", ()))},
                "held_tensor_bytes": held_bytes(self.held_tensors())}

    def held_tensors(self) -> list[torch.Tensor]:
        return held_tensors(self.splits)


def held_tensors(obj, depth: int = 6) -> list[torch.Tensor]:
    """The torch tensors a dataset object holds (TensorDataset's tensors, a Subset's dataset, a user
    dataset's attributes, lists and dicts of them), each storage once: the data that lives in the
    same memory as training on a CPU, which the memory profile counts (as `data`) and the estimate
    adds. Numpy arrays and files are not torch memory, and are not counted by either."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(value, left: int) -> None:
        if isinstance(value, torch.Tensor):
            if value.untyped_storage().nbytes():
                found.setdefault(value.untyped_storage().data_ptr(), value)
            return
        if left == 0 or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(value))
        if isinstance(value, dict):
            items = list(value.values())
        elif isinstance(value, (list, tuple, set)):
            items = list(value) if len(value) <= 64 else []  # a list of samples is not walked one by one
        elif hasattr(value, "__dict__") and not callable(value):
            items = list(vars(value).values())
        else:
            items = []
        for item in items:
            walk(item, left - 1)

    walk(obj, depth)
    return list(found.values())


def held_bytes(tensors) -> dict[str, int]:
    """{device type: bytes} of `tensors` (held_tensors: each storage once)."""
    out: dict[str, int] = {}
    for t in tensors:
        out[t.device.type] = out.get(t.device.type, 0) + t.untyped_storage().nbytes()
    return out


def _same_ids(x, y) -> bool:
    """x and y are the same sequence of integer ids (labels copied from input_ids, unshifted)."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    return (x.ndim >= 1 and x.shape == y.shape and not x.is_floating_point() and not y.is_floating_point()
            and bool(((x == y) | (y == -100)).all()))


def _kind(value, where: str) -> str:
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise DataError(f"{where} is a {type(value).__name__} that is not an array of numbers ({one_line(e)})") \
            from None
    return f"{'a float' if t.dtype.is_floating_point else 'an integer'} of shape {list(t.shape)}"


def _length(ds, source: str) -> int:
    try:
        return len(ds)
    except TypeError:
        raise DataError(f"{source}: a map-style dataset is needed (with __len__ and __getitem__); "
                        f"{type(ds).__name__} has no length") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the dataset's own __len__
        raise DataError(f"{source}: len() of the dataset failed: {one_line(e)}") from None
