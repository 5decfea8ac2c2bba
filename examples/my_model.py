"""Your own model for train.py: `--model examples/my_model.py` (docs/models.md, "Your own model").

The article's two functions are all train.py needs: get_model() returns any torch.nn.Module and
get_dataset() any map-style torch Dataset of (input, target) pairs (or a (train, validation) pair
of them). Every backend trains what they return; nothing here knows about DDP, FSDP or DeepSpeed.
A sample may also be a dict in Hugging Face datasets' layouts, {"input_ids", "labels"} (labels:
the token each position must predict, shifted by one for next-token prediction) or
{"pixel_values", "labels"}; get_model's annotations (width: int) are checked against --model_args.

Here: a residual MLP that classifies points of a fixed random mixture of 10 Gaussians.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURES, CLASSES = 32, 10


class ResidualBlock(nn.Module):
    """The repeated block: what FSDP wraps, FSDP2 shards and activation checkpointing targets
    (found on its own: the repeated module class holding the most parameters)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPClassifier(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # logits: the default loss is their cross-entropy with the targets


class GaussianMixture(torch.utils.data.Dataset):
    """`n` points; point i is drawn from its own generator, so every rank reads the same data."""

    def __init__(self, n: int):
        self.n = n
        self.centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        label = i % CLASSES
        noise = torch.randn(FEATURES, generator=torch.Generator().manual_seed(i))
        return self.centres[label] + noise, label


def get_model(width: int = 128, depth: int = 4) -> nn.Module:
    # Called with --model_args (e.g. --model_args width=256,depth=8), under the run's seed.
    return MLPClassifier(width, depth)


def get_dataset():
    return GaussianMixture(20_000)  # split 90/10 into training and validation


# Optional: the loss of a batch from the model's output. Without it, train.py uses cross-entropy.
def loss_fn(output, target):
    return F.cross_entropy(output, target)
