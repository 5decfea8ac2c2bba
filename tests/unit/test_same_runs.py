"""analysis.same_runs: two folders of run records hold the same runs, statuses and losses, or it names
what differs (what a change meant not to change training is held to: the demo before and after)."""

import json

from analysis.same_runs import compare, main, read_runs


def _record(folder, name, status="ok", losses=(4.0, 3.5)):
    run = folder / name
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"status": status, "samples_per_s": 1.0}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": x, "samples_per_s": 9.0 + i}) + "\n"
                                               for i, x in enumerate(losses)))


def test_the_same_records_agree_and_speed_is_not_compared(tmp_path, capsys):
    for side, speed in (("a", 1.0), ("b", 2.0)):
        _record(tmp_path / side, "ddp-w2")
        _record(tmp_path / side, "single-w1", status="failed", losses=(4.0,))
        summary = tmp_path / side / "ddp-w2" / "summary.json"
        summary.write_text(json.dumps({"status": "ok", "samples_per_s": speed}))
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "2 runs in the first, 2 in the second: the same runs, statuses and losses" in capsys.readouterr().out


def test_each_kind_of_difference_is_named(tmp_path):
    _record(tmp_path / "a", "ddp-w2")
    _record(tmp_path / "a", "fsdp-w2")
    _record(tmp_path / "a", "z3-w2")
    _record(tmp_path / "a", "gone-w2")
    _record(tmp_path / "b", "ddp-w2", losses=(4.0, 3.5 + 1e-3))
    _record(tmp_path / "b", "fsdp-w2", status="failed")
    _record(tmp_path / "b", "z3-w2", losses=(4.0,))
    _record(tmp_path / "b", "new-w2")
    problems = compare(read_runs(tmp_path / "a"), read_runs(tmp_path / "b"), rtol=1e-6)
    assert problems == ["gone-w2: only in the first folder", "new-w2: only in the second folder",
                        "ddp-w2: step 1 loss 3.5 -> 3.501", "fsdp-w2: status ok -> failed",
                        "z3-w2: steps differ (2 -> 1 logged)"]
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    # within the tolerance a loss is the same
    assert compare(read_runs(tmp_path / "a"), read_runs(tmp_path / "b"), rtol=1e-2)[2:] == [
        "fsdp-w2: status ok -> failed", "z3-w2: steps differ (2 -> 1 logged)"]


def test_a_folder_without_records_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), str(tmp_path / "empty")]) == 2
    assert main([str(tmp_path / "missing"), str(tmp_path / "empty")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 2
