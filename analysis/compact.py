"""A records folder as one JSON Lines file, and that file read back as the folder it was made from.

    python -m analysis.compact RUNS_DIR --out runs/reference/NAME

A benchmark or a sweep writes its records to a scratch folder (RUNS_DIR: thousands of files, with
logs, lock files and per-step metrics); what is kept is NAME/records.jsonl, one line per run record
and per JSON file beside them, in the order of their paths:

    {"run": "vit/grid/z2-mb8x1-none-r0", "summary": {...}, "config": {...}}   a run's summary.json, config.json
    {"file": "vit/grid.json", "json": [...]}                                 a grid's list, a plan, a question

and NAME/README.md (RUNS_DIR's, where it has one; else write it: setup, commands, commit, machine,
the result table). Left out: logs, lock files and hidden folders, per-step metrics (metrics.jsonl,
metrics.json), sweep keys, a run's per-rank error files (its summary has the error), DeepSpeed's
autotuner experiment folders (autotune.json keeps each experiment's metrics), and whatever is not
JSON (figures and reports: `python -m analysis.report NAME --out DIR` draws them again, without the
loss curves, which need the per-step metrics).

Every reader of records reads NAME as it read RUNS_DIR: a path inside it (NAME/vit/grid.json,
NAME/vit/grid/z2-mb8x1-none-r0/summary.json) is found in its line (read_json, is_file, is_dir,
iterdir), and load_runs finds its runs, under NAME or under any folder holding it (runs/reference).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from functools import lru_cache
from pathlib import Path

from gptlite.errors import ConfigError
from training.cli import OneLineParser
from training.preflight import writable_out

FILE = "records.jsonl"
# Neither data nor a record's: what a run or a sweep keeps for itself.
LEFT_OUT = ("sweep_key.json", "metrics.json")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except ValueError as e:  # a record cut off mid-write, a file that is not JSON: named, nothing written
        raise ValueError(f"{path}: not JSON ({e}); mend it or move it out of the folder") from None


def pack(runs_dir: str | Path) -> list[dict]:
    """RUNS_DIR's records and JSON files as the lines of its compact form, in the order of their paths.
    A record is a folder with a summary.json (its config.json beside it, null where it has none)."""
    root = Path(runs_dir)
    records = {p.parent.relative_to(root) for p in root.rglob("summary.json")
               if not any(q.startswith(".") for q in p.relative_to(root).parts)}
    experiments = {p.parent.relative_to(root) for p in root.rglob("exp.json")}  # the autotuner's
    owned = records | experiments  # the folders whose files are a record's line, or left out
    lines = {}
    for rel in records:
        if any(parent in records for parent in rel.parents):
            continue  # a record inside a record: not one the suite writes
        config = root / rel / "config.json"
        lines[rel.as_posix()] = {"run": rel.as_posix(),
                                 "summary": _json(root / rel / "summary.json"),
                                 "config": _json(config) if config.is_file() else None}
    for path in root.rglob("*.json"):
        rel = path.relative_to(root)
        parts = rel.parts
        if (any(p.startswith(".") for p in parts) or rel.name in LEFT_OUT or "errors" in parts[:-1]
                or "exps" in parts[:-1] or any(parent in owned for parent in rel.parents)):
            continue
        lines[rel.as_posix()] = {"file": rel.as_posix(), "json": _json(path)}
    return [lines[k] for k in sorted(lines)]


def write(runs_dir: str | Path, out: str | Path, lines: list[dict] | None = None) -> Path:
    """NAME/records.jsonl (and RUNS_DIR's README.md, where NAME has none) from RUNS_DIR (`lines`: its
    pack, where already made); never over an existing records.jsonl."""
    runs_dir, out = Path(runs_dir), Path(out)
    lines = pack(runs_dir) if lines is None else lines
    out.mkdir(parents=True, exist_ok=True)
    target = out / FILE
    with open(target, "x") as f:  # "x": an existing one is never rewritten
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    if (runs_dir / "README.md").is_file() and not (out / "README.md").exists():
        shutil.copyfile(runs_dir / "README.md", out / "README.md")
    return target


# Reading: a path inside a compact folder, found in its records.jsonl.

@lru_cache(maxsize=16)
def _load(file: str, mtime_ns: int, size: int) -> dict[str, object]:
    """A compact file's contents by the paths they had: RUN/summary.json, RUN/config.json, FILE."""
    files: dict[str, object] = {}
    with open(file) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if "run" in row:
                files[f"{row['run']}/summary.json"] = row["summary"]
                if row.get("config") is not None:
                    files[f"{row['run']}/config.json"] = row["config"]
            else:
                files[row["file"]] = row["json"]
    return files


def _files(file: Path) -> dict[str, object]:
    stat = file.stat()
    return _load(str(file.resolve()), stat.st_mtime_ns, stat.st_size)


def locate(path: str | Path) -> tuple[Path, str] | None:
    """The compact file that holds `path` (records.jsonl in `path` or in a folder above it) and `path`
    relative to that file's folder ("" for the folder itself); None outside any."""
    path = Path(path)
    for folder in (path, *path.parents):
        if (folder / FILE).is_file():
            return folder / FILE, path.relative_to(folder).as_posix().removeprefix(".")
    return None


def _virtual(path: str | Path) -> tuple[dict[str, object], str] | None:
    """(the files of the compact folder holding `path`, `path`'s key in them) where `path` is not on disk."""
    found = locate(path)
    if found is None:
        return None
    return _files(found[0]), found[1]


def read_json(path: str | Path):
    """A JSON file of a records folder: from disk where it is there, else from its compact folder's line."""
    path = Path(path)
    if path.is_file():
        return json.loads(path.read_text())
    found = _virtual(path)
    if found is None or found[1] not in found[0]:
        raise FileNotFoundError(f"{path}: no such file, nor in a compact records folder ({FILE})")
    return found[0][found[1]]


def is_file(path: str | Path) -> bool:
    path = Path(path)
    if path.is_file():
        return True
    found = _virtual(path)
    return found is not None and found[1] in found[0]


def is_dir(path: str | Path) -> bool:
    path = Path(path)
    if path.is_dir():
        return True
    found = _virtual(path)
    return found is not None and any(k.startswith(found[1] + "/") for k in found[0])


def iterdir(path: str | Path) -> list[Path]:
    """`path`'s entries, on disk and in its compact folder (records.jsonl itself left out), sorted."""
    path = Path(path)
    names = {p.name for p in path.iterdir() if p.name != FILE} if path.is_dir() else set()
    found = _virtual(path)
    if found is not None:
        files, key = found
        prefix = f"{key}/" if key else ""
        names |= {k[len(prefix):].split("/", 1)[0] for k in files if k.startswith(prefix)}
    return [path / n for n in sorted(names)]


def run_dirs(path: str | Path) -> list[Path]:
    """Every run record under `path` (itself included): folders on disk with a summary.json, and the
    runs of the compact folders under it or around it, as the paths of the folders they were."""
    root = Path(path)
    found = {p.parent for p in root.rglob("summary.json")} if root.is_dir() else set()
    around = locate(root)
    packs = {around[0]: around[1]} if around is not None else {}
    if root.is_dir():
        packs.update({f: "" for f in root.rglob(FILE) if f not in packs})
    for file, key in packs.items():
        prefix = f"{key}/" if key else ""
        found |= {file.parent / k.removesuffix("/summary.json") for k in _files(file)
                  if k.endswith("/summary.json") and k.startswith(prefix)}
    return sorted(found)


def unpack(path: str | Path, out: str | Path) -> Path:
    """The files of `path` inside a compact folder (the folder, a model's, one run's) written under `out`
    as they were (JSON, indented): a records folder again, for what needs one on disk."""
    found = _virtual(path)
    if found is None:
        raise FileNotFoundError(f"{path}: not in a compact records folder ({FILE})")
    files, key = found
    prefix = f"{key}/" if key else ""
    out = Path(out)
    for k, value in files.items():
        if k.startswith(prefix):
            target = out / k[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "x") as f:  # nothing there is written over
                f.write(json.dumps(value, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    usage = __doc__.split("\n\nEvery reader")[0]  # what a user needs; the rest is how the tools read it
    parser = OneLineParser(prog="python -m analysis.compact", description=usage.splitlines()[0],
                           epilog="\n".join(usage.splitlines()[2:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir", help="a records folder (a sweep's runs_dir, benchmarks/zoo_accuracy.py's --runs_dir)")
    parser.add_argument("--out", required=True, help=f"the folder to write {FILE} in (and RUNS_DIR's README.md)")
    args = parser.parse_args(argv)
    runs_dir, out = Path(args.runs_dir), Path(args.out)
    if not runs_dir.is_dir():
        parser.error(f"runs_dir {runs_dir} is not a directory")
    if not any(runs_dir.rglob("summary.json")):
        parser.error(f"runs_dir {runs_dir}: no run records under it (a record is a run's folder with summary.json)")
    if out.resolve().is_relative_to(runs_dir.resolve()):
        parser.error(f"--out {out}: inside runs_dir {runs_dir}; give a folder outside it (the compact form is kept "
                     "instead of the folder)")
    if (out / FILE).exists():
        parser.error(f"--out {out}: {out / FILE} exists; give another folder (a compact file is never rewritten)")
    try:
        lines = pack(runs_dir)  # a damaged file is named before anything is written
        writable_out("--out", str(out))
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    print(write(runs_dir, out, lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
