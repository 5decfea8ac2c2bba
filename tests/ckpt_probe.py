"""Test support: per-step losses and first-step gradients of one backend under several
activation-checkpointing settings, in one launch (python or torchrun).

    python -m torch.distributed.run --nproc_per_node 2 tests/ckpt_probe.py OUT_DIR BACKEND [FSDP_CONFIG] \\
        --case 0:torch_nonreentrant:0 --case 1:torch_reentrant:0 ...

Each case is interval:impl:offload. For every case the real backend is set up on a fresh model
(same seed) and trained for a few steps through training.loop.accumulate_gradients; each rank
writes OUT_DIR/rank<k>.pt with, per case, the losses, this rank's local gradients after the first
backward (by parameter name, wrapper prefixes removed) and the printed model.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import get_backend  # noqa: E402
from backends.base import _local  # noqa: E402
from gptlite.data import BatchLayout, CharDataset  # noqa: E402
from gptlite.model import build_model  # noqa: E402
from training.config import RunConfig  # noqa: E402
from training.dist import DistEnv, destroy_process_group, gather_floats, init_process_group  # noqa: E402
from training.loop import accumulate_gradients  # noqa: E402

WRAPPER_PREFIXES = ("module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_offload_wrapped_module.")
STEPS = 3


def clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part + "." not in WRAPPER_PREFIXES)


def run_case(base: dict, interval: int, impl: str, offload: bool, env: DistEnv, data: CharDataset) -> dict:
    cfg = RunConfig(**base, ckpt_interval=interval, ckpt_impl=impl, ckpt_offload=offload)
    backend_cls = get_backend(cfg.backend)
    cfg = backend_cls.resolve(cfg, env)
    backend = backend_cls(cfg, env)
    backend.setup(build_model(cfg.model_config(vocab_size=data.vocab_size), cfg.seed))
    layout = BatchLayout(cfg.micro_batch, cfg.grad_accum, env.world_size, env.rank)
    losses, grads = [], None
    for step in range(STEPS):
        loss = accumulate_gradients(backend, layout.micro_batches(data, "train", cfg.seed, step), cfg.grad_accum,
                                    env.device)
        if grads is None:
            grads = {clean_name(n): _local(p.grad).detach().clone()
                     for n, p in backend.model.named_parameters() if p.grad is not None}
        backend.step()
        losses.append(sum(r[0] for r in gather_floats([loss.item()], env.device)) / env.world_size)
    wrappers = collections.Counter(type(m).__name__ for m in backend.model.modules())
    result = {"losses": losses, "grads": grads, "model": str(backend.model), "modules": dict(wrappers),
              "record": backend.describe()["activation_checkpointing"]}
    backend.teardown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("backend")
    parser.add_argument("fsdp_config", nargs="?")
    parser.add_argument("--case", action="append", required=True, help="interval:impl:offload(0/1)")
    parser.add_argument("--micro_batch", type=int, default=4)
    args = parser.parse_args()

    env = DistEnv.from_environment("cpu")
    base = dict(backend=args.backend, fsdp_config=args.fsdp_config, preset="tiny", dropout=0.0,
                micro_batch=args.micro_batch, lr_warmup_steps=0, seed=7)
    if args.backend != "single":
        init_process_group(env, timeout_s=120)
    data = CharDataset.load(None, block_size=64)
    results = {}
    for case in args.case:
        interval, impl, offload = case.split(":")
        results[case] = run_case(base, int(interval), impl, offload == "1", env, data)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(results, out / f"rank{env.rank}.pt")
    destroy_process_group()


if __name__ == "__main__":
    main()
