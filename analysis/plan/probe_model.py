"""The model the planner measures each configuration's own costs on (analysis/plan/backend_costs.py), as
a model file: a stack of `layers` residual blocks (a d x d Linear with its bias, a LayerNorm: four
parameter tensors each), `width` wide (64 by default, the data's vectors' width), over random vectors,
classified into 8 classes. Small enough that a step is
mostly the configuration's own work (its hooks, flattening, collective calls, optimizer), and not a
model the planner is validated on (benchmarks/zoo).

    python train.py --model analysis/plan/probe_model.py --model_args layers=12
    python train.py --model analysis/plan/probe_model.py --model_args layers=12,width=128
"""

import torch
import torch.nn as nn

CLASSES = 8


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.relu(self.linear(self.norm(x)))


class Probe(nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        # Wider than the data's vectors: one Linear up to `width` first (two tensors more).
        self.up = nn.Linear(WIDTH, width) if width != WIDTH else None
        self.blocks = nn.ModuleList([Block(width) for _ in range(layers)])
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        if self.up is not None:
            x = self.up(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Vectors(torch.utils.data.Dataset):
    def __init__(self, n: int, width: int):
        self.n, self.width = n, width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.width, generator=g), torch.randint(CLASSES, (), generator=g)


WIDTH = 64


def get_model(layers: int = 2, width: int = WIDTH):
    return Probe(layers, width)


def get_dataset():
    return Vectors(2000, WIDTH), Vectors(200, WIDTH)
