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
    plain = nn.Sequential(Stem(), nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"\(Sequential\) has no repeated block .*which backend fsdp needs; "
                                          "--block_class NAME or run without FSDP/checkpointing"):
        find_blocks(plain, needed_by="backend fsdp")
    assert find_blocks(plain) == []  # nothing needs blocks: a model without any is fine


def test_a_model_without_a_repeated_block_runs_where_nothing_needs_one(tmp_path):
    """single and ddp train it; FSDP, FSDP2, checkpointing and --compile need blocks: refused in one line
    before anything is recorded (training.run.prepare_run) (issue 21, case 11)."""
    from core.config import RunConfig
    from training.run import check_model, prepare_run

    path = tmp_path / "plain.py"
    path.write_text("import torch\n\ndef get_model():\n    return torch.nn.Linear(4, 3)\n\n"
                    "def get_dataset():\n    return [(torch.ones(4), i % 3) for i in range(20)]\n")
    for backend in ("single", "ddp"):
        assert check_model(RunConfig(model=str(path), backend=backend)).meta().net.out_features == 3
    for flags, needs in [({"backend": "fsdp"}, "backend fsdp"), ({"backend": "fsdp2"}, "backend fsdp2"),
                         ({"backend": "ddp", "ckpt_interval": 1}, "--ckpt_interval"),
                         ({"backend": "single", "compile": True}, "--compile")]:
        with pytest.raises(ConfigError, match=rf"\(Linear\) has no repeated block .*which {needs} needs; "
                                              "--block_class NAME or run without FSDP/checkpointing"):
            prepare_run(RunConfig(model=str(path), runs_dir=str(tmp_path / "runs"), run_name="r", **flags))
    assert not (tmp_path / "runs").exists()


def test_a_one_layer_transformer_has_no_repeated_block_and_runs_under_single():
    from core.config import RunConfig
    from training.run import check_model

    one_layer = {"model": "hf:gpt2", "model_args": "n_layer=1,n_embd=32,n_head=2"}
    check_model(RunConfig(backend="single", **one_layer))
    with pytest.raises(ConfigError, match=r"\(GPT2LMHeadModel\) has no repeated block .*which backend fsdp2 needs"):
        check_model(RunConfig(backend="fsdp2", **one_layer))
