"""A stand-in for a run's launcher, for the tests of the sweep runner's own behaviour (orchestration/runner.py:
records, keys, locks, failures, timeouts, retries, stopping): it keeps a run's side of the protocol as
train.py does (the record's lock, the sweep key from the environment, config.json, metrics.jsonl and
summary.json written atomically, one line and exit 2 for refused flags, SIGTERM recorded as a failure)
without torch, so it starts in a fraction of a second instead of a launch's seconds.

    python tests/support/stub_run.py --runs_dir R --run_name N [train.py's flags]

GPTLITE_FAULT (core/faults.py's syntax: kind=error|hang|exit,step=S[,backend=B]) makes it fail, hang or
exit at step S as a run would. tests/support/stub_sweep.py runs sweep.py with this as every run's command; the
real launches of the runner are tested end to end by tests/unit/test_sweep.py's one real sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from core.records import SWEEP_KEY_ENV, SWEEP_KEY_FILE, atomic_write_json, atomic_write_text  # noqa: E402
from core.summary import RunSummary  # noqa: E402
from training.locks import LockHeld, RecordLock  # noqa: E402

STEP_S = 0.05


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs_dir", required=True)
    p.add_argument("--run_name", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--backend")
    p.add_argument("--fsdp_config")
    p.add_argument("--deepspeed_config")
    args, _ = p.parse_known_args()
    backend = args.backend or ("deepspeed" if args.deepspeed_config else "fsdp" if args.fsdp_config else "single")
    if args.lr <= 0:  # as train.py refuses it: one line, exit 2, nothing recorded
        print(f"train.py: error: lr must be > 0 (got {args.lr})", file=sys.stderr)
        return 2
    try:
        lock = RecordLock(args.runs_dir, args.run_name)
    except LockHeld as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    record = Path(args.runs_dir) / args.run_name
    record.mkdir(parents=True, exist_ok=True)
    if os.environ.get(SWEEP_KEY_ENV):
        atomic_write_text(record / SWEEP_KEY_FILE, os.environ[SWEEP_KEY_ENV])
    atomic_write_json(record / "config.json", {"run": {"steps": args.steps, "backend": backend}, "stub": True})
    summary = RunSummary(args.run_name, backend=backend, steps=args.steps)
    atomic_write_json(record / "summary.json", summary.to_dict())
    started = time.time()

    def stopped(signum, frame):
        atomic_write_json(record / "summary.json", summary.ended(
            "failed", f"rank 0: Terminated: terminated by signal {signal.Signals(signum).name}",
            time.time() - started).to_dict())
        lock.release()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    fault = dict(part.split("=", 1) for part in os.environ["GPTLITE_FAULT"].split(",")) \
        if os.environ.get("GPTLITE_FAULT") else {}
    if fault.get("backend", backend) != backend:
        fault = {}
    for step in range(args.steps):
        print(f"step {step}", flush=True)
        if fault and int(fault["step"]) == step:
            if fault["kind"] == "exit":
                os._exit(1)
            if fault["kind"] == "hang":
                while True:
                    time.sleep(3600)
            error = f"rank 0: RuntimeError: injected fault (GPTLITE_FAULT) at step {step} (more in the log)"
            print(f"RuntimeError: injected fault (GPTLITE_FAULT) at step {step}", file=sys.stderr)
            atomic_write_json(record / "summary.json", summary.ended("failed", error, time.time() - started).to_dict())
            return 1
        with open(record / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": 4.0 - step}) + "\n")
        time.sleep(STEP_S)
    done = dataclasses.replace(summary.ended("ok", None, time.time() - started), samples_per_s=10.0,
                               final_loss=4.0 - args.steps + 1, mem_peak_bytes=2**20)
    atomic_write_json(record / "summary.json", done.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
