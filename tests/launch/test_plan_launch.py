"""The planner as a process (launch tier): its JSON answer, Ctrl-C, and the calibration's processes
(deaf to Ctrl-C, stopped with the plan, a silent end failing the plan)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis import plan
from conftest import REPO, base_env

TINY = ["--preset", "tiny"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "analysis.plan", *args], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.launch
def test_the_cli_answers_in_json_for_a_named_gpu():
    proc = _cli("--world", "8", "--gpu", "H100-SXM", "--mem_budget_gb", "10", "--global_batch", "64",
                "--configs", "ddp", "ds_configs/z3.json", "--ckpt", "none", "full/1", "--micro_batches", "8", "--json",
                *TINY)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["candidates"]) == 4 and out["pick"] == out["candidates"][0]["command"]
    assert all({"command", "est_peak_gb", "pred_samples_per_s", "fits"} <= set(c) for c in out["candidates"])


@pytest.mark.launch
def test_ctrl_c_is_one_line_exit_130_and_writes_nothing(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the plan's whole process group) once the plan says it is
    calibrating: one line, exit code 130, no traceback (from the plan or from a process it started),
    no --out written. 130 is 128 + SIGINT, what a shell reports for a command Ctrl-C stopped and what
    sweep.py returns; 2 would say bad input."""
    import signal

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "analysis.plan", "--world", "2", "--gpu", "here", "--mem_budget_gb",
                             "1", "--global_batch", "16", "--out", str(out), *TINY], cwd=REPO, env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # as from a terminal: a shell's background job (`make test &`) starts with SIGINT
                            # ignored, which the plan would rightly inherit
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    before = []  # what it said before its progress line
    while not (before and before[-1].startswith("calibrating this machine")):
        before.append(proc.stderr.readline())
        assert before[-1], "".join(before)  # it ended without saying it calibrates
    os.killpg(proc.pid, signal.SIGINT)
    stdout, rest = proc.communicate(timeout=300)  # until every process holding its stderr has ended
    assert proc.returncode == 130, rest
    lines = rest.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m analysis.plan: stopped (Ctrl-C)"), rest
    assert "Traceback" not in "".join(before) + stdout + rest and stdout == ""
    assert not out.exists()


@pytest.mark.launch  # a process started
def test_the_calibrations_processes_ignore_ctrl_c_and_stop_with_the_plan():
    """The plan's own processes (the calibration's, the link probe's) start with SIGINT ignored, so a
    Ctrl-C to the terminal's group reaches the plan alone, which stops them as it leaves."""
    import multiprocessing
    import signal

    from analysis.plan.device import started

    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(300,))
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with started([proc]):
            python = os.path.realpath(sys.executable)
            for _ in range(600):  # started through a shell script: until it has become Python
                if os.path.realpath(f"/proc/{proc.pid}/exe") == python:
                    break
                time.sleep(0.05)
            status = Path(f"/proc/{proc.pid}/status").read_text()
            ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
            assert ignored & (1 << (signal.SIGINT - 1))  # inherited through exec: ignored from its first instruction
            assert signal.getsignal(signal.SIGINT) == handler  # this process's own handler stayed
            raise KeyboardInterrupt
    assert proc.exitcode == -signal.SIGTERM  # stopped, not left running


@pytest.mark.launch
def test_a_calibration_process_that_ends_without_a_word_fails_the_plan_not_hangs_it():
    """gather_messages (calibrate_together's wait for its processes' figures): one message a process,
    as they come; a process that ends without one (here: os._exit(3), as a killed or mis-started one)
    raises naming its exit code, and the one still running is stopped, where the wait was for ever."""
    import multiprocessing as mp
    import time

    from analysis.plan.device import gather_messages

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=queue.put, args=({"rank": r},)) for r in range(2)]
    for p in procs:
        p.start()
    assert sorted(m["rank"] for m in gather_messages(queue, procs, "two")) == [0, 1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=os._exit, args=(3,)), ctx.Process(target=time.sleep, args=(60,))]
    for p in procs:
        p.start()
    with pytest.raises(RuntimeError, match="a process ended without a word .*3"):
        gather_messages(queue, procs, "the calibration in 2 processes", poll_s=0.2)
    procs[1].join(10)
    assert procs[1].exitcode is not None  # stopped, not left running
