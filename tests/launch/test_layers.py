"""The packages form layers that point one way, and a run loads only its own backend's library.

gptlite (model, data) <- models (any model and its data) <- core (config, records, memory, dist) <- backends <-
estimator (memory per rank, --ckpt_policy auto's plan) <- training (one run: loop, run, CLI) <- simulation
(describe, fake_world) <- orchestration (many runs: sweep, runner, Slurm) <- analysis. The packages' modules are
imported in one fresh interpreter, layer by layer
from the bottom: what each layer's imports newly load must belong to that layer or one below it
(a module of a higher layer loaded earlier was loaded by a lower layer, whose check failed then).
"""

import json
import pkgutil
import subprocess
import sys

import pytest

from conftest import REPO, TRAIN, base_env

LAYERS = ["gptlite", "models", "core", "backends", "estimator", "training", "simulation", "orchestration", "analysis"]

pytestmark = pytest.mark.launch  # fresh interpreters: what a package loads, from nothing


def _run(code: str) -> list:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def loaded_by_layer(layers: list[str]) -> dict[str, list[str]]:
    """Per package, in one interpreter from the bottom layer up: the modules its imports newly loaded."""
    steps = {p: [f"{p}.{m.name}" for m in pkgutil.iter_modules([str(REPO / p)])] for p in layers}
    code = ("import importlib, json, sys\n"
            f"steps = {steps!r}\n"
            "out = {}\n"
            "for package, modules in steps.items():\n"
            "    before = set(sys.modules)\n"
            "    for m in modules:\n"
            "        importlib.import_module(m)\n"
            "    out[package] = sorted(set(sys.modules) - before)\n"
            "print(json.dumps([out]))\n")
    return _run(code)[0]


@pytest.fixture(scope="module")
def loaded():
    return loaded_by_layer(LAYERS)


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_loads_nothing_from_the_layers_above_it(package, loaded):
    above = LAYERS[LAYERS.index(package) + 1:]
    wrong = sorted(m for m in loaded[package] if m.split(".")[0] in above)
    assert not wrong, f"{package} imports from a layer above it: {wrong}"


def test_every_package_is_in_a_layer():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages == set(LAYERS), packages


# train.py --dry_run per backend in one interpreter: the torch backends first, each checked before the
# next, then DeepSpeed's (which must load it: the check can fail).
DRY_RUNS = {"single": ("--backend", "single"), "ddp": ("--backend", "ddp"),
            "fsdp": ("--fsdp_config", "fsdp_configs/full_shard.yaml"),
            "fsdp2": ("--fsdp_config", "fsdp_configs/fsdp2.yaml"),
            "deepspeed": ("--deepspeed_config", "ds_configs/z2.json")}


@pytest.fixture(scope="module")
def libraries_loaded(tmp_path_factory):
    runs = str(tmp_path_factory.mktemp("runs"))
    code = ("import contextlib, io, json, runpy, sys\n"
            f"cases = {DRY_RUNS!r}\n"
            "out = {}\n"
            "for name, args in cases.items():\n"
            f"    sys.argv = ['train.py', '--dry_run', '--preset', 'tiny', '--runs_dir', {runs!r}, *args]\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            f"            runpy.run_path({str(TRAIN)!r}, run_name='__main__')\n"
            "        except SystemExit as e:\n"
            "            assert not e.code, (name, e.code)\n"
            "    out[name] = sorted({m.split('.')[0] for m in sys.modules} & {'deepspeed', 'accelerate', 'transformers'})\n"
            "print(json.dumps([out]))\n")
    return _run(code)[0]


@pytest.mark.parametrize("backend", ["single", "ddp", "fsdp", "fsdp2"])
def test_a_torch_backend_run_loads_neither_deepspeed_nor_accelerate(backend, libraries_loaded):
    assert libraries_loaded[backend] == []


def test_a_deepspeed_run_does_load_deepspeed(libraries_loaded):
    """The check above can fail: the same probe sees DeepSpeed when the run needs it."""
    assert "deepspeed" in libraries_loaded["deepspeed"]
