#!/usr/bin/env python
"""Train GPT-lite (or any model: --model) under one backend and leave a record in runs/.

    python train.py                                   # single process, embedded corpus
    torchrun --nproc_per_node 2 train.py --backend ddp
    python train.py --dry_run --preset paper          # resolved config and parameter count

Every flag is explained by `python train.py --help`.
"""

from core.allocator import keep_freed_memory

keep_freed_memory()  # before torch allocates anything: see core/allocator.py

from training.cli import build_parser, parse_args  # noqa: E402
from training.lifecycle import exit_process  # noqa: E402
from training.run import main  # noqa: E402

DESCRIPTION = (
    "Train the GPT-lite model (or your own: --model) under one distributed-training backend, with the "
    "same data, optimizer and global batch as every other backend, and write a run record "
    "(config.json, metrics.jsonl, summary.json) under --runs_dir/--run_name."
)

EXAMPLES = """examples:
  python train.py --preset tiny --steps 100            one process, embedded corpus
  torchrun --nproc_per_node 2 train.py --backend ddp   two ranks (CPU: gloo, GPU: nccl)
  python train.py --data input.txt --precision bf16    your own text, mixed precision
  python train.py --dry_run --preset paper             resolved config and n_params, no training

Records go to --runs_dir/--run_name: config.json, metrics.jsonl, summary.json
(fields documented in runs/README.md)."""



if __name__ == "__main__":
    exit_process(main(parse_args(parser=build_parser(description=DESCRIPTION, examples=EXAMPLES))))
