"""The packages form layers that point one way, and a run loads only its own backend's library.

gptlite (model, data) <- models (any model and its data) <- core (config, records, memory, dist) <- backends <- training (loop, run,
sweep, CLI) <- analysis. Each package's modules are imported in a fresh interpreter, and the
project modules that got loaded must all belong to that package or to a layer below it.
"""

import json
import pkgutil
import subprocess
import sys

import pytest

from conftest import REPO, TRAIN, base_env

LAYERS = ["gptlite", "models", "core", "backends", "training", "analysis"]


def _loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.splitlines()[-1]))


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_loads_nothing_from_the_layers_above_it(package):
    modules = [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(REPO / package)])]
    loaded = _loaded_after("\n".join(f"import {m}" for m in modules))
    above = LAYERS[LAYERS.index(package) + 1:]
    wrong = sorted(m for m in loaded if m.split(".")[0] in above)
    assert not wrong, f"{package} imports from a layer above it: {wrong}"


def test_every_package_is_in_a_layer():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages == set(LAYERS), packages


@pytest.mark.parametrize("args", [("--backend", "single"), ("--backend", "ddp"),
                                  ("--fsdp_config", "fsdp_configs/full_shard.yaml"),
                                  ("--fsdp_config", "fsdp_configs/fsdp2.yaml")])
def test_a_torch_backend_run_loads_neither_deepspeed_nor_accelerate(args, tmp_path):
    code = ("import runpy, sys\n"
            f"sys.argv = ['train.py', '--dry_run', '--preset', 'tiny', '--runs_dir', {str(tmp_path)!r}, *{args!r}]\n"
            "try:\n"
            f"    runpy.run_path({str(TRAIN)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert not e.code, e.code\n")
    loaded = _loaded_after(code)
    assert not {m.split(".")[0] for m in loaded} & {"deepspeed", "accelerate", "transformers"}


def test_a_deepspeed_run_does_load_deepspeed(tmp_path):
    """The check above can fail: the same probe sees DeepSpeed when the run needs it."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['train.py', '--dry_run', '--preset', 'tiny', '--deepspeed_config', 'ds_configs/z2.json']\n"
            "try:\n"
            f"    runpy.run_path({str(TRAIN)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert not e.code, e.code\n")
    assert "deepspeed" in _loaded_after(code)
