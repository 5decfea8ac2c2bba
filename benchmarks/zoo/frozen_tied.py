"""Zoo model: frozen and tied parameters (benchmarks/zoo/__init__.py), as a user's model file.

    python train.py --model benchmarks/zoo/frozen_tied.py

A token MLP language model whose output layer is the embedding's transpose (tied weights) and whose
first block is frozen (requires_grad False): backward computes its input's gradient (the embedding
below it trains) but not its weights'.
"""

import torch
import torch.nn as nn

VOCAB, SEQ = 64, 16


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class FrozenTied(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.blocks[0].requires_grad_(False)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return (h @ self.embed.weight.t()).flatten(0, 1)  # tied: the embedding is the output layer


class Sequences(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        t = torch.randint(VOCAB, (SEQ + 1,), generator=g)
        return t[:-1], t[1:]


def get_model(width: int = 32):
    return FrozenTied(width)


def get_dataset():
    return Sequences(2000), Sequences(200)


def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target.flatten())
