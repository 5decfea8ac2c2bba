"""The largest-batch search: doubling then bisection, synthetic and real."""

import json
import math

import pytest
import yaml

from core.summary import RunSummary
from orchestration.max_batch import SearchError, largest_fitting, search
from orchestration.runner import Outcome
from orchestration.sweep import SweepRun


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 37, 64, 100, 1000])
def test_finds_the_known_limit_of_a_synthetic_budget(limit):
    probes = []

    def fits(micro):
        probes.append(micro)
        return micro <= limit

    assert largest_fitting(fits, limit=4096) == limit
    assert len(probes) <= 2 * math.ceil(math.log2(limit + 1)) + 2
    assert limit in probes and limit + 1 in probes  # both sides of the limit were tried


def test_nothing_fits_and_the_cap():
    assert largest_fitting(lambda micro: False) is None
    assert largest_fitting(lambda micro: True, limit=48) == 48


class FakeRunner:
    """Outcomes from a synthetic memory model: 10 MiB + 3 MiB per sample, under a 100 MiB budget."""

    def __init__(self, fail_at=None):
        self.launched = []
        self.fail_at = fail_at

    def run(self, planned):
        micro = dict(planned.flags)["micro_batch"]
        self.launched.append(planned)
        peak = (10 + 3 * micro) * 2**20
        status = "failed" if micro == self.fail_at else ("ok" if peak <= 100 * 2**20 else "oom")
        summary = RunSummary(planned.name, status, error="x", mem_peak_bytes=peak, samples_per_s=7.0 * micro)
        return Outcome(planned, summary, 1.0)


BASE = SweepRun("ddp-w2-tiny-mb8-fp32-ckpt0", "ddp", None, 2, (("micro_batch", 8), ("steps", 20)),
                  config_key="ddp-w2-tiny-fp32-ckpt0")


def test_search_runs_probes_and_measures_the_best_batch():
    runner = FakeRunner()
    result = search(BASE, runner, budget_gb=100 / 1024, probe_steps=3, full_steps=20, limit=4096)
    assert result.best_micro_batch == 30  # 10 + 3 x 30 = 100 MiB
    assert result.samples_per_s == 7.0 * 30 and result.final_run == "ddp-w2-tiny-fp32-ckpt0-best-mb30"
    probes = [dict(p.flags) for p in runner.launched[:-1]]
    assert all(p["steps"] == 3 and p["mem_budget_gb"] == 100 / 1024 for p in probes)
    assert dict(runner.launched[-1].flags)["steps"] == 20


def test_a_probe_that_fails_gives_no_answer():
    with pytest.raises(SearchError):
        search(BASE, FakeRunner(fail_at=4), budget_gb=1.0, probe_steps=3, full_steps=20, limit=4096)


@pytest.mark.launch
def test_real_search_under_a_cpu_budget(tmp_path, forked_launchers):
    """sweep.py --max_batch's main in this process, its probes real runs (forked: conftest.forked_launchers)."""
    import sweep
    from conftest import in_process

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "mb", "runs_dir": str(tmp_path / "runs"), "steps": 6,
                                    "matrix": {"backend": ["single"], "preset": ["tiny"]},
                                    "train_args": {"dropout": 0.0}}))
    budget = 0.012  # GiB: about 12.9 MB, which a handful of tiny-preset samples fill
    proc = in_process(sweep.main, [spec, "--max_batch", "--mem_budget_gb", budget])
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads((tmp_path / "runs" / "max_batch" / f"budget_{budget:g}GiB" / "max_batch.json").read_text())
    best = result["best_micro_batch"]
    probes = {p["micro_batch"]: p for p in result["probes"]}
    assert probes[best]["status"] == "ok" and probes[best + 1]["status"] == "oom"
    assert probes[best]["mem_peak_bytes"] <= budget * 2**30 < probes[best + 1]["mem_peak_bytes"]
    assert result["samples_per_s"] > 0


def test_a_probe_under_another_budget_is_never_taken_as_done(tmp_path):
    """A search's probes are keyed by everything they ran with, the budget included."""
    from core.records import atomic_write_json
    from gptlite.errors import ConfigError
    from orchestration.runner import Runner

    runner = Runner(tmp_path, timeout_s=60)
    probe = BASE.with_flags("probe-mb4", micro_batch=4, mem_budget_gb=0.01)
    atomic_write_json(tmp_path / "probe-mb4" / "summary.json", RunSummary("probe-mb4", "oom").to_dict())
    atomic_write_json(tmp_path / ".keys" / "probe-mb4.json", probe.key())
    runner.check_records([probe])  # the same probe: its record is its own
    with pytest.raises(ConfigError, match="mem_budget_gb '0.01' then, '1.0' now"):
        runner.check_records([BASE.with_flags("probe-mb4", micro_batch=4, mem_budget_gb=1.0)])
