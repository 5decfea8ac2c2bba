"""The training loop and a run's life cycle, in-process, through a fake Backend (no launches: fast).

What every backend relies on: the micro-step protocol (sync only on the last micro-step of a
step), the loss averaged over micro-steps, failures recorded with their status and cause, and
the bookkeeping of a resumed run (start step, metrics kept, the record continued).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

from backends.base import Backend, Resolved
from core.config import RunConfig
from core.dist import DistEnv
from core.memory import MemoryAccounting
from training.loop import accumulate_gradients
from training.lifecycle import EXIT_FAILED, EXIT_OK, Run
from training.run import prepare_run
from training.setup import Setup

TEXT = "".join(chr(ord("a") + (i * 7) % 26) for i in range(4000))


class FakeAccounting(MemoryAccounting):
    def __init__(self, backend):
        self.backend = backend

    def state_tensors(self):
        params = list(self.backend.model.parameters())
        return {"parameter": params, "gradient": [p.grad for p in params if p.grad is not None],
                "optimizer_state": []}


class FakeBackend(Backend):
    """The model unwrapped, plain SGD, every call noted; `fail` = (method, step) raises there."""

    name = "fake"
    needs_process_group = False
    instances: list["FakeBackend"] = []

    def __init__(self, cfg, env, plan=None, fail=None):
        super().__init__(cfg, env, plan)
        self.fail = fail
        self.calls: list = []
        self.steps_done = 0
        FakeBackend.instances.append(self)

    def _maybe_fail(self, method):
        if self.fail and self.fail[0] == method and self.fail[1] == self.steps_done:
            raise self.fail[2] if len(self.fail) > 2 else RuntimeError(f"boom in {method}")

    def setup(self, model):
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def micro_step(self, sync):
        self.calls.append(("micro_step", sync))
        return contextlib.nullcontext()

    def forward(self, x, y):
        self._maybe_fail("forward")
        self.calls.append("forward")
        return self.model(x, y)[1]

    def backward(self, loss):
        self.calls.append("backward")
        (loss / self.cfg.grad_accum).backward()

    def step(self):
        self._maybe_fail("step")
        self.calls.append("step")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1

    def lr(self):
        return 0.05

    def accounting(self):
        return FakeAccounting(self)

    def save_checkpoint(self, directory):
        directory.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "steps_done": self.steps_done}, directory / "fake.pt")

    def load_checkpoint(self, directory):
        state = torch.load(directory / "fake.pt")
        self.model.load_state_dict(state["model"])
        self.steps_done = state["steps_done"]


def make_setup(tmp_path, fail=None, **flags) -> Setup:
    cfg = RunConfig(**{"preset": "tiny", "dropout": 0.0, "micro_batch": 2, "grad_accum": 1, "steps": 3,
                       "warmup_steps": 0, "mem_profile_steps": 0, "eval_batches": 1, "quiet": True,
                       "runs_dir": str(tmp_path / "runs"), "run_name": "fake", "overwrite": True, "lr": 0.05,
                       "lr_warmup_steps": 0, "grad_clip": 0.0, "precision": "fp32", **flags})
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                  launcher="python")

    class Failing(FakeBackend):
        def __init__(self, cfg, env, plan=None):
            super().__init__(cfg, env, plan, fail=fail)

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    cfg = dataclasses.replace(cfg, data=str(text))
    return prepare_run(cfg, env, Resolved(Failing, cfg))


def read(tmp_path, name):
    return json.loads((tmp_path / "runs" / "fake" / name).read_text())


def metrics(tmp_path):
    return [json.loads(line) for line in (tmp_path / "runs" / "fake" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def _forget_instances():
    FakeBackend.instances.clear()


def test_gradients_sync_only_on_the_last_micro_step(tmp_path):
    assert Run(make_setup(tmp_path, grad_accum=3, steps=2)).execute() == EXIT_OK
    calls = FakeBackend.instances[-1].calls
    syncs = [c[1] for c in calls if isinstance(c, tuple)]
    assert syncs == [False, False, True, False, False, True]
    # Eval after the last step calls forward too, outside any micro-step.
    assert calls[:10] == [("micro_step", False), "forward", "backward", ("micro_step", False), "forward",
                          "backward", ("micro_step", True), "forward", "backward", "step"]


def test_the_step_loss_is_the_mean_over_micro_steps():
    class Constant(FakeBackend):
        def __init__(self):
            super().__init__(RunConfig(grad_accum=4), None)
            self.values = iter([1.0, 2.0, 3.0, 6.0])

        def forward(self, x, y):
            return torch.tensor(next(self.values), requires_grad=True)

        def backward(self, loss):
            pass

    batches = [(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))] * 4
    loss = accumulate_gradients(Constant(), batches, 4, torch.device("cpu"))
    assert loss.item() == pytest.approx(3.0)


def test_each_step_is_a_new_cuda_graph_generation_where_the_blocks_replay_cuda_graphs(monkeypatch):
    """Under a compile mode that replays CUDA graphs (reduce-overhead, max-autotune), a step's first
    forward is marked a new step for cudagraph trees (torch.compiler.cudagraph_mark_step_begin), before
    the forward, and its other micro-steps' are not: a new generation between them would overwrite the
    gradients the compiled backward made so far. Under any other mode, and without --compile, never."""
    from backends.compile import uses_cudagraphs

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append("mark"))

    class Noting(FakeBackend):
        def forward(self, x, y):
            marks.append("forward")
            return torch.zeros((), requires_grad=True)

        def backward(self, loss):
            pass

    batches = [(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))] * 3
    for flags, marked in (({"compile": True, "compile_mode": "reduce-overhead"}, True),
                          ({"compile": True, "compile_mode": "max-autotune"}, True),
                          ({"compile": True, "compile_mode": "max-autotune-no-cudagraphs"}, False),
                          ({"compile": True}, False),
                          ({"compile": True, "compile_backend": "aot_eager"}, False),
                          ({}, False)):
        backend = Noting(RunConfig(grad_accum=3, **flags), None)
        assert backend.cudagraphs is marked, flags
        marks.clear()
        accumulate_gradients(backend, batches, 3, torch.device("cpu"))
        assert marks == (["mark", "forward", "forward", "forward"] if marked else ["forward"] * 3), flags
    assert not uses_cudagraphs("aot_eager", "reduce-overhead")


def test_a_failing_step_is_recorded_with_its_cause(tmp_path):
    assert Run(make_setup(tmp_path, fail=("step", 1))).execute() == EXIT_FAILED
    summary = read(tmp_path, "summary.json")
    assert summary["status"] == "failed" and summary["error"] == "rank 0: RuntimeError: boom in step"
    assert read(tmp_path, "errors/rank0.json")["status"] == "failed"
    assert [m["step"] for m in metrics(tmp_path)] == [0]  # the step before the failure is kept


def test_out_of_memory_is_recorded_as_oom(tmp_path):
    setup = make_setup(tmp_path, fail=("forward", 2, torch.OutOfMemoryError("no room")))
    assert Run(setup).execute() == EXIT_FAILED
    summary = read(tmp_path, "summary.json")
    assert summary["status"] == "oom" and "OutOfMemoryError: no room" in summary["error"]


def test_a_resumed_run_continues_the_record_where_its_checkpoint_was(tmp_path):
    save = {"save_dir": str(tmp_path / "ckpt"), "save_every": 2}
    assert Run(make_setup(tmp_path, steps=3, **save)).execute() == EXIT_OK  # checkpoint after step 1
    first = metrics(tmp_path)
    assert Run(make_setup(tmp_path, steps=5, resume=True, **save)).execute() == EXIT_OK
    resumed = FakeBackend.instances[-1]
    assert resumed.steps_done == 5 and resumed.calls.count("step") == 3  # steps 2, 3, 4
    config, lines = read(tmp_path, "config.json"), metrics(tmp_path)
    assert config["start_step"] == 2 and config["resumed_from"].endswith("step_00000001")
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]
    assert lines[:2] == first[:2]  # the steps before the checkpoint are the first run's lines
    assert read(tmp_path, "summary.json")["status"] == "ok"
