"""core.blocks.find_blocks: the repeated block of any model."""

import pytest
import torch.nn as nn

from core.blocks import find_blocks
from gptlite.errors import ConfigError
from gptlite.model import Block, meta_model, preset


def test_gptlite_blocks_are_its_blocks_in_order():
    model = meta_model(preset("small"))
    found = find_blocks(model)
    assert all(isinstance(b, Block) for b in found) and found == list(model.blocks)


class Head(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width // 4)


class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.heads = nn.ModuleList(Head(width) for _ in range(4))  # 12 heads in all: more numerous, smaller
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return self.mlp(x)


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Linear(8, 8)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = Stem()
        self.layers = nn.Sequential(*(Layer(8) for _ in range(3)))


def test_the_class_holding_most_parameters_wins_over_more_numerous_parts_and_containers():
    model = Toy()
    found = find_blocks(model)
    assert found == list(model.layers)  # not the 12 heads, not the Sequentials (containers)


def test_a_named_class_and_the_errors():
    model = Toy()
    assert find_blocks(model, "Stem") == [model.stem]
    with pytest.raises(ConfigError, match="block_class Attention: no such module class.*found: Head, Layer, Stem"):
        find_blocks(model, "Attention")
    with pytest.raises(ConfigError, match="no repeated module class"):
        find_blocks(nn.Sequential(Stem(), nn.Linear(2, 2)))
