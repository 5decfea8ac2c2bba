"""Any model: naming it, building it, its data and its FLOPs, in-process (no launcher)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import models
from core.config import RunConfig
from core.flops import sample_flops
from gptlite.data import BatchLayout, DataError
from gptlite.errors import ConfigError
from models.sampling import SampledDataset
from models.spec import kind_of, model_label, parse_model_args

EXAMPLE = "examples/my_model.py"
GPT2_ARGS = "n_layer=2,n_embd=64,n_head=4"


def workload(**flags) -> models.Workload:
    return models.load(RunConfig(**flags).model_request())


def test_model_args_are_key_value_pairs_read_as_yaml():
    assert parse_model_args("n_layer=4,depths=[2,2,2,2],layer_type=basic,ratio=0.5,flag=true") == {
        "n_layer": 4, "depths": [2, 2, 2, 2], "layer_type": "basic", "ratio": 0.5, "flag": True}
    assert parse_model_args(None) == {} and parse_model_args("") == {}
    for bad in ("n_layer", "=4", "a=1,a=2", "x=[1,2"):
        with pytest.raises(ConfigError, match="model_args"):
            parse_model_args(bad)
    # A comma inside brackets or quotes does not split; brackets or quotes left open are refused.
    assert parse_model_args("d=[1,2],s='a,b'") == {"d": [1, 2], "s": "a,b"}
    for bad in ("x=[1,2", "x=[1,2,y=3", "x={a: 1", "s='a,b"):
        with pytest.raises(ConfigError, match=r"^model_args: unbalanced brackets or quotes in "):
            parse_model_args(bad)


def test_model_names_say_their_kind():
    assert [kind_of(n) for n in ("gptlite", "hf:gpt2", "torchvision:resnet18", "my/model.py", "pkg.mod")] == [
        "gptlite", "hf", "torchvision", "file", "module"]
    assert [model_label(n) for n in ("hf:llama", "examples/my_model.py", "pkg.mod")] == ["hf_llama", "my_model", "mod"]
    for bad in ("hf:", "not a name", "hf:gpt 2"):
        with pytest.raises(ConfigError, match="model"):
            RunConfig(model=bad)


def test_gptlite_size_flags_are_refused_for_other_models():
    with pytest.raises(ConfigError, match="n_layer applies to --model gptlite"):
        RunConfig(model="hf:gpt2", n_layer=2)
    with pytest.raises(ConfigError, match="model_args apply to"):
        workload(model_args="n_layer=2")  # GPT-lite is sized by its flags


def test_hf_causal_lm_takes_its_vocabulary_and_context_from_the_data():
    w = workload(model="hf:gpt2", model_args=GPT2_ARGS, block_size=32, dropout=0.0)
    net = w.meta().net
    assert type(net).__name__ == "GPT2LMHeadModel"
    assert net.config.vocab_size == w.data.vocab_size and net.config.n_positions == 32 == w.tokens_per_sample
    assert all(getattr(net.config, k) == 0.0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
    assert w.description["task"] == "causal_lm" and w.description["args"] == parse_model_args(GPT2_ARGS)


def test_hf_settings_are_checked_against_the_model_type():
    with pytest.raises(ConfigError, match="hf:gpt2 has no setting n_layers"):
        workload(model="hf:gpt2", model_args="n_layers=2")
    with pytest.raises(ConfigError, match="not a transformers model type"):
        workload(model="hf:nosuchmodel")


@pytest.mark.parametrize("args, name", [("n_layer=-1", "n_layer"), ("n_layer=0", "n_layer"), ("n_embd=0", "n_embd"),
                                        ("num_hidden_layers=0", "n_layer"), ("n_head=2.5", "n_head")])
def test_hf_counts_and_sizes_are_integers_of_at_least_one(args, name):
    """transformers built a GPT-2 of n_layer=-1 (no blocks) and the run was recorded ok (issue 39, case 4)."""
    with pytest.raises(ConfigError, match=rf"model_args: {args.split('=')[0]}=.*hf:gpt2's {name} is a count or a size"):
        workload(model="hf:gpt2", model_args=",".join([args, *(a for a in GPT2_ARGS.split(",") if a.split("=")[0] != name)]))
    assert workload(model="hf:gpt2", model_args="n_layer=1,n_embd=64,n_head=4").meta().net.config.n_layer == 1


MIXTRAL = ("hf:mixtral", "num_hidden_layers=1,hidden_size=32,num_attention_heads=2,num_key_value_heads=2,"
                         "intermediate_size=64,num_local_experts=4,num_experts_per_tok=1")


@pytest.mark.parametrize("extra", ["output_router_logits=true", "router_aux_loss_coef=0.5"])
def test_a_routers_own_loss_is_refused_not_dropped(extra):
    """Mixtral's router loss was accepted and silently dropped (the harness trains cross-entropy on the
    logits; issue 39, case 8)."""
    with pytest.raises(ConfigError, match=rf"model_args: {extra.split('=')[0]}=.*router loss .* leave it unset"):
        workload(model=MIXTRAL[0], model_args=f"{MIXTRAL[1]},{extra}", preset="tiny")


def test_flops_of_a_model_fake_tensors_cannot_run_are_counted_without_an_error_log():
    """Mixtral's grouped_mm has a bf16-only meta kernel: FakeTensorMode logged a traceback at error level
    on every run, though the count went on with real tensors (issue 39, case 9)."""
    import logging

    from models.workload import FAKE_TENSOR_LOG

    class Kept(logging.Handler):
        records: list = []

        def emit(self, record):
            self.records.append(record)

    handler = Kept(level=logging.DEBUG)
    logging.getLogger(FAKE_TENSOR_LOG).addHandler(handler)
    try:
        w = workload(model=MIXTRAL[0], model_args=MIXTRAL[1], preset="tiny")
        flops = sample_flops(w, None, 0)
    finally:
        logging.getLogger(FAKE_TENSOR_LOG).removeHandler(handler)
    assert flops["source"] == "counted" and flops["model"] > 0
    assert not [r for r in handler.records if r.levelno >= logging.ERROR], handler.records[0].getMessage()


def test_mixtrals_experts_are_counted_each_routed_expert_three_matmuls_forward_and_twice_back():
    """transformers' Mixtral runs its experts through aten._grouped_mm, which torch's counter gave 0
    (issue 40): one more expert per token must add, per sample of 64 tokens, 3 matmuls of 32 x 64
    forward (2 FLOPs per weight each) and twice that backward."""
    counts = []
    for k in (1, 2):
        args = MIXTRAL[1].replace("num_experts_per_tok=1", f"num_experts_per_tok={k}")
        counts.append(sample_flops(workload(model=MIXTRAL[0], model_args=args, preset="tiny"), None, 0))
    per_token = 3 * (3 * 2 * 32 * 64)
    assert counts[1]["counted"] - counts[0]["counted"] == 64 * per_token
    assert counts[0]["uncounted"] == counts[1]["uncounted"] == []


def test_sdpa_on_a_cpu_counts_its_attention_core_as_explicit_matmuls_do():
    """On real CPU tensors scaled_dot_product_attention runs _scaled_dot_product_flash_attention_for_cpu,
    which torch's counter gave 0 (issue 40; every HF model on sdpa lost its attention core): it must
    count what the same attention written as matmuls counts, forward and backward, plus the scores
    QK^T once more: a flash kernel recomputes them in backward, and torch counts its GPU flash
    kernels so."""
    from core.flops import counted_flops

    class Attention(torch.nn.Module):
        def __init__(self, fused):
            super().__init__()
            self.fused = fused

        def forward(self, q, k, v):
            if self.fused:
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            else:
                out = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v
            return out.sum()

    def count(fused):
        q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
        ran = set()
        return counted_flops(Attention(fused), q, k, v, ran=ran), ran

    (fused, ran), (explicit, _) = count(True), count(False)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ran  # the kernel under test ran
    scores = 2 * (2 * 4) * 16 * 16 * 8  # QK^T: batch x heads products of 16 x 8 by 8 x 16
    assert explicit > 0 and fused == explicit + scores


def test_an_op_that_multiplies_but_has_no_formula_is_named_not_counted_as_zero():
    from core.flops import uncounted_ops

    assert uncounted_ops({"mm", "_grouped_mm", "_scaled_dot_product_flash_attention_for_cpu", "add", "relu"}) == []
    assert uncounted_ops({"mm", "my_lib_fused_attention", "custom_matmul", "add"}) == ["custom_matmul",
                                                                                        "my_lib_fused_attention"]


def test_hf_resnet18_is_the_articles_resnet18_on_cifar_shaped_images():
    w = workload(model="hf:resnet", model_args="layer_type=basic,depths=[2,2,2,2],hidden_sizes=[64,128,256,512]")
    assert w.n_params == 11_181_642  # torchvision's resnet18(num_classes=10) has the same count
    x, y = w.example(3)
    assert x.shape == (3, 3, 32, 32) and y.tolist() == [int(v) for v in y] and w.tokens_per_sample is None
    assert w.data.describe()["train_samples"] == 50_000


def test_a_built_model_depends_on_the_seed_alone():
    w = workload(model="hf:llama", model_args="num_hidden_layers=1,hidden_size=32,num_attention_heads=2,"
                                               "intermediate_size=64")
    torch.manual_seed(123)
    a = w.build(7).state_dict()
    torch.manual_seed(456)
    b, c = w.build(7).state_dict(), w.build(8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i


def test_any_dataset_gives_every_world_size_the_same_global_batch():
    data = SampledDataset(Numbers())
    assert len(data.splits["train"]) == 90 and len(data.splits["val"]) == 10

    def global_batch(world, accum, micro):
        xs = [x for r in range(world)
              for x, _ in BatchLayout(micro, accum, world, r).micro_batches(data, "train", 5, 3)]
        return torch.cat(xs).flatten().tolist()

    one = global_batch(1, 1, 8)
    assert one == global_batch(2, 1, 4) == global_batch(2, 2, 2) == global_batch(4, 2, 1)
    assert max(one) < 90 and one != global_batch(1, 1, 8)[::-1]
    assert one != SampledDataset(Numbers()).batch("train", 6, 3, 0, 8, 8)[0].flatten().tolist()  # another seed


def write_model_file(tmp_path, body: str) -> str:
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_model_file_is_checked_before_anything_runs(tmp_path):
    cases = [
        ("def get_model(): pass\n", "defines no get_dataset()"),
        ("raise RuntimeError('boom')\n", "importing .* failed: RuntimeError: boom"),
        ("def get_model(width=1): pass\ndef get_dataset(): return [1, 2]\n", "model_args: .*does not take them"),
    ]
    for body, message in cases:
        with pytest.raises(ConfigError, match=message):
            workload(model=write_model_file(tmp_path, body), model_args="depth=2")
    with pytest.raises(ConfigError, match="file not found"):
        workload(model=str(tmp_path / "missing.py"))
    with pytest.raises(DataError, match="too few to split"):
        workload(model=write_model_file(tmp_path, "def get_model(): pass\ndef get_dataset(): return [(1, 1)]\n"))


def test_the_example_file_trains_with_its_own_loss():
    w = workload(model=EXAMPLE, model_args="width=32,depth=3")
    model = w.build(0)
    x, y = w.example(4)
    out, loss = model(x, y)
    assert out.shape == (4, 10) and torch.allclose(loss, torch.nn.functional.cross_entropy(out, y))
    assert w.description == {"name": EXAMPLE, "args": {"width": 32, "depth": 3}, "loss": "loss_fn"}


def test_counted_flops_of_a_stack_of_linears_are_six_per_weight_and_the_recompute_two():
    """Each Linear weight costs 2 FLOPs per sample forward and 4 backward; checkpointing every block
    runs the blocks' forward again."""
    w = workload(model=EXAMPLE, model_args="width=32,depth=3")
    net = w.meta().net
    linear = sum(m.weight.numel() for m in net.modules() if isinstance(m, torch.nn.Linear))
    in_blocks = sum(m.weight.numel() for b in net.blocks for m in b.modules() if isinstance(m, torch.nn.Linear))
    # The first Linear's input needs no gradient: autograd skips that one product (2 FLOPs per weight).
    first = net.embed.weight.numel()
    flops = sample_flops(w, None, 1)
    assert flops["source"] == "counted" and flops["model"] == 6 * linear - 2 * first
    assert flops["recomputed"] == 2 * in_blocks
    assert sample_flops(w, None, 0)["recomputed"] == 0


def test_gptlite_keeps_its_formula_beside_the_count():
    w = workload(preset="tiny")
    flops = sample_flops(w, None, 2)
    assert flops["source"] == "formula" and flops["model"] == w.flops_formula
    assert abs(flops["counted"] / flops["model"] - 1) < 0.02  # the LayerNorm and bias terms (test_model.py)
    assert 0 < flops["recomputed"] < flops["counted"] / 3


def test_torchvision_is_refused_with_the_reason_where_it_does_not_import():
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or built against another torch
        with pytest.raises(ConfigError, match="torchvision does not import here"):
            workload(model="torchvision:resnet18")
        return
    assert workload(model="torchvision:resnet18").n_params == 11_181_642


def test_the_readme_model_file_is_complete(tmp_path):
    """docs/models.md's "Your own model" file, as printed, builds, samples and computes a loss."""
    from conftest import REPO

    text = (REPO / "docs" / "models.md").read_text().split("## Your own model\n", 1)[1]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "readme_model.py"
    path.write_text(code)
    w = workload(model=str(path), model_args="width=16,depth=2")
    x, y = w.example(4)
    out, loss = w.build(0)(x, y)
    assert out.shape == (4, 2) and loss.ndim == 0 and len(w.meta().net) == 4
    assert w.data.describe()["train_samples"] == 9_000


# Model files for the checks made before anything is recorded (issue 21, case 11). DATA is a dataset of
# 8-feature points with class ids 0..3; MODEL a two-block MLP over them.
HEAD = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F


class Points(torch.utils.data.Dataset):
    def __init__(self, item=None, n=40):
        self.n, self.item = n, item

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = torch.randn(8, generator=torch.Generator().manual_seed(i)), i % 4
        return self.item(i, x, y) if self.item else (x, y)


class Two(nn.Module):
    def __init__(self, features=8, classes=4):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(features, 16), nn.Linear(16, classes))

    def forward(self, x):
        return self.blocks(x)

"""
GOOD_MODEL = "def get_model(features: int = 8, classes: int = 4):\n    return Two(features, classes)\n"
GOOD_DATA = "def get_dataset():\n    return Points()\n"

FILE_CASES = [
    # (name, model file body below HEAD, the error's type, what its one line says)
    ("get_model raising", "def get_model():\n    raise RuntimeError('no GPU\\nat all')\n" + GOOD_DATA, ConfigError,
     r"m.py: get_model\(\) failed: RuntimeError: no GPU at all$"),
    ("sys.exit in the file", "sys.exit(0)\n", ConfigError, r"importing .*m.py called sys.exit\(0\)"),
    ("sys.exit in get_model", "def get_model():\n    exit(3)\n" + GOOD_DATA, ConfigError,
     r"get_model\(\) called sys.exit\(3\)"),
    ("get_model returning a string", "def get_model():\n    return 'mlp'\n" + GOOD_DATA, ConfigError,
     r"get_model\(\) must return a torch.nn.Module \(got str\)"),
    ("get_model returning None", "def get_model():\n    pass\n" + GOOD_DATA, ConfigError,
     r"get_model\(\) must return a torch.nn.Module \(got NoneType\)"),
    ("get_dataset raising", GOOD_MODEL + "def get_dataset():\n    return 1 / 0\n", ConfigError,
     r"get_dataset\(\) failed: ZeroDivisionError: division by zero"),
    ("items not pairs", GOOD_MODEL + "def get_dataset():\n    return Points(lambda i, x, y: x)\n", DataError,
     r"sample 0 of the train split is Tensor; a sample must be an \(input, target\) pair, or a dict"),
    ("items of three", GOOD_MODEL + "def get_dataset():\n    return Points(lambda i, x, y: (x, y, y))\n", DataError,
     r"is a tuple of 3; a sample must be an \(input, target\) pair"),
    ("a dict of other keys", GOOD_MODEL + "def get_dataset():\n    return Points(lambda i, x, y: {'x': x, 'y': y})\n",
     DataError, r"is a dict with keys \['x', 'y'\]; a sample must be .*\{input_ids, labels\} or \{pixel_values, labels\}"),
    # Hugging Face's layouts, with a key more (case 20) or labels copied from input_ids unshifted.
    ("a dict with attention_mask", GOOD_MODEL + "def get_dataset():\n    return Points(lambda i, x, y: "
     "{'input_ids': x, 'attention_mask': x, 'labels': y})\n", DataError,
     r"is a dict with keys \['attention_mask', 'input_ids', 'labels'\]; a sample must be"),
    ("labels unshifted", "def get_model():\n    return nn.Sequential(nn.Embedding(4, 8), nn.Linear(8, 4))\n"
     "def get_dataset():\n    return Points(lambda i, x, y: {'input_ids': [i % 4, 1, 2], 'labels': [i % 4, 1, -100]})\n",
     DataError, r"the target equals the input in every sample read \(6\): .*labels\[t\] = input_ids\[t \+ 1\]"),
    ("numpy strings", GOOD_MODEL + "def get_dataset():\n    import numpy\n"
     "    return Points(lambda i, x, y: (numpy.array(['a', 'b']), y))\n", DataError,
     r"the input of sample 0 of the train split is a ndarray that is not an array of numbers"),
    ("__getitem__ raising", GOOD_MODEL + "def get_dataset():\n    return Points(lambda i, x, y: [][i])\n", DataError,
     r"reading sample 0 of the train split failed: IndexError: list index out of range"),
    ("inconsistent shapes", GOOD_MODEL + "def get_dataset():\n    return Points(lambda i, x, y: (x[:4 + i % 2], y))\n",
     DataError, r"samples differ: the input of sample 1 of the train split is a float of shape \[5\], that of sample 0 "
                r"of the train split a float of shape \[4\]"),
    ("labels out of range", GOOD_MODEL + "def get_dataset():\n    return Points(lambda i, x, y: (x, y + 2))\n",
     DataError, r"target [45] is not a class of the model's output \(4 classes: 0..3\)"),
    ("vocabulary smaller than the data's", "def get_model(vocab_size: int = 3):\n"
     "    return nn.Sequential(nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size))\n"
     "def get_dataset():\n    return Points(lambda i, x, y: (torch.arange(6) % (y + 1), (torch.arange(6) + 1) % 4))\n",
     DataError, r"target 3 is not a class of the model's output \(3 classes: 0..2\)"),
    ("model and data shapes", "def get_model():\n    return Two(features=5)\n" + GOOD_DATA, ConfigError,
     r"the model and its data do not fit: forward and loss on 2 training samples \(input \[2, 8\] float32, target "
     r"\[2\] int64\) failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("sys.exit in forward", "class Quits(Two):\n    def forward(self, x):\n        sys.exit(1)\n"
     "def get_model():\n    return Quits()\n" + GOOD_DATA, ConfigError, r"do not fit: .*failed: SystemExit: 1$"),
    ("loss_fn not callable", GOOD_MODEL + GOOD_DATA + "loss_fn = 'mse'\n", ConfigError,
     r"loss_fn must be a function \(output, target\) -> scalar tensor \(got str\)"),
    ("loss_fn not a scalar", GOOD_MODEL + GOOD_DATA +
     "def loss_fn(out, y):\n    return F.cross_entropy(out, y, reduction='none')\n", ConfigError,
     r"loss_fn must return a scalar float tensor \(got a torch.float32 tensor of shape \[2\]\)"),
    ("loss_fn returning a number", GOOD_MODEL + GOOD_DATA + "def loss_fn(out, y):\n    return 0.5\n", ConfigError,
     r"loss_fn must return a scalar float tensor \(got float\)"),
    ("loss_fn without a gradient", GOOD_MODEL + GOOD_DATA +
     "def loss_fn(out, y):\n    return F.cross_entropy(out.detach(), y)\n", ConfigError,
     r"loss_fn returned a tensor without a gradient"),
    ("loss_fn raising", GOOD_MODEL + GOOD_DATA + "def loss_fn(out, y):\n    return F.mse_loss(out, y)\n", ConfigError,
     r"the model and its data do not fit: .*failed: RuntimeError"),
]


@pytest.mark.parametrize("name, body, error, message", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_a_model_file_and_its_data_are_checked_before_anything_is_recorded(tmp_path, name, body, error, message):
    """Through training.run.prepare_run, as train.py calls it on every rank: one line, before any record."""
    from training.run import prepare_run

    cfg = RunConfig(model=write_model_file(tmp_path, HEAD + body), backend="single", steps=2,
                    runs_dir=str(tmp_path / "runs"), run_name="r")
    with pytest.raises(error, match=message) as caught:
        prepare_run(cfg)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "runs").exists()


def test_a_model_file_failing_after_the_checks_is_one_line_and_a_failed_record(tmp_path, capsys):
    """get_model() that succeeds for the check and fails when the run builds the model (issue 39,
    case 11): the run's failure in one line naming the file, no traceback, the record failed with it."""
    import train
    from conftest import in_process
    from training.cli import build_parser, parse_args
    from training.run import main

    path = write_model_file(tmp_path, HEAD + GOOD_DATA + textwrap.dedent("""
        CALLS = []
        def get_model():
            CALLS.append(1)
            if len(CALLS) > 1:
                raise RuntimeError("the weights file moved")
            return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        """))
    parser = build_parser(description=train.DESCRIPTION, examples=train.EXAMPLES)
    proc = in_process(lambda a: main(parse_args(a, parser=parser)),
                      ["--model", path, "--steps", "2", "--runs_dir", tmp_path / "runs", "--run_name", "r", "--quiet"])
    said = "get_model() failed: RuntimeError: the weights file moved"
    assert proc.returncode == 1 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    summary = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and said in summary["error"] and path in summary["error"]


def test_the_model_file_cases_check_what_they_say(tmp_path):
    """The fixture itself: HEAD with the good model and data passes every check."""
    from training.run import check_model

    check_model(RunConfig(model=write_model_file(tmp_path, HEAD + GOOD_MODEL + GOOD_DATA), backend="ddp"))


TYPED = """
from __future__ import annotations
from typing import Optional
import torch

def get_model(width: int = 8, lr: float = 0.1, name: str = "m", bias: bool = True, depths: list[int] = (1,),
              drop: Optional[float] = None, scale: int | None = None, anything=3, custom: Undefined = None):
    return torch.nn.Linear(4, 2)

def get_dataset():
    return [(torch.ones(4), 1)] * 20
"""


@pytest.mark.parametrize("args, message", [
    ("width=abc", r"model_args: width must be an int \(.*get_model\(\) annotates it int\), got str 'abc'$"),
    ("width=3.5", r"model_args: width must be an int .*got float 3.5$"),
    ("width=true", r"model_args: width must be an int .*got bool True$"),
    ("lr=1e3", r"model_args: lr must be a float .*got str '1e3' \(YAML reads 1e3 as a string: write 1.0e\+3 or "
               r"1000.0\)$"),
    ("lr=[1]", r"model_args: lr must be a float .*got list \[1\]"),
    ("name=3", r"model_args: name must be a string .*got int 3$"),
    ("bias=yes please", r"model_args: bias must be a bool \(true or false\) .*got str 'yes please'$"),
    ("depths=[1,x]", r"model_args: depths must be a list of int .*got list \[1, 'x'\]$"),
    ("depths=2", r"model_args: depths must be a list of int .*got int 2$"),
    ("drop=abc", r"model_args: drop must be a float or null .*got str 'abc'$"),
    ("scale=0.5", r"model_args: scale must be an int or null .*got float 0.5$"),
])
def test_model_args_are_checked_against_get_models_annotations(tmp_path, args, message):
    """A value of the wrong type for get_model's annotation: one line naming the key and the type
    (issue 21, case 12)."""
    with pytest.raises(ConfigError, match=message):
        workload(model=write_model_file(tmp_path, TYPED), model_args=args)


def test_model_args_that_fit_their_annotations_or_have_none_pass(tmp_path):
    path = write_model_file(tmp_path, TYPED)
    w = workload(model=path, model_args="width=4,lr=2,name=x,bias=false,depths=[1,2],drop=null,scale=3,"
                                        "anything=[a],custom=whatever")
    assert w.description["args"]["lr"] == 2 and w.meta().net.in_features == 4


def test_a_model_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """As `python m.py` would: its own directory is on sys.path, at import and when get_model runs
    (issue 21, case 16)."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path.parent)  # not the file's directory
    (tmp_path / "beside_layers_16.py").write_text("import torch\nWIDTH = 4\n\ndef net():\n    return torch.nn.Linear(WIDTH, 2)\n")
    path = write_model_file(tmp_path, """
        import torch
        from beside_layers_16 import WIDTH

        def get_model():
            import beside_layers_16  # imported late too
            return beside_layers_16.net()

        def get_dataset():
            return [(torch.ones(WIDTH), 1)] * 20
        """)
    w = workload(model=path)
    assert w.meta().net.in_features == 4 and str(tmp_path) in sys.path


DICT_TEXT = """
import torch

def get_model(vocab: int = 5):
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab))

def get_dataset():  # Hugging Face's text layout; lists, as datasets' rows hold them
    return [{"input_ids": [(i + t) % 5 for t in range(6)], "labels": [(i + t + 1) % 5 for t in range(6)]}
            for i in range(30)]
"""
DICT_IMAGES = """
import numpy
import torch

def get_model():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(16, 10))

def get_dataset():  # Hugging Face's image layout
    return [{"pixel_values": numpy.full((3, 4, 4), i, dtype=numpy.float32), "labels": i % 10} for i in range(30)]
"""


@pytest.mark.parametrize("body, x_shape, y_shape", [(DICT_TEXT, (4, 6), (4, 6)), (DICT_IMAGES, (4, 3, 4, 4), (4,))],
                         ids=["input_ids", "pixel_values"])
def test_dict_samples_in_hugging_faces_layouts_train(tmp_path, body, x_shape, y_shape):
    """{input_ids, labels} and {pixel_values, labels} items: checked, batched and trained like pairs
    (issue 21, case 20)."""
    from training.run import check_model

    w = check_model(RunConfig(model=write_model_file(tmp_path, body), backend="single"))
    x, y = w.example(4)
    assert tuple(x.shape) == x_shape and tuple(y.shape) == y_shape and not y.is_floating_point()
    out, loss = w.build(0)(x, y)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert w.data.describe()["sample"] == {"input": list(x_shape[1:]), "target": list(y_shape[1:])}


def test_a_sample_of_another_shape_found_late_is_a_data_error_in_one_line():
    """check() reads a few samples; one of another shape among the rest fails its batch as DataError,
    naming the samples, not as collate's traceback."""
    ragged = [(torch.ones(3 if i in (0, 1, 26, 27, 28, 29) else 4), 0) for i in range(30)]  # those read: 3
    data = SampledDataset(ragged, source="ragged")
    assert len(data.check()) == 6
    with pytest.raises(DataError, match=r"^ragged: samples \[[0-9, ]+\] of the train split cannot be batched; every "
                                        "sample must have the same shape"):
        data.batch("train", 0, 0, 0, 27, 27)


def test_the_check_leaves_torchs_random_numbers_as_they_were(tmp_path):
    """A dataset and a forward that draw from torch's global generator (the forward run for real: it reads
    a value, which the meta device cannot): the run draws the same numbers after the check as without it."""
    from training.run import check_model

    path = write_model_file(tmp_path, HEAD + """
        class Reads(Two):
            def forward(self, x):
                return self.blocks(x) * float(torch.rand(1).item() + x.sum().item() * 0)

        def get_model():
            return Reads()

        def get_dataset():
            return Points(lambda i, x, y: (x + torch.rand(8), y))
        """.replace("\n        ", "\n"))
    torch.manual_seed(3)
    check_model(RunConfig(model=path, backend="single"))
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))


TEXT_MODELS = {
    "gptlite": {"preset": "tiny"},
    "hf:gpt2": {"model_args": GPT2_ARGS},
    "hf:llama": {"model_args": "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
                               "intermediate_size=128"},
    "hf:bert": {"model_args": "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,intermediate_size=64"},
    "hf:electra": {"model_args": "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,intermediate_size=64,"
                                 "embedding_size=32"},
}


@pytest.mark.parametrize("name", list(TEXT_MODELS))
def test_no_text_model_sees_the_tokens_it_predicts(name):
    """The targets are the next tokens: the logits at position t must not change when a token after t
    does (hf:bert was built as BertLMHeadModel without is_decoder and attended to the whole window)."""
    flags = {"model": name, "block_size": 32, **TEXT_MODELS[name]}
    if name != "gptlite":
        flags["preset"] = "tiny"
    w = workload(**flags)
    w.check()  # what every run goes through: passes for a causal model
    x, _ = w.example(2)
    changed = x.clone()
    changed[:, 10:] = (x[:, 10:] + 1) % 30
    model = w.build(0).eval()
    with torch.no_grad():
        before, after = model(x)[0], model(changed)[0]
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])  # the change is seen where it may be


def test_a_language_model_that_is_not_causal_is_refused():
    """A model that mixes the whole window into every position (as an encoder does), given as a causal
    language model: refused in one line by the check every run goes through."""
    from gptlite.data import CharDataset
    from models.workload import WithLoss, Workload

    class Bidirectional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(65, 16), torch.nn.Linear(16, 65)

        def forward(self, x):
            h = self.embed(x)
            return self.head(h + h.mean(dim=1, keepdim=True))

    w = Workload("bidirectional", {}, CharDataset.load(None, 16), lambda: WithLoss(Bidirectional()), causal=True)
    with pytest.raises(ConfigError, match="not causal"):
        w.check()


@pytest.mark.parametrize("name, args, says", [
    ("hf:gpt2", "n_layer=2.5", "n_layer"),
    ("hf:gpt2", "n_embd=33,n_head=2", "n_embd=33,n_head=2"),
    ("hf:gpt2", "n_layer=2,resid_pdrop=1.5", "resid_pdrop=1.5"),
    ("hf:resnet", "layer_type=basik", "layer_type=basik"),
])
def test_settings_a_transformers_model_refuses_are_one_line_naming_them(name, args, says):
    """The config's own validation, or the model's constructor refusing the settings: a ConfigError on
    one line naming the setting, from the check every run goes through (they were tracebacks)."""
    from training.run import check_model

    with pytest.raises(ConfigError) as refused:
        check_model(RunConfig(model=name, model_args=args, preset="tiny"))
    message = str(refused.value)
    assert "\n" not in message and says in message and "model_args" in message, message


def test_settings_are_applied_or_refused_never_dropped():
    """A context length in --model_args stands (--block_size overwrote GPT-2's n_positions) or is refused
    when a sample does not fit it (Llama's max_position_embeddings=8 crashed at the first step);
    --block_size with a model that has no tokens, and empty items in --model_args, are refused."""
    from training.run import check_model

    longer = workload(model="hf:gpt2", model_args=f"{GPT2_ARGS},n_positions=512", preset="tiny")
    assert longer.description["config"]["n_positions"] == 512
    fitting = workload(model="hf:gpt2", model_args=f"{GPT2_ARGS},n_positions=8", preset="tiny", block_size=8)
    assert fitting.description["config"]["n_positions"] == 8 and fitting.tokens_per_sample == 8
    for flags, message in (
            ({"model": "hf:gpt2", "model_args": f"{GPT2_ARGS},n_positions=8"}, "n_positions=8 is shorter than a sample"),
            ({"model": "hf:llama", "model_args": "num_hidden_layers=1,hidden_size=32,num_attention_heads=2,"
                                                 "intermediate_size=64,max_position_embeddings=8"},
             "max_position_embeddings=8 is shorter than a sample"),
            ({"model": "hf:resnet", "block_size": 64}, "block_size: hf:resnet takes no context length"),
            ({"model": EXAMPLE, "block_size": 64}, "takes no context length"),
            ({"model": EXAMPLE, "model_args": "width=8,,depth=2"}, "an empty item between commas"),
            ({"model": EXAMPLE, "model_args": "width="}, "width has no value")):
        with pytest.raises(ConfigError, match=message):
            check_model(RunConfig(preset="tiny", **flags))
