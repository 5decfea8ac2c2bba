"""Consolidate a training checkpoint of any backend into one fp32 state dict.

    python -m training.export runs/ckpt/z3 --out exported/z3                  # the latest checkpoint
    python -m training.export runs/ckpt/z3/step_00000009 --out exported/z3
    torchrun --nproc_per_node 2 train.py --fsdp_config fsdp_configs/full_shard.yaml --init_from exported/z3/model.pt ...

Each format has its library's own consolidation, run offline (no process group, on the CPU):
- "torch" (single, ddp): the saved model state dict;
- "dcp" (fsdp, fsdp2): torch.distributed.checkpoint.format_utils.dcp_to_torch_save, which merges
  every rank's shards;
- DeepSpeed's: deepspeed.utils.zero_to_fp32 (ZeRO 1-3: the fp32 master partitions merged), or the
  module weights of a ZeRO-0 checkpoint.
A run trained from a transformers checkpoint (--model_name_or_path) is also written as one in --out
(save_pretrained: config.json, model.safetensors in fp32, and the checkpoint's tokenizer where it had
one): `AutoModelForCausalLM.from_pretrained(out)`, or `--model_name_or_path out` to train on.
Parameter names are GPT-lite's own (wrapper prefixes such as `module.` or
`_checkpoint_wrapped_module.` removed), so any backend can load the result (`--init_from`). The
file, model.pt in the --out directory, holds {"model": state dict, "step": step of the checkpoint, "source": its meta.json},
and is signed beside it (manifest.json, training/manifest.py) for --init_from to check.

Nothing is read from a checkpoint before its manifest says this user's suite wrote it, as it is
(one line naming --trust_checkpoint otherwise). With --trust_checkpoint, torch files are loaded
weights-only; DCP's metadata and DeepSpeed's files are pickles, loaded as such, and it says so.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from core.owned import DCP_FORMAT, DEEPSPEED_FORMAT
from gptlite.errors import ConfigError
from models.pretrained import save_transformers
from models.spec import PRETRAINED
from training import checkpoint, manifest
from training.preflight import writable_out


def checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint directory, or the latest one under a --save_dir."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    pointer = path / checkpoint.LATEST
    if pointer.is_file():
        return path / pointer.read_text().strip()
    raise FileNotFoundError(f"{path}: neither a checkpoint (meta.json) nor a --save_dir with one")


def consolidated_state_dict(directory: Path, meta: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The checkpoint's model as one fp32 state dict, and its meta.json. The caller has verified the
    directory (manifest.verify), or the user trusts it."""
    meta = meta or checkpoint.checked_meta(directory, f"the checkpoint {directory}")
    model_dir = directory / "model"
    fmt = meta["format"]
    if fmt == "torch":
        state = torch.load(model_dir / "state.pt", map_location="cpu", weights_only=True)["model"]
    elif fmt == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            merged = Path(tmp) / "merged.pt"
            dcp_to_torch_save(str(model_dir / "dcp"), str(merged))
            state = torch.load(merged, map_location="cpu", weights_only=True)["model"]
    else:
        state = _deepspeed_state_dict(model_dir)
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
    # Weights-only, with the plain data classes DeepSpeed keeps beside the tensors (its loss scaler, the
    # ZeRO stage, bf16's fragment addresses): their attributes are set, no code of the file's is called.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(states, map_location="cpu", weights_only=True)["module"]


def _why(error: Exception) -> str:
    """A load's failure in a few words: the global torch's weights-only loader refused (its message is a
    page of advice), else the exception's first line."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        refused = text.split("WeightsUnpickler error:", 1)[1].split(" was not an allowed global", 1)[0].strip()
        return f"weights-only loading refused {refused}: pickled code or objects, not weights; none of it ran"
    first = (text.strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:300]}" if first else type(error).__name__


OUT_FILE = "model.pt"  # what --out DIR holds


def export(checkpoint_path: str | Path, out_dir: str | Path, trust: bool = False) -> Path:
    """The checkpoint consolidated into `out_dir`/model.pt (written whole or not at all) and signed
    (`out_dir`/manifest.json); its path. `trust`: --trust_checkpoint."""
    # Not into a record or a checkpoint (its run's: never written into from outside), not a file's name.
    writable_out("--out", str(out_dir), writes=OUT_FILE)
    manifest.signing_key()  # a key that cannot be made or read is refused before the work
    directory = checkpoint_dir(checkpoint_path)
    where = f"the checkpoint {directory}"
    verified = manifest.verify(directory, where, trust)  # before anything in it is unpickled
    meta = checkpoint.checked_meta(directory, where)
    if verified:
        state, meta = consolidated_state_dict(directory, meta)
    else:
        # What is read beyond weights-only: DCP's metadata, DeepSpeed's ZeRO 1-3 files (zero_to_fp32); a
        # ZeRO-0 checkpoint's module is read weights-only here (_deepspeed_state_dict).
        zero_to_fp32 = meta["format"] == DEEPSPEED_FORMAT and any((directory / "model").rglob("*optim_states.pt"))
        pickled = DEEPSPEED_FORMAT if zero_to_fp32 else DCP_FORMAT if meta["format"] == DCP_FORMAT else None
        note = manifest.trusted_note(directory, pickled)
        if note:
            print(note, file=sys.stderr, flush=True)
        try:  # unverified files: any failure to read them is theirs (truncated, not this format, code refused)
            state, meta = consolidated_state_dict(directory, meta)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{where} cannot be read as a {meta['format']} checkpoint ({_why(e)})") from None
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
    written = [OUT_FILE]
    if (meta.get("model") or {}).get("name") == PRETRAINED and (meta["model"].get("config")):
        # A run from a transformers checkpoint (--model_name_or_path): also as one, for from_pretrained.
        written += save_transformers(state, meta["model"], out.parent)
    manifest.write(out.parent, files=written)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.export", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:5]))
    parser.add_argument("checkpoint", help="a checkpoint directory, or a --save_dir (its latest checkpoint)")
    parser.add_argument("--out", required=True, metavar="DIR", help=f"directory to write {OUT_FILE} in (torch.save format)"
                        f" and {manifest.MANIFEST}, its signature for --init_from")
    parser.add_argument(manifest.TRUST_FLAG, action="store_true",
                        help="read a checkpoint that has no manifest signed by you (another user's or machine's, or "
                             "from before checkpoints were signed): torch files weights-only; DCP's metadata and "
                             "DeepSpeed's files are pickles, and can run code")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, trust=args.trust_checkpoint)
    except (FileNotFoundError, FileExistsError, ValueError, KeyError) as e:  # ConfigError is a ValueError
        print(f"export: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
