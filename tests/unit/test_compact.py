"""analysis.compact: a records folder packed into one records.jsonl keeps the records and the JSON beside
them and nothing else, reads back as the folder it was (paths inside it, load_runs), unpacks to it, and
refuses in one line what would write over or into something (no launches: fast)."""

import json

import pytest

from analysis import compact, load_runs
from conftest import in_process


def _record(directory, name, samples_per_s, **summary):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({
        "schema_version": 1, "run": {"backend": "ddp", "run_name": name, "model": "gptlite", "micro_batch": 4},
        "world_size": 2}))
    (directory / "summary.json").write_text(json.dumps({
        "schema_version": 1, "run_name": name, "status": "ok", "backend": "ddp", "world_size": 2,
        "samples_per_s": samples_per_s, **summary}))


@pytest.fixture
def raw(tmp_path):
    """A benchmark's scratch folder: records with their logs, locks, per-step metrics, sweep keys and
    error files; JSON beside them; DeepSpeed's autotuner's experiments; a figure."""
    d = tmp_path / "raw"
    _record(d / "m" / "grid" / "a-r0", "a-r0", 10.0)
    _record(d / "m" / "grid" / "a-r1", "a-r1", 12.0, mem_peak_bytes=5)
    for record in ("a-r0", "a-r1"):
        (d / "m" / "grid" / record / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
        (d / "m" / "grid" / record / "sweep_key.json").write_text("{}")
    (d / "m" / "grid" / "a-r1" / "errors").mkdir()
    (d / "m" / "grid" / "a-r1" / "errors" / "rank0.json").write_text('{"error": "x"}')
    (d / "m" / "grid" / ".locks").mkdir()
    (d / "m" / "grid" / ".locks" / "a-r0.lock").write_text("")
    (d / "m" / "grid" / ".logs").mkdir()
    (d / "m" / "grid" / ".logs" / "a-r0.log").write_text("a log\n")
    (d / "m" / "grid.json").write_text(json.dumps([{"name": "a-r0", "seconds": 3.0}]))
    (d / "m" / "plan.json").write_text(json.dumps({"pick": "run a", "candidates": []}))
    (d / "m" / "plan").mkdir()
    (d / "m" / "plan" / "plan.png").write_bytes(b"\x89PNG")
    tuned = d / "m" / "autotune"
    (tuned / "exps").mkdir(parents=True)
    (tuned / "exps" / "z0_gas1.json").write_text("{}")
    (tuned / "results" / "z0_gas1").mkdir(parents=True)
    for name in ("exp.json", "metrics.json", "ds_config.json"):
        (tuned / "results" / "z0_gas1" / name).write_text("{}")
    (tuned / "results" / "ds_config_optimal.json").write_text('{"zero_optimization": {"stage": 1}}')
    (d / "README.md").write_text("# What these are\n")
    return d


def test_the_compact_form_is_the_records_and_the_json_beside_them(raw, tmp_path):
    out = compact.write(raw, tmp_path / "kept")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line.get("run") or line.get("file") for line in lines] == [
        "m/autotune/results/ds_config_optimal.json", "m/grid.json", "m/grid/a-r0", "m/grid/a-r1", "m/plan.json"]
    run = lines[3]
    assert run["summary"] == json.loads((raw / "m/grid/a-r1/summary.json").read_text())
    assert run["config"] == json.loads((raw / "m/grid/a-r1/config.json").read_text())
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["README.md", compact.FILE]
    assert (tmp_path / "kept" / "README.md").read_text() == "# What these are\n"


def test_a_compact_folder_reads_as_the_folder_it_was(raw, tmp_path):
    kept = tmp_path / "kept"
    compact.write(raw, kept)
    for rel in ("m/grid.json", "m/plan.json", "m/grid/a-r0/summary.json", "m/grid/a-r1/config.json",
                "m/autotune/results/ds_config_optimal.json"):
        assert compact.is_file(kept / rel) and compact.read_json(kept / rel) == json.loads((raw / rel).read_text())
    assert compact.is_dir(kept / "m" / "grid") and not compact.is_dir(kept / "m" / "nothing")
    assert not compact.is_file(kept / "m" / "grid" / "a-r0" / "metrics.jsonl")
    with pytest.raises(FileNotFoundError):
        compact.read_json(kept / "m" / "question.json")
    assert [p.name for p in compact.iterdir(kept / "m")] == ["autotune", "grid", "grid.json", "plan.json"]
    assert [p.name for p in compact.iterdir(kept / "m" / "grid")] == ["a-r0", "a-r1"]
    assert compact.run_dirs(kept) == [kept / "m/grid/a-r0", kept / "m/grid/a-r1"]
    assert compact.run_dirs(kept / "m" / "grid" / "a-r1") == [kept / "m/grid/a-r1"]
    assert compact.run_dirs(tmp_path) == sorted([*compact.run_dirs(raw), *compact.run_dirs(kept)])  # both, once
    packed, folder = load_runs(kept), load_runs(raw)
    assert list(packed["run_name"]) == list(folder["run_name"]) == ["a-r0", "a-r1"]
    assert packed.drop(columns="run_dir").equals(folder.drop(columns="run_dir"))


def test_a_compact_folder_unpacks_to_the_records_it_holds(raw, tmp_path):
    kept = tmp_path / "kept"
    compact.write(raw, kept)
    compact.unpack(kept, tmp_path / "again")
    assert compact.pack(tmp_path / "again") == compact.pack(raw)
    compact.unpack(kept / "m" / "grid" / "a-r0", tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json", "summary.json"]
    with pytest.raises(FileExistsError):  # nothing written over
        compact.unpack(kept / "m" / "grid" / "a-r0", tmp_path / "one")


@pytest.mark.parametrize("case, message", [
    ("exists", "records.jsonl exists; give another folder (a compact file is never rewritten)"),
    ("inside", "inside runs_dir"),
    ("empty", "no run records under it"),
    ("file", "is not a directory"),
    ("damaged", "a-r1/summary.json: not JSON"),
])
def test_the_command_refuses_in_one_line_and_writes_nothing(raw, tmp_path, case, message):
    from analysis.compact import main

    out = tmp_path / "kept"
    runs_dir = raw
    if case == "exists":
        out.mkdir()
        (out / compact.FILE).write_text("theirs\n")
    elif case == "inside":
        out = raw / "kept"
    elif case == "empty":
        runs_dir = tmp_path / "empty"
        runs_dir.mkdir()
    elif case == "file":
        runs_dir = raw / "README.md"
    elif case == "damaged":
        (raw / "m" / "grid" / "a-r1" / "summary.json").write_text('{"status": "ok", "run_na')  # cut off mid-write
    before = sorted(p for p in tmp_path.rglob("*"))
    proc = in_process(main, [runs_dir, "--out", out])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert sorted(p for p in tmp_path.rglob("*")) == before
    if case == "exists":
        assert (out / compact.FILE).read_text() == "theirs\n"


def test_the_command_writes_the_compact_form(raw, tmp_path):
    from analysis.compact import main

    proc = in_process(main, [raw, "--out", tmp_path / "kept"])
    assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path / "kept" / compact.FILE), proc.stderr
    assert len(load_runs(tmp_path / "kept")) == 2
