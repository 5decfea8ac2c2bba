"""Probe: the losses and first-step gradients of several backends under several activation-
checkpointing settings, in ONE launch (python or torchrun): every group of cases shares the process
group, one after another, so the suite starts one launch for what used to be twenty.

    python -m torch.distributed.run --nproc_per_node 2 tests/support/ckpt_probe.py OUT_DIR PLAN.json

PLAN.json is a list of groups, each {"label", "backend", "config" (an --fsdp_config or
--deepspeed_config file, or null), "cases": [...], "freeze_embeddings" (optional)}: the probe's
table lives in tests/support/launches.py (PROBE_GROUPS). Each case is interval:impl:offload[:policy[:dropout]],
offload being 0 (none), 1 (torch's, --ckpt_offload) or pH (--offload_activations with horizon H; the
offloader's schedule of the first step is recorded), policy full (default) or selective
(--ckpt_policy), or a plan, each block's choice joined by "+" (--ckpt_plan: full+selective+none+full,
with interval 0), dropout the model's (default 0). For every case the real backend is set up on a
fresh model (same seed) and trained for a few steps through training.loop.accumulate_gradients;
each rank writes OUT_DIR/rank<k>.pt with, per group label and case, the losses, this rank's local
gradients after the first backward (by parameter name, wrapper prefixes removed) and the printed
model. A case that raises is recorded as {"error": ...} and the probe goes on with the next one
(a case that hangs a collective still ends the launch: its timeout).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from backends import get_backend  # noqa: E402
from backends.base import local_tensor  # noqa: E402
from gptlite.data import BatchLayout, CharDataset  # noqa: E402
from gptlite.model import build_model  # noqa: E402
from core.config import RunConfig  # noqa: E402
from core.dist import DistEnv, destroy_process_group, gather_floats  # noqa: E402
from training.checkpoint import plain_name  # noqa: E402
from training.loop import accumulate_gradients  # noqa: E402

STEPS = 3


def parse_case(case: str) -> tuple[int, str, str, str, float]:
    """interval, impl, offload, policy, dropout of a case."""
    interval, impl, offload, *more = case.split(":")
    policy, dropout = [*more, *("full", "0")[len(more):]]
    return int(interval), impl, offload, policy, float(dropout)


def baseline_of(case: str) -> str:
    """The case without checkpointing that `case` must match: the same dropout."""
    dropout = parse_case(case)[4]
    return "0:torch_nonreentrant:0" + (f":full:{dropout:g}" if dropout else "")


def assert_unchanged(results: dict, cases, tolerance: float, what: str = "") -> None:
    """Each of `cases` has the losses and first-step gradients, within `tolerance`, of the case without
    checkpointing at its dropout (baseline_of) in one rank's `results`."""
    for case in cases:
        got, base = case_result(results, case), case_result(results, baseline_of(case))
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(base["losses"]), rtol=tolerance,
                                   atol=tolerance, msg=f"{what} {case} losses")
        assert got["grads"].keys() == base["grads"].keys() and got["grads"]
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, base["grads"][name], rtol=tolerance, atol=tolerance,
                                       msg=f"{what} {case} gradient of {name}")


def case_result(results: dict, case: str) -> dict:
    """One case's result, failing with the error the probe recorded for it."""
    result = results[case]
    assert "error" not in result, f"{case}: {result['error']}\n{result.get('traceback', '')}"
    return result


def offload_fields(offload: str) -> dict:
    if offload.startswith("p"):
        return {"offload_activations": True, "activation_loading_horizon": int(offload[1:])}
    return {"ckpt_offload": offload == "1"}


def run_case(base: dict, interval: int, impl: str, offload: str, env: DistEnv, data: CharDataset,
             freeze_embeddings: bool, policy: str = "full", dropout: float = 0.0) -> dict:
    plan = policy.replace("+", ",") if "+" in policy else None
    cfg = RunConfig(**{**base, "dropout": dropout}, ckpt_interval=interval, ckpt_impl=impl,
                    ckpt_policy="full" if plan else policy, ckpt_plan=plan, **offload_fields(offload))
    resolved = get_backend(cfg.backend).resolve(cfg, env)
    cfg, backend = resolved.cfg, resolved.build(env)
    model = build_model(cfg.model_config(vocab_size=data.vocab_size), cfg.seed)
    torch.manual_seed(cfg.seed * 1000 + env.rank)  # each case's dropout stream from the same start, as train.py's
    if freeze_embeddings:
        for p in (*model.token_embedding.parameters(), *model.position_embedding.parameters()):
            p.requires_grad_(False)
    backend.setup(model)
    offloader = getattr(backend, "offloader", None)
    if offloader is not None:
        offloader.record = True
    schedule = None
    layout = BatchLayout(cfg.micro_batch, cfg.grad_accum, env.world_size, env.rank)
    losses, grads = [], None
    for step in range(STEPS):
        loss = accumulate_gradients(backend, layout.micro_batches(data, "train", cfg.seed, step), cfg.grad_accum,
                                    env.device)
        if grads is None:
            # By parameter name where parameters carry their gradients; DeepSpeed ZeRO keeps them
            # in its own partition buffers instead, listed by state_tensors in a fixed order.
            grads = {plain_name(n): local_tensor(p.grad).detach().clone()
                     for n, p in backend.model.named_parameters() if p.grad is not None}
            if not grads:
                grads = {f"gradient buffer {i}": g.detach().clone()
                         for i, g in enumerate(backend.accounting().state_tensors()["gradient"])}
            if offloader is not None:  # what the offloader did in the first step's (last) backward
                schedule = {"events": [(e.kind, e.block, e.during, e.saved_id) for e in offloader.events],
                            "left": sum(len(v) for v in offloader.saved.values()),
                            "checkpointed": list(offloader.checkpointed), "horizon": offloader.horizon}
        backend.step()
        losses.append(sum(r[0] for r in gather_floats([loss.item()], env.device)) / env.world_size)
    wrappers = collections.Counter(type(m).__name__ for m in backend.model.modules())
    result = {"losses": losses, "grads": grads, "model": str(backend.model), "modules": dict(wrappers),
              "record": backend.describe()["activation_checkpointing"], "schedule": schedule}
    backend.teardown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("plan", help="a JSON list of groups: label, backend, config, cases, freeze_embeddings")
    parser.add_argument("--local_rank", type=int, help="passed by the deepspeed launcher (LOCAL_RANK is used)")
    args = parser.parse_args()

    import json
    import traceback

    groups = json.loads(Path(args.plan).read_text())
    env = DistEnv.from_environment("cpu")
    data = CharDataset.load(None, block_size=64)
    results, initialized = {}, set()
    for group in groups:
        backend = group["backend"]
        config_flag = "deepspeed_config" if backend == "deepspeed" else "fsdp_config"
        base = dict(backend=backend, preset="tiny", dropout=0.0, micro_batch=group.get("micro_batch", 4),
                    grad_accum=group.get("grad_accum", 1), lr_warmup_steps=0, seed=7,
                    **({config_flag: group["config"]} if group.get("config") else {}))
        backend_cls = get_backend(backend)
        # The first group of a backend that needs one makes the process group; DeepSpeed's own set-up
        # (its communication layer over that group) runs once too, whichever group came first.
        family = "deepspeed" if backend == "deepspeed" else "torch"
        if backend_cls.needs_process_group and family not in initialized:
            if family == "deepspeed" or not torch.distributed.is_initialized():
                backend_cls.init_distributed(env, timeout_s=120)
            initialized.add(family)
        out = results.setdefault(group["label"], {})
        for case in group["cases"]:
            interval, impl, offload, policy, dropout = parse_case(case)
            try:
                out[case] = run_case(base, interval, impl, offload, env, data, group.get("freeze_embeddings", False),
                                     policy, dropout)
            except Exception as e:  # noqa: BLE001 - recorded, the test that reads it fails with it
                out[case] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(results, out_dir / f"rank{env.rank}.pt")
    destroy_process_group()


if __name__ == "__main__":
    main()
