"""No tool writes into what a run owns (core/owned.py): every --out (and a run's or a sweep's runs_dir)
inside a record or a checkpoint directory is refused in one line, exit 2, nothing changed (issue 39,
cases 1-3). In process: the tools' mains, no launch; tests/launch/test_checkpoints.py holds export and
fake_world to the same on a checkpoint directory a real run wrote."""

import hashlib
import json

import pytest
import yaml

from analysis import compact
from conftest import REPO, in_process
from core.owned import is_checkpoint_dir, is_record, owner_of

# A real run's record, written out of its compact folder (analysis/compact.py) as it was on disk.
REFERENCE = REPO / "runs" / "reference" / "nvidia-h100-80gb-hbm3" / "gpu_reference" / "single-w1-paper-mb8-bf16-ckpt0"


@pytest.fixture
def owned(tmp_path):
    """A record (a real one, written out) and a checkpoint directory in training/checkpoint.py's layout."""
    runs = tmp_path / "runs"
    record = runs / "r"
    compact.unpack(REFERENCE, record)
    ck = tmp_path / "CK"
    step = ck / "step_00000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 4}))
    (ck / "latest").write_text("step_00000004\n")
    (ck / "owner.json").write_text(json.dumps({"run_id": "x"}))
    return runs, record, ck


def _snapshot(*roots):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for root in roots for p in sorted(root.rglob("*"))}


def _targets(record, ck, file: bool):
    """Paths that write into the record or the checkpoint directory: its files, or the directories."""
    if file:
        return [record / "summary.json", record / "errors" / "rank0.json", ck / "latest", ck / "step_00000004" / "meta.json",
                ck / "owner.json", ck / "new.pt"]
    return [record, record / "report", ck, ck / "step_00000004", ck / "step_00000004" / "figures"]


def _export(out, runs, ck):
    from training import export

    return in_process(export.main, [ck, "--out", out])


def _fake_world(out, runs, ck):
    from simulation import fake_world

    return in_process(fake_world.main, ["--world", "2", "--out", out, "--", "--preset", "tiny", "--steps", "2"])


def _report(out, runs, ck):
    from analysis import report

    return in_process(report.main, [runs, "--out", out])


def _claims(out, runs, ck):
    from analysis import claims

    return in_process(claims.main, [runs, "--out", out])


def _project(out, runs, ck):
    from analysis import project

    return in_process(project.main, ["--gpu", "H100-SXM", "--out", out, "--", "--preset", "tiny"])


def _plan(out, runs, ck):
    from analysis import plan

    return in_process(plan.main, ["--world", "2", "--mem_budget_gb", "1", "--global_batch", "8", "--out", out,
                                  "--", "--preset", "tiny"])


def _train(out, runs, ck):
    import train
    from training.cli import build_parser, parse_args
    from training.run import main

    parser = build_parser(description=train.DESCRIPTION, examples=train.EXAMPLES)
    return in_process(lambda a: main(parse_args(a, parser=parser)),
                      ["--preset", "tiny", "--steps", "1", "--runs_dir", out, "--run_name", "new"])


def _sweep(out, runs, ck):
    import sweep

    spec = runs.parent / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "s", "runs_dir": str(out), "steps": 1,
                                    "matrix": {"backend": ["single"], "preset": ["tiny"]}}))
    return in_process(sweep.main, [spec])


# Every tool's --out names a directory; those whose --out once named a file (export, fake_world) are
# tried with files' paths too.
FILE_TOOLS = {"export": _export, "fake_world": _fake_world}
DIR_TOOLS = {"report": _report, "claims": _claims, "project": _project, "plan": _plan, "train.py runs_dir": _train,
             "sweep runs_dir": _sweep, **FILE_TOOLS}


@pytest.mark.parametrize("tool, file", [(t, True) for t in FILE_TOOLS] + [(t, False) for t in DIR_TOOLS])
def test_no_tool_writes_into_a_record_or_a_checkpoint_directory(owned, tool, file):
    runs, record, ck = owned
    call = DIR_TOOLS[tool]
    for target in _targets(record, ck, file):
        before = _snapshot(record, ck)
        proc = call(target, runs, ck)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (target, proc.stdout[-1000:], proc.stderr[-2000:])
        assert len(lines) == 1 and str(target) in lines[0] and ("record" in lines[0] or "checkpoint" in lines[0]), \
            (target, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert _snapshot(record, ck) == before, target


def test_what_a_run_owns_is_recognised_and_nothing_else(owned, tmp_path):
    runs, record, ck = owned
    assert is_record(record) and not is_record(runs) and not is_record(ck)
    assert is_checkpoint_dir(ck) and is_checkpoint_dir(ck / "step_00000004") and not is_checkpoint_dir(record)
    assert owner_of(record / "summary.json") == f"the record {record.resolve()}"
    assert owner_of(ck / "step_00000004" / "model" / "x") == f"the checkpoint directory {(ck / 'step_00000004').resolve()}"
    # Beside them, in the runs directory or a fresh one: free.
    assert owner_of(runs / "report") is None and owner_of(runs) is None and owner_of(tmp_path / "new" / "a.json") is None
    # A directory that merely holds a config.json of something else is not a record.
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "config.json").write_text(json.dumps({"lr": 1}))
    assert owner_of(tmp_path / "proj" / "out.json") is None
