"""Models with conditional computation, as a model file (get_model / get_dataset), for the tests of
training/run.py check_unused and DDP's --find_unused_parameters (issue 39, case 7).

--model_args kind=...:
    moe          a top-1 mixture of experts: each sample goes to one of 4 experts by its gate, so in a
                 step of a few samples some experts get none (no gradient)
    unused_bias  a classifier with a bias the forward never uses
    late         uses its `rare` branch only on batches of at most 2 samples: the pre-training check
                 (2 samples) sees every parameter used, training at micro-batch 4 does not
"""

import torch
import torch.nn as nn

FEATURES, CLASSES, SAMPLES = 8, 4, 512


class Points(torch.utils.data.Dataset):
    """Gaussian points, a class each."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return torch.randn(FEATURES, generator=torch.Generator().manual_seed(i)), int(i % CLASSES)


class MoE(nn.Module):
    def __init__(self, width: int, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x):
        weights = self.gate(x).softmax(-1)
        choice = weights.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = choice == i
            if chosen.any():  # an expert no sample chose runs on nothing: its parameters get no gradient
                out[chosen] = expert(x[chosen]) * weights[chosen, i:i + 1]
        return x + out


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h):
        return h + torch.relu(self.fc(h))


class Model(nn.Module):
    def __init__(self, kind: str, width: int = 16):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(FEATURES, width)
        # The repeated blocks FSDP wraps: experts for the mixture, plain layers otherwise.
        self.moe = nn.ModuleList(MoE(width) for _ in range(2)) if kind == "moe" else None
        self.blocks = nn.ModuleList(Block(width) for _ in range(2)) if kind != "moe" else None
        self.rare = nn.Linear(width, width) if kind == "late" else None
        self.out = nn.Linear(width, CLASSES)
        self.unused = nn.Parameter(torch.zeros(CLASSES)) if kind == "unused_bias" else None

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for layer in self.moe or self.blocks:
            h = layer(h)
        if self.rare is not None and x.shape[0] <= 2:
            h = h + self.rare(h)
        return self.out(h)


def get_model(kind: str = "moe"):
    if kind not in ("moe", "unused_bias", "late"):
        raise ValueError(f"kind must be moe, unused_bias or late (got {kind!r})")
    return Model(kind)


def get_dataset():
    return Points()
