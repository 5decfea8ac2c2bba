"""analysis.project: every backend projected to W GPUs; the model behaves as a model should."""

import json
import subprocess
import sys

import pytest
import yaml

from analysis.project import HARDWARE, Assumptions, configurations, count, project
from conftest import REPO, base_env, python

HW = yaml.safe_load(HARDWARE.read_text())
H100 = HW["gpus"]["H100-SXM"]
# The article's run, as train.py's flags.
PAPER = ["--preset", "paper", "--micro_batch", "1", "--precision", "bf16", "--attention", "sdpa"]
TINY = ["--preset", "tiny", "--micro_batch", "1", "--precision", "bf16", "--attention", "sdpa"]


def _project(entry, world, net, gpu=H100, nvlink_latency_us=HW["nvlink_latency_us"], **assumptions):
    return project(entry, PAPER, world, gpu, net, nvlink_latency_us, Assumptions(**assumptions))


@pytest.mark.launch
def test_the_cli_projects_every_backend_to_8_and_64_gpus(tmp_path):
    proc = python("-m", "analysis.project", "--world", "8", "64", "--gpu", "H100-SXM", "--out", tmp_path, *PAPER,
                  timeout=600)
    assert proc.returncode == 0, proc.stderr
    for label in ("ddp", "deepspeed.z1", "deepspeed.z3", "fsdp.full_shard", "fsdp2.fsdp2", "fsdp.hybrid_shard"):
        assert label in proc.stdout
    assert "W = 8:" in proc.stdout and "W = 64:" in proc.stdout and "article  11.45" in proc.stdout
    assert "assumptions: MFU" in proc.stdout
    assert (tmp_path / "samples_vs_gpus.png").stat().st_size > 0 and (tmp_path / "projection.md").exists()


def test_without_communication_cost_every_non_offloading_backend_runs_at_compute_speed():
    free = {"gb_s_per_gpu": 1e12, "latency_us": 0.0}
    free_nvlink = {**H100, "nvlink_gb_s": 1e12}
    rates = {e: _project(e, 64, free, gpu=free_nvlink, nvlink_latency_us=0.0, overlap=0.0)["samples/s"]
             for e in configurations() if "offload" not in e and "infinity" not in e}
    assert max(rates.values()) == pytest.approx(min(rates.values()), rel=1e-3)
    # and with the real links, communication costs time: no backend is faster than compute alone
    real = {e: _project(e, 64, HW["networks"]["infiniband-ndr"], overlap=0.0)["samples/s"] for e in rates}
    assert all(real[e] < rates[e] for e in rates)


def test_a_slower_network_never_speeds_a_backend_up_and_zero3_moves_more_than_ddp():
    fast, slow = HW["networks"]["infiniband-ndr"], HW["networks"]["ethernet-100g"]
    for entry in ("ddp", "ds_configs/z1.json", "ds_configs/z3.json", "fsdp_configs/full_shard.yaml"):
        assert _project(entry, 64, slow)["samples/s"] < _project(entry, 64, fast)["samples/s"]
    z3, z1 = _project("ds_configs/z3.json", 64, fast), _project("ds_configs/z1.json", 64, fast)
    assert z3["comm GiB/step"] == pytest.approx(1.5 * z1["comm GiB/step"])  # 3 Psi against 2 Psi, same dtypes


@pytest.mark.parametrize("flags", [pytest.param(["--mfu", "0"], marks=pytest.mark.launch), ["--world", "12"], ["--gpus", "8"], ["--overlap", "2"], ["--configs", "single"],
                                   ["--configs", "ds_configs/z9.json"], ["--backend", "ddp"],
                                   ["--deepspeed_config", "ds_configs/z3.json"], ["--device", "cpu"],
                                   ["--micro_batch", "0"], ["--model", "hf:nosuchmodel"], ["--preset", "huge"]])
def test_bad_arguments_are_refused(flags):
    if flags == ["--mfu", "0"]:  # one as a process: its exit code and its one line
        proc = subprocess.run([sys.executable, "-m", "analysis.project", "--gpu", "H100-SXM", *flags], cwd=REPO,
                              env=base_env(), capture_output=True, text=True, timeout=120)
    else:
        from analysis.project import main
        from conftest import in_process

        proc = in_process(main, ["--gpu", "H100-SXM", *flags])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "--gpu here" not in proc.stderr, proc.stderr  # refused for its own flag, not for the device


def test_gpu_here_is_this_machines_gpu_as_the_hardware_file_names_it(capsys, monkeypatch):
    """--gpu's default (here) has one meaning in every tool: this machine's device. The projection is to
    GPUs: here on a machine without a GPU hardware.yaml lists is refused in one line naming the choices."""
    import torch

    from analysis.project import gpu_here, main

    assert [gpu_here(HW, name) for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB",
                                            "Tesla V100-SXM2-32GB", "NVIDIA L4")] == \
        ["H100-SXM", "H200", "A100-SXM", "V100-SXM2", None]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, here or not
    with pytest.raises(SystemExit) as refused:
        main(["--preset", "tiny"])
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(err.splitlines()) == 1
    assert "--gpu here: this machine has no GPU" in err and "H100-SXM" in err, err


def test_json_prints_the_tables_rows(capsys):
    from analysis.project import Assumptions, main, table

    assert main(["--gpu", "H100-SXM", "--world", "8", "--json", "--preset", "tiny"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = table(["--preset", "tiny"], [8], "H100-SXM", "infiniband-ndr", Assumptions())
    assert printed["gpu"] == "H100-SXM" and printed["assumptions"]["mfu"] == Assumptions.mfu
    assert [r["config"] for r in printed["rows"]] == list(expected["config"])
    assert [r["samples/s"] for r in printed["rows"]] == pytest.approx(list(expected["samples/s"]))


def test_what_would_fail_later_is_refused_before_any_work(tmp_path, capsys):
    """Repeated world sizes or configurations, --out onto a file, a DeepSpeed file that is not JSON:
    one line, exit 2, before any configuration is projected (they failed with tracebacks, the bad file
    after the others' work)."""
    from analysis.project import main

    bad, taken = tmp_path / "bad.json", tmp_path / "taken"
    bad.write_text('{"train_batch_size": ')
    taken.write_text("x")
    for flags, message in ((["--world", "8", "8"], "--world: each at most once"),
                           (["--configs", "ddp", "ddp"], "--configs: each at most once"),
                           (["--out", str(taken)], f"{taken} exists and is not a directory"),
                           (["--configs", "ddp", str(bad)], "not valid JSON")):
        with pytest.raises(SystemExit) as refused:
            main(["--preset", "tiny", "--gpu", "H100-SXM", *flags])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert taken.read_text() == "x"


@pytest.mark.distributed
def test_counted_bytes_are_the_backends_real_ones_at_w():
    """Counted under the fake process group at 8 ranks: DDP's all-reduce is its theory; the shipped
    ZeRO-3 config gathers once where the theory gathers twice (the 0.667 measured on 2 real ranks,
    tests/unit/test_comm.py), and the projection's step follows the counted bytes."""
    net = HW["networks"]["infiniband-ndr"]
    rows = {}
    for entry in ("ddp", "ds_configs/z3.json"):
        counted = count(entry, TINY, 8, H100["gpus_per_node"])
        assert counted["status"] == "ok" and counted["world_size"] == 8
        rows[entry] = (counted, project(entry, TINY, 8, H100, net, HW["nvlink_latency_us"], Assumptions(), counted),
                       project(entry, TINY, 8, H100, net, HW["nvlink_latency_us"], Assumptions()))
    ddp, z3 = rows["ddp"][0]["comm"], rows["ds_configs/z3.json"][0]["comm"]
    assert ddp["collectives"]["all_reduce"]["bytes"] == ddp["theory"]["by_kind"]["all_reduce"]["bytes"]
    assert z3["measured_over_theory"] == pytest.approx(2 / 3, rel=0.02)
    for counted, with_counts, with_theory in rows.values():
        assert with_counts["bytes"] == "counted" and with_theory["bytes"] == "theory"
        assert with_counts["comm GiB/step"] == pytest.approx(counted["comm"]["bus_bytes"] / 2**30)
    assert rows["ds_configs/z3.json"][1]["comm GiB/step"] < rows["ds_configs/z3.json"][2]["comm GiB/step"]


def test_any_model_that_trains_is_projected_from_train_py_flags():
    """An HF Llama (a user's model, not a GPT-lite preset) projects: its parameters set the bytes, its
    counted FLOPs the compute; more accumulation is more samples per step at the same bytes; the
    resolved run is train.py's (an FSDP file at --precision bf16 runs bf16)."""
    llama = ["--model", "hf:llama", "--model_args", "num_hidden_layers=4,hidden_size=256,num_attention_heads=4,"
             "num_key_value_heads=4,intermediate_size=512", "--block_size", "128", "--precision", "bf16",
             "--micro_batch", "2"]
    net = HW["networks"]["infiniband-ndr"]
    ddp = project("ddp", llama, 8, H100, net, HW["nvlink_latency_us"], Assumptions())
    tiny = project("ddp", TINY, 8, H100, net, HW["nvlink_latency_us"], Assumptions())
    assert ddp["comm GiB/step"] > tiny["comm GiB/step"] and ddp["compute ms"] > 0
    more = project("ddp", [*llama, "--grad_accum", "2"], 8, H100, net, HW["nvlink_latency_us"], Assumptions())
    assert more["compute ms"] == pytest.approx(2 * ddp["compute ms"]) and more["comm GiB/step"] == ddp["comm GiB/step"]
    fp32 = project("fsdp_configs/shard_grad_op.yaml", [*llama, "--precision", "fp32"], 8, H100, net,
                   HW["nvlink_latency_us"], Assumptions())
    bf16 = project("fsdp_configs/shard_grad_op.yaml", llama, 8, H100, net, HW["nvlink_latency_us"], Assumptions())
    assert bf16["memory GiB"] < fp32["memory GiB"] and bf16["compute ms"] < fp32["compute ms"]
