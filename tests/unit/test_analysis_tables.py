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


def test_a_run_with_other_dropout_is_another_model(tmp_path):
    """--dropout 0 trains another model, faster (on the H200 the paper preset compiled ran 1.21x its
    speed with the preset's dropout): never set beside DDP's run of the preset as one configuration."""
    _record(tmp_path, "ddp", "ddp", "gptlite", None, 50.0)
    _record(tmp_path, "single", "single", "gptlite", None, 50.0)
    _record(tmp_path, "single-dropout0", "single", "gptlite", None, 70.0, {"dropout": 0.0})
    runs = load_runs(tmp_path)
    assert sorted(set(runs["model"])) == ["gptlite", "gptlite dropout=0.0"]
    ratios = tables.ddp_ratios(runs)
    assert sorted(ratios["samples/s vs DDP"]) == [1.0, 1.0]  # the dropout-0 run has no DDP of its own


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


def test_the_policy_frontier_has_a_panel_per_configuration_and_its_own_pareto_points(tmp_path):
    """Hand-made records of two backends, each under several checkpointing policies, repeated: one
    point per policy label (median samples/s, largest peak over the repeats), a panel per backend,
    the policy families named, and a point on a panel's frontier only where no point of the same
    panel has a peak as low and more samples/s; a configuration run under one policy only has no
    panel."""
    from analysis import figures

    mib = 2**20

    def record(name, backend, rate, peak_mib, flags):
        summary = RunSummary(name, "ok", backend=backend, model="gptlite", preset="tiny", world_size=2, micro_batch=4,
                             global_batch=8, precision="fp32", ckpt_interval=flags.get("ckpt_interval", 0),
                             samples_per_s=rate, mem_peak_bytes=peak_mib * mib)
        atomic_write_json(tmp_path / name / "summary.json", summary.to_dict())
        atomic_write_json(tmp_path / name / "config.json", {"run": {"model": "gptlite", "backend": backend, **flags}})

    full = {"ckpt_impl": "torch_nonreentrant"}
    for r, (a, b, c) in enumerate(((30.0, 10.0, 22.0), (32.0, 12.0, 18.0), (28.0, 11.0, 20.0))):
        record(f"ddp-none-{r}", "ddp", a, 300 + r, {})
        record(f"ddp-full-1-{r}", "ddp", b, 80, {"ckpt_interval": 1, **full})
        record(f"ddp-sel-1-{r}", "ddp", c, 150, {"ckpt_interval": 1, "ckpt_policy": "selective", **full})
    record("ddp-full-2", "ddp", 9.0, 200, {"ckpt_interval": 2, **full})  # dominated by selective every 1
    record("ddp-auto", "ddp", 25.0, 190, {"ckpt_policy": "auto", "ckpt_plan": "full,selective,none,none",
                                          "mem_budget_gb": 0.2})
    record("fsdp-none", "fsdp", 40.0, 200, {})
    record("fsdp-full-1", "fsdp", 20.0, 50, {"ckpt_interval": 1, **full})
    record("single-none", "single", 40.0, 200, {})
    points = figures.policy_panels(load_runs(tmp_path)).set_index(["panel", "ckpt"])
    panels = sorted({p for p, _ in points.index})
    assert len(panels) == 2 and panels[0].startswith("gptlite ddp, 2 rank(s)") and "fsdp" in panels[1]
    ddp = points.loc[panels[0]]
    assert ddp.loc["none", "samples_per_s"] == 30.0 and ddp.loc["none", "mem_peak_bytes"] == 302 * mib
    assert ddp.loc["none", "runs"] == 3 and ddp.loc["every 1 (torch_nonreentrant, selective)", "samples_per_s"] == 20.0
    assert ddp["policy"].to_dict() == {"auto 0.2 GiB: full, selective, none x2": "auto (budget)",
                                       "every 1 (torch_nonreentrant)": "full every k",
                                       "every 1 (torch_nonreentrant, selective)": "selective every k",
                                       "every 2 (torch_nonreentrant)": "full every k", "none": "none"}
    assert ddp.index[ddp["front"]].tolist() == ["auto 0.2 GiB: full, selective, none x2", "every 1 (torch_nonreentrant)",
                                                "every 1 (torch_nonreentrant, selective)", "none"]
    assert points.loc[panels[1], "front"].all()


def test_a_ratio_to_ddp_inside_the_runs_spread_is_a_tie(tmp_path):
    """Each run's spread is its timed steps' quartiles of samples/s: FSDP at 0.9 of DDP whose ranges
    overlap is a tie; ZeRO at 0.5 with ranges apart is slower; a record without quartiles (older
    than them) says nothing rather than guess."""
    def record(name, backend, rate, p25, p75):
        summary = RunSummary(name, "ok", backend=backend, model="gptlite", preset="tiny", world_size=2, micro_batch=4,
                             global_batch=8, precision="fp32", ckpt_interval=0, samples_per_s=rate,
                             samples_per_s_p25=p25, samples_per_s_p75=p75, mem_peak_bytes=2**20, mem_avg_bytes=2**19,
                             model_state_bytes={"total": 2**18})
        atomic_write_json(tmp_path / name / "summary.json", summary.to_dict())
        atomic_write_json(tmp_path / name / "config.json", {"run": {"model": "gptlite", "backend": backend}})

    record("ddp", "ddp", 100.0, 90.0, 105.0)
    record("fsdp", "fsdp", 90.0, 85.0, 95.0)
    record("zero", "deepspeed", 50.0, 45.0, 60.0)
    record("old", "single", 120.0, None, None)
    ratios = tables.ddp_ratios(load_runs(tmp_path)).set_index("config")
    assert ratios.loc["fsdp", "samples/s vs DDP"] == 0.9 and ratios.loc["fsdp", "within noise?"] == "tie"
    assert ratios.loc["deepspeed", "within noise?"] == "slower" and ratios.loc["ddp", "within noise?"] == "tie"
    assert ratios.loc["single", "within noise?"] == ""
    main = tables.main_table(load_runs(tmp_path)).set_index("config")
    assert main.loc["ddp", "spread"] == 0.15 and pd.isna(main.loc["single", "spread"])
    assert tables.within_spread((1.0, 2.0), (2.0, 3.0)) and not tables.within_spread((1.0, 2.0), (2.5, 3.0))
