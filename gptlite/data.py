"""Character data for GPT-lite: tokenizer, train/validation split, deterministic batches.

Samples are random windows of the text (x, and y = x shifted by one), as in the article, but each
window's start is a pure function of (seed, split, step, global sample index). So every backend,
at every world size and gradient-accumulation setting, sees exactly the same global batch at each
step; a rank reads only its own contiguous slice of it, and no state needs saving to resume.

Global sample layout of one optimizer step with `world` ranks, `accum` micro-steps of `micro`
samples each: rank r owns indices [r * micro * accum, (r + 1) * micro * accum), and its micro-step
m takes the m-th run of `micro` indices within that slice.
"""

from __future__ import annotations

from dataclasses import dataclass
import os
from pathlib import Path

import numpy as np
import torch

from gptlite import corpus

TRAIN_FRACTION = 0.9
_SPLIT_IDS = {"train": 0, "val": 1}


class DataError(ValueError):
    """The data file cannot be used. The message says which file and why."""


def draw_indices(split: str, seed: int, step: int, n: int, high: int) -> np.ndarray:
    """The first `n` sample indices in [0, high) of `step`'s global batch: a pure function of its
    inputs. Raw Philox output (a counter-based stream numpy keeps stable across versions, unlike
    Generator.integers), keyed by (seed, split) and counted from the step."""
    bits = np.random.Philox(key=[seed, _SPLIT_IDS[split]], counter=[0, 0, step, 0])
    return (bits.random_raw(n) % np.uint64(high)).astype(np.int64)


@dataclass(frozen=True)
class CharTokenizer:
    chars: str  # the sorted distinct characters; token id = index

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Token ids in the smallest unsigned dtype that holds the vocabulary (every character of `text`
        must be in it). Vectorised: code points, then their positions in the sorted vocabulary."""
        dtype = np.uint8 if self.vocab_size <= 256 else np.uint16 if self.vocab_size <= 65536 else np.uint32
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        vocab = np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)  # sorted (from_text sorts)
        ids = np.searchsorted(vocab, points)
        if len(points) and (ids.max() >= len(vocab) or not np.array_equal(vocab[ids], points)):
            missing = sorted(set(text) - set(self.chars))
            raise KeyError(missing[0])  # as the dict lookup this replaces did
        return ids.astype(dtype)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def read_text(path: str | None) -> tuple[str, str]:
    """The corpus text and a description of where it came from (None: the embedded default)."""
    if path is None:
        return corpus.generate(), f"embedded default corpus (seed {corpus.DEFAULT_SEED})"
    p = Path(path)
    if not os.path.exists(p):  # never raises (a name too long for the filesystem is not found)
        raise DataError(f"--data: file not found: {path}")
    if not os.path.isfile(p):
        raise DataError(f"--data: not a regular file: {path}")
    raw = p.read_bytes()
    if not raw:
        raise DataError(f"--data: file is empty: {path}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data: not UTF-8 text ({e.reason} at byte {e.start}): {path}") from None
    return text, str(p.resolve())


class CharDataset:
    """The encoded corpus split 90/10 and a sampler of deterministic windows."""

    def __init__(self, text: str, block_size: int, source: str = "text"):
        self.source = source
        self.block_size = block_size
        self.tokenizer = CharTokenizer.from_text(text)
        # numpy, not torch: the corpus is host data, not training memory, and torch.profiler's
        # memory profile (the CPU memory measurement) counts only torch tensors.
        data = self.tokenizer.encode(text)
        cut = int(TRAIN_FRACTION * len(data))
        self.splits = {"train": data[:cut], "val": data[cut:]}
        for split, tokens in self.splits.items():
            # A window needs block_size + 1 tokens (inputs and the shifted targets).
            if len(tokens) < block_size + 1:
                raise DataError(
                    f"--data: too short for block_size {block_size}: the {split} split has "
                    f"{len(tokens)} characters, needs at least {block_size + 1} "
                    f"(the whole file at least {int((block_size + 1) / (1 - TRAIN_FRACTION)) + 1})"
                )

    @classmethod
    def load(cls, path: str | None, block_size: int) -> "CharDataset":
        text, source = read_text(path)
        return cls(text, block_size, source)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def window_starts(self, split: str, seed: int, step: int, n: int) -> np.ndarray:
        """Start offsets of the first `n` global samples of `step`: a pure function of its inputs."""
        return draw_indices(split, seed, step, n, len(self.splits[split]) - self.block_size)

    def describe(self) -> dict:
        """The record's description of the data (config.json's `data`)."""
        return {"source": self.source, "vocab_size": self.vocab_size, "train_tokens": len(self.splits["train"]),
                "val_tokens": len(self.splits["val"])}

    def batch(
        self, split: str, seed: int, step: int, global_index: int, size: int, global_batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [global_index, global_index + size) of `step`'s global batch: (x, y), each (size, T)."""
        starts = self.window_starts(split, seed, step, global_batch)[global_index : global_index + size]
        windows = torch.from_numpy(self.splits[split][starts[:, None] + np.arange(self.block_size + 1)]).long()
        return windows[:, :-1], windows[:, 1:]


@dataclass(frozen=True)
class BatchLayout:
    """Where one rank's micro-batches sit inside the global batch of a step."""

    micro_batch: int
    grad_accum: int
    world_size: int
    rank: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    def micro_start(self, micro_step: int) -> int:
        return (self.rank * self.grad_accum + micro_step) * self.micro_batch

    def micro_weights(self, data, split: str, seed: int, step: int) -> list[float] | None:
        """What the mean loss of each of this rank's micro-batches of `step` weighs, so that the mean over
        the micro-batches and the ranks is the mean over all the targets of the global batch that count:
        for samples whose counted targets differ (padding: TokenizedText.target_counts), a micro-batch
        weighs its share of them times the number of micro-batches. None where every sample counts the
        same (weight 1: character windows, packed text, any other dataset)."""
        counts_of = getattr(data, "target_counts", None)
        counts = counts_of(split, seed, step, self.global_batch) if counts_of is not None else None
        if counts is None:
            return None
        total, parts = int(counts.sum()), self.grad_accum * self.world_size
        return [int(counts[s: s + self.micro_batch].sum()) * parts / total
                for s in map(self.micro_start, range(self.grad_accum))]

    def micro_batches(self, data, split: str, seed: int, step: int):
        """This rank's `grad_accum` micro-batches of `step`, in order. `data`: anything with CharDataset's
        `batch` (models/sampling.py's SampledDataset for any map-style dataset)."""
        for m in range(self.grad_accum):
            yield data.batch(split, seed, step, self.micro_start(m), self.micro_batch, self.global_batch)
