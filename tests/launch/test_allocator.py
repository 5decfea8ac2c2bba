"""train.py pins glibc's allocator thresholds at start-up (core/allocator.py), unless the user set them."""

import json
import platform
import subprocess
import sys

import pytest

from conftest import REPO, base_env

pytestmark = [pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"),
              pytest.mark.launch]  # fresh interpreters: the thresholds are set at start-up

PROBE = "import json; from core import allocator; print(json.dumps([allocator.keep_freed_memory(), allocator.describe()]))"


def _probe(**env) -> list:
    clean = {k: v for k, v in base_env().items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                                             "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**clean, **env}, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_thresholds_are_pinned_by_default_and_recorded():
    applied, described = _probe()
    assert applied == {"mmap_threshold": 2**30, "trim_threshold": 2**30}
    assert described == {"set_by": "train.py", **applied}


@pytest.mark.parametrize("name", ["MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"])
def test_the_users_own_settings_win(name):
    value = "65536" if name.startswith("MALLOC") else "glibc.malloc.trim_threshold=65536"
    applied, described = _probe(**{name: value})
    assert applied is None and described == {"set_by": "environment", name: value}


def test_a_run_records_its_allocator_settings(launches, request):
    run = launches.get("reference", request)  # plain `python train.py`
    assert run.config["environment"]["allocator"] == {"set_by": "train.py", "mmap_threshold": 2**30,
                                                      "trim_threshold": 2**30}
