"""The table of shared launches (tests/launches.py) says who reads what, and says it truly."""

import importlib

import pytest

from ckpt_probe import parse_case
from launches import LAUNCHES, PROBE_GROUPS, REFERENCE_STEPS, committed_reference


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_every_launch_names_readers_that_exist(name):
    launch = LAUNCHES[name]
    assert launch.readers, f"{name}: a launch nobody reads"
    assert isinstance(launch.readers, tuple) and all(isinstance(r, str) for r in launch.readers)
    for reader in launch.readers:
        module, function = reader.split("::")
        assert hasattr(importlib.import_module(module), function), f"{name}: {reader} is no test or fixture"


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
    """The unit tier's guard (tests/tiers.py): starting a process inside a unit test raises, naming it;
    multiprocessing's spawn as well."""
    import multiprocessing
    import subprocess

    from tiers import StartedAProcess

    with pytest.raises(StartedAProcess, match="test_a_unit_test_that_starts_a_process_fails is a unit test"):
        subprocess.run(["true"])
    with pytest.raises(StartedAProcess):
        multiprocessing.get_context("spawn").Process(target=print).start()
