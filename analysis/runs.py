"""Load run records (runs/<name>/{config,summary}.json, metrics.jsonl; or a compact folder's
records.jsonl, analysis/compact.py) into pandas."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from backends import DDP
from backends.deepspeed_config import inline
from core.config import describe_plan
from core.records import dead_because
from core.summary import RunSummary
from gptlite.errors import ConfigError
from models.spec import PRETRAINED, format_model_args, model_label, parse_model_args

# GPT-lite's flags that change the model itself (over its preset, which is a column of its own).
GPTLITE_SIZE = ("n_layer", "n_embd", "n_head", "block_size")


def _flatten(prefix: str, obj, out: dict) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = obj


def run_dirs(path: str | Path) -> list[Path]:
    """Every directory under `path` (itself included) that holds a summary.json, and every run of the
    compact folders (records.jsonl) under or around it, by the path of the folder it was."""
    from analysis.compact import run_dirs as record_dirs  # here: `python -m analysis.compact` runs it as __main__

    return record_dirs(path)


def config_label(backend: str, fsdp_config: str | None = None, deepspeed_config: str | None = None,
                 ddp_bucket_cap_mb: float | None = None) -> str:
    """A backend configuration's short name: its backend's name (ddp), or with its DDP bucket size or config
    file: ddp.bucket_100mb, fsdp.full_shard, deepspeed.z3, ..."""
    if backend == DDP and isinstance(ddp_bucket_cap_mb, (int, float)) and ddp_bucket_cap_mb == ddp_bucket_cap_mb:
        return f"{DDP}.bucket_{ddp_bucket_cap_mb:g}mb"  # (a record without the flag reads NaN in a frame)
    path = deepspeed_config or fsdp_config
    if isinstance(deepspeed_config, str) and deepspeed_config and inline(deepspeed_config) is not None:
        return f"{backend}.inline"  # a base64-encoded config (DeepSpeed's autotuner passes them)
    return f"{backend}.{Path(path).stem}" if isinstance(path, str) and path else backend


def ckpt_label(row: dict) -> str:
    """"none", "every 2 (torch_nonreentrant)", "every 1 (torch_nonreentrant, torch offload)",
    "every 1 (torch_nonreentrant, prefetch offload H=2)", "every 1 (torch_nonreentrant, selective)",
    "every 1 (torch_nonreentrant, selective keeping mm,bmm)", a plan: "plan full x3, selective x2, none",
    and one --ckpt_policy auto chose: "auto 0.15 GiB: full x3, selective x2, none"."""
    interval, impl = row.get("ckpt_interval") or 0, row.get("config.run.ckpt_impl")
    plan = row.get("config.run.ckpt_plan")
    if isinstance(plan, str) and plan:
        choices = describe_plan(plan.split(","))
        if row.get("config.run.ckpt_policy") == "auto":
            return f"auto {row.get('config.run.mem_budget_gb'):g} GiB: {choices}"
        return f"plan {choices}"
    if not interval:
        return "none"
    if row.get("config.run.ckpt_policy") == "selective":
        ops = row.get("config.run.ckpt_save_ops")
        impl = f"{impl}, selective" + (f" keeping {ops}" if isinstance(ops, str) and ops else "")
    if row.get("config.run.offload_activations"):
        impl = f"{impl}, prefetch offload H={row.get('config.run.activation_loading_horizon')}"
    elif row.get("config.run.ckpt_offload"):
        impl = f"{impl}, torch offload"
    return f"every {interval} ({impl})"


def model_key(row: dict) -> str:
    """Which model a run trained: its label (models.spec.model_label of --model) plus its settings
    (--model_args; GPT-lite's size flags; --dropout), so that two sizes of one model are two models:
    "hf_gpt2 n_embd=64,n_layer=2", "gptlite n_layer=2", "my_model", "pretrained checkpoint=./my-gpt2"
    (--model_name_or_path). Records from before --model are
    GPT-lite's."""
    name = row.get("model") or "gptlite"
    if name == "gptlite":
        settings = {k: row.get(f"config.run.{k}") for k in GPTLITE_SIZE}
        settings = {k: v for k, v in settings.items() if v is not None}
    else:
        try:
            settings = parse_model_args(row.get("config.run.model_args"))
        except ValueError:  # written by another version, which read it otherwise: keep it as it is
            settings = {"model_args": row.get("config.run.model_args")}
    if name == PRETRAINED and row.get("config.run.model_name_or_path"):
        # Each checkpoint is its own model: two checkpoints are never compared as one.
        settings["checkpoint"] = row["config.run.model_name_or_path"]
    # --dropout changes what is trained (and its speed: on the H200 the paper preset's dropout 0.1 was 17%
    # of its compiled step, runs/reference/nvidia-h200/gpu_best_mfu): another model, never compared as one
    if row.get("config.run.dropout") is not None:
        settings["dropout"] = row["config.run.dropout"]
    args = format_model_args(dict(sorted(settings.items())))
    return f"{model_label(name)} {args}" if args else model_label(name)


def run_config(run) -> dict:
    """A run's config.json (a row of load_runs): from its record's folder, or its compact folder's line."""
    from analysis.compact import read_json  # here, as in run_dirs: analysis.compact may be __main__

    return read_json(Path(run["run_dir"]) / "config.json")


def require_records(runs: pd.DataFrame, runs_dir: str | Path) -> pd.DataFrame:
    """`runs` (load_runs), or ConfigError where `runs_dir` holds no run record: the tools that read
    records (report, claims, table) refuse it in one line, before writing anything."""
    if runs.empty:
        raise ConfigError(f"runs_dir {runs_dir}: no run records under it (a record is a run's folder with config.json)")
    return runs


def load_runs(path: str | Path) -> pd.DataFrame:
    """One row per run: the summary's fields (core.summary.RunSummary, every field present), then
    the config's flattened under `config.`.

    Failed, out-of-memory, timed-out and still-running runs are included with their status; a
    record left `running` by a run that is gone (core/records.dead_because: its process ended, or its
    heartbeat stopped) reads `dead`, with why as its error. Derived columns: `model` (the model's
    label and settings, see model_key), `label` (the backend configuration's short name, see config_label),
    `ckpt` ("none", or "every k (impl)", plus the activation offload if any) and `compile` ("none",
    or the torch.compile backend).
    """
    from analysis.compact import is_file, read_json  # here, as in run_dirs: analysis.compact may be __main__

    rows = []
    for run_dir in run_dirs(path):
        row = {"run_dir": str(run_dir)}
        try:
            _flatten("", RunSummary.from_dict(read_json(run_dir / "summary.json")).to_dict(), row)
            config_path = run_dir / "config.json"
            if is_file(config_path):
                _flatten("config", read_json(config_path), row)
        except (OSError, ValueError, TypeError, AttributeError, RecursionError) as e:
            # a damaged record (RecursionError: JSON nested too deeply to read): say so, keep going
            print(f"skipped {run_dir}: not a readable run record ({type(e).__name__})", file=sys.stderr)
            continue
        if row["status"] == "running":  # shown, never written: the record stays as its run left it
            why = dead_because(run_dir)
            if why is not None:
                row["status"], row["error"] = "dead", f"{why}; its summary still says running"
        row["label"] = config_label(row.get("backend", "?"), row.get("config.run.fsdp_config"),
                                    row.get("config.run.deepspeed_config"), row.get("config.run.ddp_bucket_cap_mb"))
        row["ckpt"] = ckpt_label(row)
        row["compile"] = row.get("config.run.compile_backend", "?") if row.get("config.run.compile") else "none"
        row["model"] = model_key(row)
        if row.get("preset") is None:
            row["preset"] = "-"  # a model other than GPT-lite has no preset; "-" keeps it in groupings
        rows.append(row)
    return pd.DataFrame(rows)


def _metric_lines(path: Path) -> list[dict]:
    """The lines of a run's metrics.jsonl, each a JSON object; ConfigError naming the file and the line
    where one is not (the records' files are replaced whole, core/records.py: a damaged line is not a
    write cut short, and the report would draw what it could not read)."""
    lines = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as e:
            problem = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise ConfigError(f"{path} line {number}: not JSON ({problem}); each line of metrics.jsonl is one JSON "
                              "object, a step's metrics as train.py writes them") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{path} line {number}: a JSON {type(value).__name__}, not an object; each line of "
                              "metrics.jsonl is one JSON object, a step's metrics as train.py writes them")
        lines.append(value)
    return lines


def load_metrics(path: str | Path) -> pd.DataFrame:
    """Every logged step of every run under `path`, with its run_name (a compact folder keeps none);
    ConfigError (one line naming the file and the line) where a run's metrics.jsonl holds a line that
    is not a JSON object."""
    frames = []
    for run_dir in run_dirs(path):
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            frame = pd.DataFrame(_metric_lines(metrics))
            frame.insert(0, "run_name", run_dir.name)
            frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
