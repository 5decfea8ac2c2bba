"""The table of shared launches (tests/support/launches.py) says who reads what, and says it truly; the port
every launch gets is free."""

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

from ckpt_probe import parse_case
from launches import LAUNCHES, PROBE_GROUPS, REFERENCE_STEPS, committed_reference

TESTS = Path(__file__).resolve().parents[1]


def module_named(name: str):
    """The test module `name` from whichever tier folder holds it: pytest puts a folder on sys.path only
    when it collects a file there, and this test may run alone."""
    if name not in sys.modules:
        path, = TESTS.glob(f"*/{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_every_launch_names_readers_that_exist(name):
    launch = LAUNCHES[name]
    assert launch.readers, f"{name}: a launch nobody reads"
    assert isinstance(launch.readers, tuple) and all(isinstance(r, str) for r in launch.readers)
    for reader in launch.readers:
        module, function = reader.split("::")
        assert hasattr(module_named(module), function), f"{name}: {reader} is no test or fixture"


def test_the_probes_groups_are_distinct_and_their_cases_parse():
    labels = [g["label"] for g in PROBE_GROUPS]
    assert len(labels) == len(set(labels))
    for group in PROBE_GROUPS:
        assert group["cases"] and len(group["cases"]) == len(set(group["cases"])), group["label"]
        for case in group["cases"]:
            interval, impl, offload, policy, dropout = parse_case(case)
            assert interval >= 0 and 0 <= dropout < 1 and (offload in ("0", "1") or offload.startswith("p"))


def test_the_committed_reference_is_the_reference_launch():
    committed = committed_reference()
    assert committed["command"] == f"python train.py {' '.join(LAUNCHES['reference'].args)}"
    assert len(committed["losses"]) == REFERENCE_STEPS and committed["val_loss"] > 0


def test_a_unit_test_that_starts_a_process_fails():
    """The unit tier's guard (tests/support/tiers.py): starting a process inside a unit test raises, naming it;
    multiprocessing's spawn as well."""
    import multiprocessing
    import subprocess

    from tiers import StartedAProcess

    with pytest.raises(StartedAProcess, match="test_a_unit_test_that_starts_a_process_fails is a unit test"):
        subprocess.run(["true"])
    with pytest.raises(StartedAProcess):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_launch_port_is_free_and_below_the_kernels_ephemeral_range(monkeypatch):
    """core.ports.free_port: a port nothing holds, drawn below the range the kernel hands to bind(0) and
    to outgoing connections (from there gloo's next connection took it before the launcher bound it:
    EADDRINUSE); a held port is drawn again."""
    import random

    from core import ports

    span = ports.ephemeral_range()
    if span is None or span[0] <= 2048:
        pytest.skip(f"no ephemeral range to stay below here ({ports.EPHEMERAL}: {span})")
    drawn = {ports.free_port() for _ in range(20)}
    assert all(ports.bindable(p) and p < span[0] for p in drawn), (drawn, span)
    assert len(drawn) > 1, "the same port twenty times: not drawn at random"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", min(drawn)))
        held.listen()
        free = max(drawn)
        draws = iter([min(drawn), free])
        monkeypatch.setattr(random, "randrange", lambda *a: next(draws))
        assert ports.free_port() == free
