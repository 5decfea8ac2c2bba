"""Zoo model: a small CNN with BatchNorm (benchmarks/zoo/__init__.py), as a user's model file.

    python train.py --model benchmarks/zoo/cnn_bn.py

Three 3x3 convolutions (the second with stride 2), each followed by BatchNorm and ReLU, global
average pooling and a linear classifier, on 3x16x16 images of 10 classes.
"""

import torch
import torch.nn as nn

CLASSES, SIZE = 10, 16


class ConvBN(nn.Module):
    """The repeated block: convolution, BatchNorm (running statistics: what recomputation must not
    update twice), ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = nn.Sequential(ConvBN(3, width, 1), ConvBN(width, 2 * width, 2), ConvBN(2 * width, 2 * width, 1))
        self.head = nn.Linear(2 * width, CLASSES)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=(2, 3)))


class Images(torch.utils.data.Dataset):
    """Image i drawn from its own generator: every rank reads the same data."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, SIZE, SIZE, generator=g), i % CLASSES


def get_model(width: int = 16):
    return SmallCNN(width)


def get_dataset():
    return Images(2000), Images(200)
