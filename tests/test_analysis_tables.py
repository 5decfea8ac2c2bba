"""analysis' tables on hand-made records: which runs are compared with which (fast, no launches)."""

import pandas as pd

from analysis import load_runs, tables
from core.records import atomic_write_json
from core.summary import RunSummary


def _record(root, name, backend, model, model_args, samples_per_s, run_flags=None):
    summary = RunSummary(name, "ok", backend=backend, model=model, preset="tiny" if model == "gptlite" else None,
                         world_size=2, micro_batch=4, global_batch=8, precision="fp32", ckpt_interval=0,
                         samples_per_s=samples_per_s, mem_peak_bytes=2**20 * samples_per_s)
    atomic_write_json(root / name / "summary.json", summary.to_dict())
    atomic_write_json(root / name / "config.json", {"run": {"model": model, "model_args": model_args, "backend": backend,
                                                            **(run_flags or {})}})


def test_two_sizes_of_one_model_are_two_models(tmp_path):
    """hf:gpt2 at two sizes (a sweep's labels small and big), each with DDP and FSDP: each FSDP run
    is compared with its own size's DDP run, and the tables say which model each row is."""
    for size, args, rate in (("small", "n_layer=2,n_embd=64", 100.0), ("big", "n_layer=4,n_embd=128", 10.0)):
        _record(tmp_path, f"ddp-{size}", "ddp", "hf:gpt2", args, rate)
        _record(tmp_path, f"fsdp-{size}", "fsdp", "hf:gpt2", args, rate / 2)
    _record(tmp_path, "ddp-gptlite", "ddp", "gptlite", None, 50.0)
    _record(tmp_path, "ddp-gptlite-2", "ddp", "gptlite", None, 80.0, {"n_layer": 2})
    runs = load_runs(tmp_path)
    assert sorted(set(runs["model"])) == ["gptlite", "gptlite n_layer=2", "hf_gpt2 n_embd=128,n_layer=4",
                                          "hf_gpt2 n_embd=64,n_layer=2"]
    ratios = tables.ddp_ratios(runs)
    fsdp = ratios[ratios["config"] == "fsdp"]
    assert len(fsdp) == 2 and fsdp["samples/s vs DDP"].tolist() == [0.5, 0.5]
    assert set(fsdp["model"]) == {"hf_gpt2 n_embd=128,n_layer=4", "hf_gpt2 n_embd=64,n_layer=2"}
    assert set(ratios.loc[ratios["config"] == "ddp", "samples/s vs DDP"]) == {1.0}


def test_the_failures_table_shows_one_line_per_error_of_older_records_too():
    from analysis.tables import failures

    runs = pd.DataFrame({"run_name": ["a", "b"], "status": ["failed", "ok"],
                         "error": ["InternalTorchDynamoError: KeyboardInterrupt:\n\nSet TORCH_LOGS=...", None]})
    table = failures(runs)
    assert list(table["error"]) == ["InternalTorchDynamoError: KeyboardInterrupt:"]


def test_the_budget_table_sets_each_auto_run_beside_the_fastest_hand_set_run_that_fits(tmp_path):
    """Hand-made records: two auto runs (0.2 and 0.1 GiB) and three hand-set runs of the same
    configuration; per budget, only the hand-set runs whose measured peak fits are candidates, and
    another model's runs never are. An auto run over its budget shows it (peak / budget > 1)."""
    mib = 2**20

    def record(name, rate, peak_mib, flags, model="gptlite", status="ok"):
        summary = RunSummary(name, status, backend="ddp", model=model, preset="tiny", world_size=2, micro_batch=4,
                             global_batch=8, precision="fp32", ckpt_interval=flags.get("ckpt_interval", 0),
                             samples_per_s=rate, mem_peak_bytes=peak_mib * mib)
        atomic_write_json(tmp_path / name / "summary.json", summary.to_dict())
        atomic_write_json(tmp_path / name / "config.json", {"run": {"model": model, "backend": "ddp", **flags}})

    record("none", 30.0, 300, {})
    record("full-1", 10.0, 80, {"ckpt_interval": 1, "ckpt_impl": "torch_nonreentrant"})
    record("full-2", 20.0, 150, {"ckpt_interval": 2, "ckpt_impl": "torch_nonreentrant"})
    record("other-model-full-1", 99.0, 50, {"ckpt_interval": 1}, model="hf:gpt2")
    auto = {"ckpt_policy": "auto", "ckpt_plan": "full,selective,none,none"}
    record("auto-0.2", 25.0, 190, {**auto, "mem_budget_gb": 200 / 1024})
    record("auto-0.1", 12.0, 105, {**auto, "mem_budget_gb": 100 / 1024}, status="oom")
    table = tables.budget_table(load_runs(tmp_path)).set_index("budget GiB")
    high, low = table.loc[200 / 1024], table.loc[100 / 1024]
    assert high["fastest hand-set that fits"] == "every 2 (torch_nonreentrant)" and high["its samples/s"] == 20.0
    assert high["auto / it"] == 1.25 and high["plan"] == "full, selective, none x2"
    assert low["fastest hand-set that fits"] == "every 1 (torch_nonreentrant)" and low["status"] == "oom"
    assert low["peak / budget"] == 1.05 and pd.isna(low["samples/s"])
