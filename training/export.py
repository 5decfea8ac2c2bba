"""Consolidate a training checkpoint of any backend into one fp32 state dict.

    python -m training.export runs/ckpt/z3 --out exported/z3                  # the latest checkpoint
    python -m training.export runs/ckpt/z3/step_00000009 --out exported/z3
    torchrun --nproc_per_node 2 train.py --fsdp_config fsdp_configs/full_shard.yaml --init_from exported/z3/model.pt ...

Each format has its library's own consolidation, run offline (no process group, on the CPU):
- "torch" (single, ddp): the saved model state dict;
- "dcp" (fsdp, fsdp2): torch.distributed.checkpoint.format_utils.dcp_to_torch_save, which merges
  every rank's shards;
- "deepspeed": deepspeed.utils.zero_to_fp32 (ZeRO 1-3: the fp32 master partitions merged), or the
  module weights of a ZeRO-0 checkpoint.
Parameter names are GPT-lite's own (wrapper prefixes such as `module.` or
`_checkpoint_wrapped_module.` removed), so any backend can load the result (`--init_from`). The
file, model.pt in the --out directory, holds {"model": state dict, "step": step of the checkpoint, "source": its meta.json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from training import checkpoint

def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or the latest one under a --save_dir."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    found = checkpoint.latest(path)
    if found is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint (meta.json) nor a --save_dir with one")
    return found[0]


def consolidated_state_dict(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    meta = json.loads((directory / "meta.json").read_text())
    model_dir = directory / "model"
    fmt = meta["format"]
    if fmt == "torch":
        state = torch.load(model_dir / "state.pt", map_location="cpu")["model"]
    elif fmt == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            merged = Path(tmp) / "merged.pt"
            dcp_to_torch_save(str(model_dir / "dcp"), str(merged))
            state = torch.load(merged, map_location="cpu", weights_only=False)["model"]
    elif fmt == "deepspeed":
        state = _deepspeed_state_dict(model_dir)
    else:
        raise ValueError(f"{directory}: unknown checkpoint format {fmt!r}")
    return {checkpoint.plain_name(k): v.detach().float().cpu().clone() for k, v in state.items()}, meta


def _deepspeed_state_dict(model_dir: Path) -> dict:
    from backends.deepspeed import DeepSpeedBackend
    from backends.deepspeed_support import import_deepspeed

    import_deepspeed()
    tag_dir = model_dir / DeepSpeedBackend.CHECKPOINT_TAG
    if any(tag_dir.glob("*optim_states.pt")):  # ZeRO 1-3: merge the fp32 master partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(model_dir), tag=DeepSpeedBackend.CHECKPOINT_TAG)
    (states,) = tag_dir.glob("mp_rank_*_model_states.pt")  # ZeRO-0: the module as it trained
    return torch.load(states, map_location="cpu", weights_only=False)["module"]


OUT_FILE = "model.pt"  # what --out DIR holds


def export(checkpoint_path: str | Path, out_dir: str | Path) -> Path:
    """The checkpoint consolidated into `out_dir`/model.pt (written whole or not at all); its path."""
    from training.preflight import writable_out

    # Not into a record or a checkpoint (its run's: never written into from outside), not a file's name.
    writable_out("--out", str(out_dir), writes=OUT_FILE)
    directory = resolve(checkpoint_path)
    state, meta = consolidated_state_dict(directory)
    out = Path(out_dir) / OUT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp", delete=False) as f:
        tmp = Path(f.name)
        try:
            torch.save({"model": state, "step": meta["step"], "source": meta}, f)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    tmp.replace(out)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.export", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:5]))
    parser.add_argument("checkpoint", help="a checkpoint directory, or a --save_dir (its latest checkpoint)")
    parser.add_argument("--out", required=True, metavar="DIR", help=f"directory to write {OUT_FILE} in (torch.save format)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out)
    except (FileNotFoundError, FileExistsError, ValueError, KeyError) as e:  # ConfigError is a ValueError
        print(f"export: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
