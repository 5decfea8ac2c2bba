"""The planner's candidates (analysis/plan/candidates.py): micro-batch x accumulation x checkpointing
for the global batch, and the variants of the configurations written as files."""

import json
import shlex
from pathlib import Path

import pytest

from analysis import plan
from gptlite.errors import ConfigError
from conftest import dry_run

TINY = ["--preset", "tiny"]


def h100():
    return plan.named_device("H100-SXM", "infiniband-ndr", 0.4, 0.5, "fp32")


def test_candidates_cover_every_micro_batch_times_accumulation_that_makes_the_global_batch():
    cands = plan.candidates(["ddp", "ds_configs/z3.json"], 2, 16, ("none", "full/1"))
    assert {(c.micro_batch, c.grad_accum) for c in cands} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert all(c.micro_batch * c.grad_accum * 2 == 16 for c in cands)
    assert len(cands) == 2 * 4 * 2 and len(set(cands)) == len(cands)
    assert {(c.micro_batch, c.grad_accum) for c in plan.candidates(["ddp"], 2, 16, ("none",), [2, 3])} == {(2, 4)}
    with pytest.raises(ConfigError, match="global_batch 15 must be a multiple of world 2"):
        plan.candidates(["ddp"], 2, 15)
    with pytest.raises(ConfigError, match="none divides"):
        plan.candidates(["ddp"], 2, 16, ("none",), [3])
    with pytest.raises(ConfigError, match="ckpt 'full/0'"):
        plan.Candidate("ddp", 1, 1, "full/0")


VARIED = ["ds_configs/z2.json", "ds_configs/z3.json", "fsdp_configs/full_shard.yaml", "fsdp_configs/fsdp2.yaml", "ddp"]


def test_variants_are_written_as_files_train_py_resolves_and_priced_by_what_they_change(tmp_path):
    """--variants: ZeRO-2's smaller buckets cost more calls and less memory, larger ones the reverse;
    ZeRO-3 without prefetch and FSDP without backward prefetch put gathers on the critical path
    (wait), the same bytes; DDP's buckets are flags (no file): smaller ones more calls and less
    waiting after backward; a variant shares its configuration's refitted overhead."""
    bases = plan.write_variants(VARIED, str(tmp_path / "v"))
    names = sorted(Path(v).name for v in bases if v.endswith((".json", ".yaml")))
    assert names == ["full_shard.no_backward_prefetch.yaml", "z2.buckets_quarter.json", "z2.buckets_x4.json",
                     "z3.no_prefetch.json", "z3.persistence_x100.json"]  # fsdp2: none; ddp: flags
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == names
    assert {v: b for v, b in bases.items() if b == "ddp"} == {"ddp --ddp_bucket_cap_mb 6.25": "ddp",
                                                              "ddp --ddp_bucket_cap_mb 100": "ddp"}
    rows = plan.plan(["--preset", "small"], 8, 8, 10.0, 64, h100(), [*VARIED, *bases], ("none",), [8], bases=bases)
    by = {Path(r["config"]).name: r for r in rows}
    assert all("refused" not in r for r in rows), [r.get("refused") for r in rows]
    quarter, x4, z2 = by["z2.buckets_quarter.json"], by["z2.buckets_x4.json"], by["z2.json"]
    assert quarter["comm_ms"] > z2["comm_ms"] > x4["comm_ms"]  # latency per call: 4x the calls, a quarter
    assert quarter["est_peak_gb"] < z2["est_peak_gb"] < x4["est_peak_gb"]  # the buckets are allocated whole
    for variant, base in (("z3.no_prefetch.json", "z3.json"), ("full_shard.no_backward_prefetch.yaml", "full_shard.yaml")):
        assert by[base]["wait_ms"] == 0 < by[variant]["wait_ms"]
        assert by[variant]["pred_samples_per_s"] < by[base]["pred_samples_per_s"]
        assert by[variant]["base"] == f"{'ds_configs' if base.endswith('json') else 'fsdp_configs'}/{base}"
    assert by["z3.no_prefetch.json"]["comm_ms"] + by["z3.no_prefetch.json"]["wait_ms"] == pytest.approx(
        by["z3.json"]["comm_ms"])  # the same bytes and calls
    assert by["z3.no_prefetch.json"]["est_peak_gb"] <= by["z3.json"]["est_peak_gb"]
    # more parameters kept whole: the estimator reads it; the theory's bytes do not (--counted does)
    assert by["z3.persistence_x100.json"]["est_peak_gb"] != by["z3.json"]["est_peak_gb"]
    assert by["z3.persistence_x100.json"]["step_ms"] == by["z3.json"]["step_ms"]
    command = shlex.split(by["z3.no_prefetch.json"]["command"])
    assert command[command.index("--deepspeed_config") + 1] == str(tmp_path / "v" / "z3.no_prefetch.json")
    ran = dry_run(["--preset", "small", *by["z3.no_prefetch.json"]["candidate"].flags()], 8)
    assert ran["plan"]["config"]["zero_optimization"]["stage3_prefetch_bucket_size"] == 0
    # DDP of GPT-lite small (10960896 bytes of fp32 gradients): by default a first bucket of 1234944 bytes
    # (1 MiB or more) and the rest, 9725952, waiting after backward; 6.25 MiB buckets, 6566400 and
    # 4394496 waiting; 100 MiB, one bucket, all of it waiting
    quarter, x4, ddp = by["ddp --ddp_bucket_cap_mb 6.25"], by["ddp --ddp_bucket_cap_mb 100"], by["ddp"]
    assert quarter["base"] == x4["base"] == "ddp"
    total = 2740224 * 4
    for row, waits, calls in ((ddp, 9725952 / total, 2), (quarter, 4394496 / total, 2), (x4, 1.0, 1)):
        assert row["wait_ms"] / (row["comm_ms"] + row["wait_ms"]) == pytest.approx(waits)
        assert row["calls"] == calls
    assert quarter["est_peak_gb"] == ddp["est_peak_gb"] == x4["est_peak_gb"]
    flags = quarter["candidate"].flags()
    assert flags[:4] == ["--backend", "ddp", "--ddp_bucket_cap_mb", "6.25"]
    assert quarter["candidate"].run_name() == "ddp-ddp_bucket_cap_mb-6.25-mb8x1-none"
    ran = dry_run(["--preset", "small", *flags], 8)
    assert ran["run"]["ddp_bucket_cap_mb"] == 6.25 and ran["run"]["backend"] == "ddp"


def test_variants_are_not_rewritten(tmp_path):
    """The same variants again reuse the files; a file of that name with other contents is refused
    before anything is written."""
    first = plan.write_variants(["ds_configs/z3.json"], str(tmp_path))
    mtimes = {p: Path(p).stat().st_mtime_ns for p in first}
    assert plan.write_variants(["ds_configs/z3.json"], str(tmp_path)) == first
    assert {p: Path(p).stat().st_mtime_ns for p in first} == mtimes
    (tmp_path / "z2.buckets_quarter.json").mkdir()  # not a file: refused too, in one line
    with pytest.raises(ConfigError, match="z2.buckets_quarter.json exists with other contents"):
        plan.write_variants(["ds_configs/z2.json"], str(tmp_path))
    (tmp_path / "z2.buckets_quarter.json").rmdir()
    (tmp_path / "z2.buckets_x4.json").write_text("{}\n")
    with pytest.raises(ConfigError, match="z2.buckets_x4.json exists with other contents"):
        plan.write_variants(["ds_configs/z2.json"], str(tmp_path))
    assert not (tmp_path / "z2.buckets_quarter.json").exists()
    assert (tmp_path / "z2.buckets_x4.json").read_text() == "{}\n"


def test_a_candidates_run_config_is_what_train_py_parses_from_its_flags():
    """A candidate's RunConfig (the model's, parsed once, with the candidate's choices set field by
    field) is the one train.py parses from the model's flags and the candidate's: a backend's name, a
    file, a flag variant, full and selective checkpointing, and a model flag the user gave."""
    from core.config import RunConfig
    from training.cli import config_from_argv

    model = [*TINY, "--precision", "bf16"]
    parsed = config_from_argv(model)
    bases = {"ddp --ddp_bucket_cap_mb 6.25": "ddp"}
    for cand in plan.candidates(["ddp", "fsdp2", "ds_configs/z3.json", "fsdp_configs/full_shard.yaml", *bases], 2, 16,
                                ("none", "full/2", "selective/1"), bases=bases):
        got = cand.run_config(parsed)
        assert isinstance(got, RunConfig) and got == config_from_argv([*model, *cand.flags()]), cand
    cand = plan.Candidate("ddp", 4, 2, "none")
    assert cand.run_config(parsed, device="cuda") == config_from_argv([*model, *cand.flags(), "--device", "cuda"])
