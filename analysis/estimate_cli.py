"""Memory per rank for a configuration, before running it: model states and activations.

    python -m analysis.estimate_cli --world 8 --preset paper --deepspeed_config ds_configs/z3.json --device cuda
    python -m analysis.estimate_cli --world 2 --fsdp_config fsdp_configs/shard_grad_op.yaml --ckpt_interval 1 --json
    python -m analysis.estimate_cli --world 8 --model hf:llama --model_args num_hidden_layers=4,hidden_size=256 \\
        --deepspeed_config ds_configs/z3.json --micro_batch 4 --device cuda

The method, its moments of the step and its measured accuracy: docs/estimator.md and
estimator/estimate.py (the estimator layer, which train.py's --ckpt_policy auto plans with too);
this module is its command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from analysis.runs import config_label
from core.config import describe_plan as describe_choices
from estimator.checkpointing_plan import plan_for_record
from estimator.estimate import Estimate, estimate, estimate_from_record, record_arguments  # noqa: F401 - the API, as before
from gptlite.data import DataError
from gptlite.errors import ConfigError
from simulation.describe import describe
from training.cli import OneLineParser, refuse_renamed
from training.preflight import writable_out


def main(argv=None) -> int:
    p = OneLineParser(prog="python -m analysis.estimate_cli", description=__doc__.splitlines()[0], allow_abbrev=False,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      usage="python -m analysis.estimate_cli [--world W] [--gpus_per_node N] [--json] [--out DIR] [train.py flags]",
                      epilog="\n".join(["Every other flag is train.py's, with train.py's names and defaults (python "
                                         "train.py --help), resolved as the run resolves them (simulation/describe.py): "
                                         "the estimate is of the run those flags launch on --world ranks. --device "
                                         "cuda estimates a GPU run from a machine without one.", "",
                                         *__doc__.splitlines()[2:7]]))
    p.add_argument("--world", type=int, default=1, help="ranks the run is launched on")
    p.add_argument("--gpus_per_node", type=int, default=None,
                   help="ranks (GPUs) per node: HYBRID_SHARD's default shard group (default: --world)")
    p.add_argument("--json", action="store_true", help="print JSON: the estimate's parts, the plan of --ckpt_policy "
                   "auto, and `config`, the run resolved (train.py --dry_run's record)")
    p.add_argument("--out", default=None, metavar="DIR", help="also write what --json prints to DIR/estimate.json")
    refuse_renamed(p, argv)
    args, train_argv = p.parse_known_args(argv)
    chosen = []

    def planner(*a, **k):  # the run's own (estimator/checkpointing_plan.py), keeping what it chose to print it
        chosen.append(plan_for_record(*a, **k))
        return chosen[-1]

    try:
        if args.out:
            writable_out("--out", args.out, writes="estimate.json")
        config = describe(train_argv, args.world, args.gpus_per_node, planner=planner)
        model, positional, kwargs = record_arguments(config)
        est = estimate(model, *positional, **kwargs)  # the record says its ranks per node
    except (ConfigError, DataError) as e:
        print(f"estimate: error: {e}", file=sys.stderr)
        return 2
    run = config["run"]
    plan = chosen[-1] if chosen else None
    if args.json or args.out:
        shown = {k: v for k, v in asdict(est).items() if k not in ("moment_bases", "batch_bytes", "activations")}
        planned = {"ckpt_plan": plan.choices, "ckpt_cost": plan.describe_cost(),
                   "recompute_cost": plan.cost[0]} if plan else {}
        result = json.dumps({**shown, "model_states_bytes": est.model_states_bytes, **planned, "config": config},
                            indent=2)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "estimate.json").write_text(result + "\n")
        if args.json:
            print(result)
            return 0
    # GiB, or MiB for a model whose whole step fits in less than one GiB.
    unit, scale = ("GiB", 2**30) if est.total_bytes >= 2**30 else ("MiB", 2**20)
    what = f"{run['preset']} preset" if run["model"] == "gptlite" else run["model"]
    interval = int(run.get("ckpt_interval") or 0)
    ckpt = (f"checkpoint interval {interval}" + (f" ({run['ckpt_policy']})" if run["ckpt_policy"] != "full" else "")
            if interval else f"checkpointing plan {run['ckpt_plan']}" if run.get("ckpt_plan") else "no checkpointing")
    label = config_label(run["backend"], run["fsdp_config"], run["deepspeed_config"], run.get("ddp_bucket_cap_mb"))
    print(f"{what}, {label}, {args.world} rank(s), micro-batch {run['micro_batch']}, {run['precision']}, {ckpt}, on "
          f"{config['environment']['device']}, per rank:")
    if plan:
        print(f"  checkpointing planned for {run['mem_budget_gb']:g} GiB: {describe_choices(plan.choices)} "
              f"({plan.describe_cost()})")
    for name, value in (("parameters", est.params), ("gathered parameters", est.params_gathered),
                        ("gradients", est.grads), ("optimizer state", est.optimizer),
                        ("model states", est.model_states_bytes), ("activations at the peak", est.activation_bytes),
                        ("peak (total)", est.total_bytes)):
        print(f"  {name:<26}{value / scale:10.3f} {unit}")
    if est.host_bytes:
        print(f"  {'of the states, in host memory':<26}{est.host_bytes / scale:10.3f} {unit}")
    print(f"  the peak falls in the {est.peak_moment}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
