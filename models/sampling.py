"""Deterministic batches from any map-style dataset (`len(ds)`, `ds[i] -> (x, y)`).

The same rule as GPT-lite's character windows (gptlite/data.py): the sample indices of a step's
global batch are a pure function of (seed, split, step), drawn with replacement, and each rank
reads its own contiguous slice of them. So every backend and world size sees the same samples at
every step, and resuming needs no sampler state.
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from gptlite.data import TRAIN_FRACTION, DataError, draw_indices


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

    def batch(self, split: str, seed: int, step: int, global_index: int, size: int, global_batch: int):
        """Samples [global_index, global_index + size) of `step`'s global batch: (x, y), batched."""
        ds = self.splits[split]
        indices = draw_indices(split, seed, step, global_batch, len(ds))[global_index: global_index + size]
        batch = default_collate([ds[int(i)] for i in indices])
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            raise DataError(f"{self.source}: a sample must be a pair (input, target), got {type(ds[0]).__name__}")
        return batch[0], batch[1]

    def describe(self) -> dict:
        x, y = self.splits["train"][0]
        return {"source": self.source, "train_samples": len(self.splits["train"]),
                "val_samples": len(self.splits["val"]),
                "sample": {"input": list(getattr(x, "shape", ())), "target": list(getattr(y, "shape", ()))}}


def _length(ds, source: str) -> int:
    try:
        return len(ds)
    except TypeError:
        raise DataError(f"{source}: a map-style dataset is needed (with __len__ and __getitem__); "
                        f"{type(ds).__name__} has no length") from None
