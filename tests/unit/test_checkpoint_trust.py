"""A checkpoint is loaded only once the suite has checked that it wrote it (training/manifest.py).

Checkpoints are pickles in part, and a pickle runs the code it names as it loads: each checkpoint
crafted here carries a callable that would create a marker file, and none may appear. A damaged
checkpoint is refused before any rank starts. Every refusal is one line, exit code 2, nothing
recorded, no record or checkpoint byte changed.
"""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from conftest import REPO, TRAIN, in_process, launch
from gptlite.errors import ConfigError
from training import manifest

KEY_ENV = manifest.KEY_ENV


class Marker:
    """Unpickled, it creates `path`: what a checkpoint carrying code would run (here, harmlessly)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    """This test's signing key, not the user's own (~/.cache/gptlite/checkpoint.key)."""
    path = tmp_path / "keys" / "checkpoint.key"
    monkeypatch.setenv(KEY_ENV, str(path))
    return path


def _files(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _refused(proc, *texts: str) -> str:
    """The one line of a refusal (exit code 2, no traceback), holding each of `texts`."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stdout + proc.stderr
    for text in texts:
        assert text in lines[0], lines[0]
    return lines[0]


def _export(tmp_path, source, *flags):
    from training import export

    return in_process(export.main, [source, "--out", tmp_path / "exported", *flags])


def _train(*argv):
    """train.py's main in this process (refusals come before any process group or record)."""
    import train
    from training.cli import build_parser, parse_args
    from training.run import main

    parser = build_parser(description=train.DESCRIPTION, examples=train.EXAMPLES)
    return in_process(lambda a: main(parse_args(a, parser=parser)), list(argv))


def _checkpoint(save_dir: Path, meta, files: dict, step: int = 4) -> Path:
    """A checkpoint laid out as training/checkpoint.py lays it out (`latest` naming it), holding `files`."""
    directory = save_dir / f"step_{step:08d}"
    for name, content in {"meta.json": json.dumps(meta).encode(), **files}.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
    (save_dir / "latest").write_text(directory.name + "\n")
    return directory


def _torch_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ------------------------------------------------------------------ the manifest and its key
def test_a_manifest_signs_every_file_and_finds_any_change(tmp_path, own_key, monkeypatch):
    from gptlite.errors import ConfigError

    step = _checkpoint(tmp_path / "save", {"step": 4, "format": "torch"}, {"model/state.pt": bytes(range(256)) * 40})
    manifest.write(step)
    assert own_key.stat().st_mode & 0o777 == 0o600  # made on first use, readable by this user alone
    assert set(json.loads((step / "manifest.json").read_text())["files"]) == {"meta.json", "model/state.pt"}
    assert manifest.verify(step, "here") is True

    def refused(pattern, **kw):
        with pytest.raises(ConfigError, match=pattern):
            manifest.verify(step, "here", **kw)

    state = step / "model" / "state.pt"
    good = state.read_bytes()
    state.write_bytes(good[:-7])
    refused(r"^here is damaged: model/state.pt is 10233 bytes, 10240 when it was written")
    refused(r"^here is damaged", trust=True)  # trusting its author does not make a truncated file whole
    state.write_bytes(good[:100] + b"\xff" + good[101:])  # the same size, one byte changed
    refused(r"^here is damaged: model/state.pt is not what was written \(its SHA-256 differs\)")
    state.write_bytes(good)
    (step / "model" / "extra_optim_states.pt").write_bytes(b"x")  # DeepSpeed's loader picks files up by name
    refused(r"^here is damaged: it holds model/extra_optim_states.pt, which was not in it when it was written")
    (step / "model" / "extra_optim_states.pt").unlink()
    (step / "model" / "link").symlink_to(state)
    refused(r"^here is damaged: model/link is a link")
    (step / "model" / "link").unlink()
    assert manifest.verify(step, "here") is True
    # Whoever rewrote a file can rewrite its hash too, but cannot sign it with this user's key...
    forged = json.loads((step / "manifest.json").read_text())
    state.write_bytes(good[::-1])
    forged["files"]["model/state.pt"]["sha256"] = manifest.file_digest(state)[1]
    (step / "manifest.json").write_text(json.dumps(forged))
    refused(r"^here was signed by \S+ with another key than yours \(.*\): .*; if you trust whoever wrote it, "
            r"pass --trust_checkpoint")
    # ... nor is a manifest signed with their own key, however plausible, this user's.
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "theirs.key"))
    manifest.write(step)
    monkeypatch.setenv(KEY_ENV, str(own_key))
    refused(r"^here was signed by \S+ with another key than yours")
    assert manifest.verify(step, "here", trust=True) is False  # let through, unverified: the caller says so
    (step / "manifest.json").unlink()  # a checkpoint from before they were signed, or from another tool
    refused(r"^here has no manifest.json signed by you: .*; if you trust whoever wrote it, pass --trust_checkpoint$")
    assert manifest.verify(step, "here", trust=True) is False


def test_the_ranks_of_one_machine_hash_a_checkpoint_once(tmp_path, monkeypatch):
    """Every rank verifies (and so refuses what rank 0 refuses); the first hashes, the others find its note."""
    step = _checkpoint(tmp_path / "save", {"step": 4, "format": "torch"}, {"a.pt": b"a" * 1000, "b.pt": b"b" * 10})
    manifest.write(step)
    hashed = []
    digest = manifest.file_digest
    monkeypatch.setattr(manifest, "file_digest", lambda path: hashed.append(path.name) or digest(path))
    for _ in range(3):
        assert manifest.verify(step, "here") is True
    assert sorted(hashed) == ["a.pt", "b.pt", "meta.json"]
    (step / "b.pt").write_bytes(b"c" * 10)  # changed since: its note no longer holds
    with pytest.raises(Exception, match="b.pt is not what was written"):
        manifest.verify(step, "here")
    assert sorted(hashed) == ["a.pt", "a.pt", "b.pt", "b.pt", "meta.json"]


def test_the_signing_key_is_made_once_and_kept_to_its_user(own_key):
    from gptlite.errors import ConfigError

    key = manifest.signing_key()
    assert manifest.signing_key() == key and len(key) == 32 and own_key.stat().st_mode & 0o777 == 0o600
    own_key.chmod(0o644)
    with pytest.raises(ConfigError, match=r"^GPTLITE_CHECKPOINT_KEY: the checkpoint signing key .* is open to other "
                                          r"users \(mode 644\); make it yours alone: chmod 600"):
        manifest.signing_key()
    own_key.chmod(0o600)
    own_key.write_text("not a key\n")
    with pytest.raises(ConfigError, match="is not a checkpoint signing key"):
        manifest.signing_key()


class _Saving:
    """What checkpoint.save needs of a backend: a torch-format state of a two-parameter model."""
    checkpoint_format = "torch"

    def save_checkpoint(self, directory):
        directory.mkdir(parents=True)
        torch.save({"model": {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2)}}, directory / "state.pt")


def _saved(tmp_path) -> Path:
    from training import checkpoint

    save_dir = tmp_path / "save"
    checkpoint.save(_Saving(), save_dir, 4, 0, {"run_id": "r", "record": str(tmp_path / "runs" / "r"),
                                                 "run_name": "r"})
    return save_dir


def test_a_checkpoint_is_saved_with_its_manifest_inside_it(tmp_path):
    save_dir = _saved(tmp_path)
    step = save_dir / "step_00000004"
    assert sorted(json.loads((step / "manifest.json").read_text())["files"]) == [
        "meta.json", "model/state.pt", "rng/rank0.pt"]
    assert manifest.verify(step, "here") is True
    assert not list(save_dir.glob(".*partial"))  # renamed into place with it
    # The owner file keeps the same signed manifest, and the checkpoint is held to it: a step whose
    # manifest.json was re-signed after its files changed (this user's key, so the signature holds) is
    # refused for not being the manifest written at save time.
    kept = json.loads((save_dir / "owner.json").read_text())["checkpoints"]
    assert kept == {"step_00000004": json.loads((step / "manifest.json").read_text())}
    with open(step / "meta.json", "a") as f:
        f.write(" ")
    manifest.write(step)
    with pytest.raises(ConfigError, match="not the one .*owner.json recorded"):
        manifest.verify(step, "here")


# ------------------------------------------------------------------ checkpoints carrying code
def test_a_dcp_checkpoint_whose_metadata_runs_code_runs_none_of_it(tmp_path):
    """The probe's first case: torch's DCP reader unpickles .metadata, in training.export and in the
    pre-start check of an FSDP2 --resume (its parameter shapes)."""
    from training.cli import config_from_argv
    from training.run import prepare_run

    marker = tmp_path / "ran"
    flags = ["--fsdp_config", "fsdp_configs/fsdp2.yaml", "--preset", "tiny", "--micro_batch", "2"]
    setup = prepare_run(config_from_argv([*flags, "--dry_run"]))
    meta = {"step": 4, "format": "dcp", "backend": "fsdp2", "global_batch": setup.layout.global_batch,
            "model": setup.workload.description, "world_size": 2, "run_id": "theirs", "run_name": "r"}
    save_dir = tmp_path / "save"
    _checkpoint(save_dir, meta, {"model/dcp/.metadata": pickle.dumps(Marker(marker)),
                                 "model/dcp/__0_0.distcp": b"", "model/extra.pt": _torch_bytes({})})
    before = _files(save_dir)
    _refused(_export(tmp_path, save_dir), "has no manifest.json signed by you", "--trust_checkpoint")
    _refused(_train(*flags, "--steps", "9", "--save_dir", save_dir, "--resume", "--runs_dir", tmp_path / "runs",
                    "--run_name", "r", "--quiet"), "resume: the checkpoint", "--trust_checkpoint")
    assert not marker.exists()
    assert not (tmp_path / "exported" / "model.pt").exists() and not (tmp_path / "runs").exists()
    assert _files(save_dir) == before


def test_a_deepspeed_zero0_checkpoint_carrying_code_runs_none_of_it(tmp_path):
    """The probe's second case: training.export read a ZeRO-0 checkpoint with weights_only=False. Refused
    without a manifest; trusted, its file is read weights-only, which refuses the callable unrun."""
    marker = tmp_path / "ran"
    save_dir = tmp_path / "save"
    _checkpoint(save_dir, {"step": 4, "format": "deepspeed", "backend": "deepspeed"},
                {"model/ckpt/mp_rank_00_model_states.pt": _torch_bytes({"module": Marker(marker)}),
                 "model/latest": b"ckpt"})
    _refused(_export(tmp_path, save_dir), "has no manifest.json signed by you", "--trust_checkpoint")
    _refused(_export(tmp_path, save_dir, "--trust_checkpoint"), "cannot be read as a deepspeed checkpoint "
             "(weights-only loading refused Unsupported global: GLOBAL io.open")
    assert not marker.exists() and not (tmp_path / "exported" / "model.pt").exists()


def test_a_torch_checkpoint_holding_a_callable_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "ran"
    save_dir = tmp_path / "save"
    _checkpoint(save_dir, {"step": 4, "format": "torch"}, {"model/state.pt": _torch_bytes({"model": Marker(marker)})})
    _refused(_export(tmp_path, save_dir), "has no manifest.json signed by you")
    _refused(_export(tmp_path, save_dir, "--trust_checkpoint"),
             "cannot be read as a torch checkpoint (weights-only loading refused Unsupported global: GLOBAL io.open")
    assert not marker.exists() and not (tmp_path / "exported" / "model.pt").exists()


def test_a_trusted_dcp_checkpoint_says_its_metadata_is_a_pickle(tmp_path):
    """--trust_checkpoint on a format that is a pickle beyond torch's weights-only loader: loaded, and said."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2)}
    save_dir = tmp_path / "save"
    directory = _checkpoint(save_dir, {"step": 4, "format": "dcp"}, {})
    dcp.save({"model": state}, checkpoint_id=str(directory / "model" / "dcp"), no_dist=True)
    _refused(_export(tmp_path, save_dir), "has no manifest.json signed by you")
    proc = _export(tmp_path, save_dir, "--trust_checkpoint")
    assert proc.returncode == 0, proc.stderr
    note = proc.stderr.strip().splitlines()
    assert len(note) == 1 and note[0].startswith(f"note: {directory} is loaded on --trust_checkpoint"), note
    assert "DCP's .metadata (and its non-tensor items) is a pickle" in note[0]
    exported = torch.load(tmp_path / "exported" / "model.pt", weights_only=True)
    assert exported["step"] == 4 and all(torch.equal(exported["model"][k], v) for k, v in state.items())
    # What the export wrote is signed: --init_from checks it (below).
    assert manifest.verify(tmp_path / "exported", "here", only="model.pt") is True


# ------------------------------------------------------------------ damaged or malformed checkpoints
def test_an_export_of_a_truncated_checkpoint_is_one_line(tmp_path):
    save_dir = _saved(tmp_path)
    state = save_dir / "step_00000004" / "model" / "state.pt"
    state.write_bytes(state.read_bytes()[:300])
    _refused(_export(tmp_path, save_dir), f"the checkpoint {save_dir / 'step_00000004'} is damaged: model/state.pt "
                                          "is 300 bytes")
    # Unsigned and trusted: torch's reader fails, said in one line.
    (save_dir / "step_00000004" / "manifest.json").unlink()
    _refused(_export(tmp_path, save_dir, "--trust_checkpoint"), "cannot be read as a torch checkpoint (RuntimeError")
    assert not (tmp_path / "exported" / "model.pt").exists()


def test_a_meta_json_holding_a_list_is_one_line_naming_it(tmp_path):
    save_dir = _saved(tmp_path)
    step = save_dir / "step_00000004"
    (step / "meta.json").write_text("[4, \"torch\"]")
    manifest.write(step)  # signed as it is: the meta.json itself is what is wrong
    (save_dir / "owner.json").unlink()  # a directory from before directories had owners
    before = _files(save_dir)
    named = f"{step / 'meta.json'} holds a list; a checkpoint's meta.json is an object"
    _refused(_export(tmp_path, save_dir), named)
    runs = ["--runs_dir", tmp_path / "runs", "--run_name", "r", "--save_dir", save_dir, "--quiet", "--preset", "tiny"]
    _refused(_train(*runs, "--resume", "--steps", "9"), f"resume: the checkpoint {step}: {named}")
    _refused(_train(*runs, "--save_every", "2", "--steps", "9"), f"save_dir: {save_dir} holds checkpoints "
             "(step_00000004) whose meta.json names no run")
    # Refused holding the directory's and the record's locks (let go, their files left): nothing else written.
    assert {k: v for k, v in _files(save_dir).items() if k != "owner.lock"} == before
    assert not list((tmp_path / "runs").rglob("*.json"))


# ------------------------------------------------------------------ --init_from and --data
def test_init_from_reads_only_a_signed_export_unless_trusted(tmp_path):
    from gptlite.errors import ConfigError
    from training.cli import config_from_argv
    from training.run import prepare_run

    flags = ["--preset", "tiny", "--steps", "9", "--runs_dir", str(tmp_path / "runs")]
    model = prepare_run(config_from_argv([*flags, "--dry_run"])).workload.build(0)
    export = tmp_path / "theirs" / "model.pt"
    export.parent.mkdir()
    torch.save({"model": model.state_dict(), "step": 4}, export)  # an export's layout, signed by nobody
    with pytest.raises(ConfigError, match=rf"^init_from: {export} has no manifest.json signed by you: .* pass "
                                          "--trust_checkpoint"):
        prepare_run(config_from_argv([*flags, "--init_from", str(export)]))
    assert prepare_run(config_from_argv([*flags, "--init_from", str(export), "--trust_checkpoint"])).init["step"] == 4
    manifest.write(export.parent, files=["model.pt"])  # as training.export signs what it writes
    assert prepare_run(config_from_argv([*flags, "--init_from", str(export)])).init["step"] == 4
    assert not (tmp_path / "runs").exists()


def _cifar_python(directory: Path, images, labels, evil=None) -> Path:
    directory.mkdir(parents=True)
    for name, count in [(f"data_batch_{i}", 4) for i in range(1, 6)] + [("test_batch", 2)]:
        batch = {b"batch_label": name.encode(), b"labels": labels[:count], b"data": images[:count]}
        if evil is not None:
            batch[b"filenames"] = evil
        (directory / name).write_bytes(pickle.dumps(batch, protocol=2))
    return directory


def test_cifar_pickles_are_read_only_when_trusted_and_run_no_code(tmp_path):
    """CIFAR-10's python version is pickles (models/vision.py read them with pickle.load): refused without
    --trust_data; with it, read accepting arrays, lists and bytes only. The binary version needs no flag."""
    import numpy as np

    from gptlite.data import DataError
    from models.vision import image_data

    marker = tmp_path / "ran"
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(4, 3 * 32 * 32), dtype=np.uint8)
    labels = [3, 1, 4, 1]
    honest = _cifar_python(tmp_path / "honest" / "cifar-10-batches-py", images, labels)
    evil = _cifar_python(tmp_path / "evil" / "cifar-10-batches-py", images, labels, evil=Marker(marker))
    with pytest.raises(DataError, match=r"^--data: .*cifar-10-batches-py is CIFAR-10's python version, whose batches "
                                        r"are pickles .*pass --trust_data .*or use CIFAR-10's binary version"):
        image_data(str(honest.parent))
    with pytest.raises(DataError, match=r"^--data: .*data_batch_1 is not a CIFAR-10 batch \(it names \w+\.open"):
        image_data(str(evil.parent), trust=True)
    assert not marker.exists()
    trusted = image_data(str(honest.parent), trust=True)
    # The binary version (a label byte, then the image's bytes, per record) of the same images, no flag.
    binary = tmp_path / "bin" / "cifar-10-batches-bin"
    binary.mkdir(parents=True)
    for name, count in [(f"data_batch_{i}", 4) for i in range(1, 6)] + [("test_batch", 2)]:
        records = np.concatenate([np.array(labels[:count], dtype=np.uint8)[:, None], images[:count]], axis=1)
        (binary / f"{name}.bin").write_bytes(records.tobytes())
    plain = image_data(str(binary.parent))
    assert len(plain.splits["train"]) == len(trusted.splits["train"]) == 20 and len(plain.splits["val"]) == 2
    for i in range(20):
        (x, y), (x_trusted, y_trusted) = plain.sample("train", i), trusted.sample("train", i)
        assert torch.equal(x, x_trusted) and y == y_trusted == labels[i % 4]
    # train.py: one line naming the flag, exit code 2, nothing recorded.
    proc = _train("--model", "hf:resnet", "--data", evil.parent, "--runs_dir", tmp_path / "runs", "--steps", "2")
    _refused(proc, "train.py: error: --data:", "--trust_data")
    assert not marker.exists() and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ real launches: nothing starts
BACKENDS = {"fsdp2": ("fsdp2-saved", "torchrun", "model/dcp/__0_0.distcp"),
            "z3": ("z3-saved", "deepspeed", "model/ckpt/zero_pp_rank_0_mp_rank_00_optim_states.pt")}


def _copy(launches, name, request, tmp_path):
    """A copy of the shared launch's record and checkpoints (to damage), and the environment its key is in."""
    run = launches.get(name, request)
    runs, save_dir = tmp_path / "runs", tmp_path / "save"
    shutil.copytree(run.dir, runs / run.dir.name)
    shutil.copytree(run.dir.parent / "save", save_dir)
    assert (save_dir / "latest").read_text().strip() == "step_00000003" and (save_dir / "step_00000001").is_dir()
    return run.dir.name, runs, save_dir, {KEY_ENV: str(run.dir.parent / "checkpoint.key")}


def _resume(name, launch_name, launcher, runs, save_dir, env):
    """The launch's own command, resumed for two more steps, under its launcher, as a user would."""
    from launches import LAUNCHES

    args = [a.replace("{DIR}/save", str(save_dir)) for a in LAUNCHES[launch_name].args]
    return launch(TRAIN, [*args, "--steps", "6", "--resume", "--runs_dir", str(runs), "--run_name", name, "--quiet"],
                  launcher=launcher, nproc=2, env=env, real=True, timeout=600)


def _said_once(proc, launcher: str, text: str) -> None:
    """The refusal under a launcher: its line once, no traceback through the suite's code, and not a run
    that went on. The deepspeed launcher passes on the ranks' exit code and stderr (every rank refused:
    the one line of rank 0); torchrun exits 1 and prints rank 0's line from torch elastic's error file."""
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if launcher == "deepspeed":
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-5000:]
    assert proc.stderr.count(text) == 1, proc.stderr[-5000:]
    ours = [line for line in proc.stderr.splitlines()
            if line.strip().startswith(f'File "{REPO}') and f"{REPO}/.venv" not in line]
    assert not ours, "\n".join(ours)


@pytest.mark.distributed
@pytest.mark.parametrize("backend, damage", [("fsdp2", "truncated"), ("fsdp2", "replaced"), ("z3", "replaced")])
def test_a_damaged_checkpoint_is_refused_before_any_rank_starts(launches, request, tmp_path, backend, damage):
    """A shard cut short, or swapped for the same shard of the checkpoint before (a whole, valid file that
    the zip check passed): found by the manifest before any rank starts, the finished record and every
    checkpoint byte as they were (an FSDP2 resume crashed its ranks and turned the record `failed`)."""
    launch_name, launcher, shard = BACKENDS[backend]
    name, runs, save_dir, env = _copy(launches, launch_name, request, tmp_path)
    target = save_dir / "step_00000003" / shard
    if damage == "truncated":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    else:
        shutil.copyfile(save_dir / "step_00000001" / shard, target)
    before = {**_files(runs), **_files(save_dir)}
    assert json.loads((runs / name / "summary.json").read_text())["status"] == "ok"
    proc = _resume(name, launch_name, launcher, runs, save_dir, env)
    _said_once(proc, launcher, f"resume: the checkpoint {save_dir / 'step_00000003'} is damaged: {shard} ")
    assert {**_files(runs), **_files(save_dir)} == before


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["fsdp2", "z3"])
def test_a_checkpoint_carrying_code_runs_none_of_it(launches, request, tmp_path, monkeypatch, backend):
    """Someone else's checkpoint, with a manifest as plausible as they can make it (signed with their own
    key): an FSDP2 resume ran DCP's .metadata in its pre-start check; a DeepSpeed one ran a callable in
    the engine's files as it loaded them, and recorded the run ok. Now: refused, naming
    --trust_checkpoint, before any rank reads a byte of it."""
    launch_name, launcher, shard = BACKENDS[backend]
    name, runs, save_dir, env = _copy(launches, launch_name, request, tmp_path)
    marker = tmp_path / "ran"
    step = save_dir / "step_00000003"
    if backend == "fsdp2":
        (step / "model" / "dcp" / ".metadata").write_bytes(pickle.dumps(Marker(marker)))
    else:
        states = step / "model" / "ckpt" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        carried = torch.load(states, weights_only=False)
        carried["note"] = Marker(marker)
        states.write_bytes(_torch_bytes(carried))
        assert not marker.exists()
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "their.key"))
    manifest.write(step)
    before = {**_files(runs), **_files(save_dir)}
    proc = _resume(name, launch_name, launcher, runs, save_dir, env)
    _said_once(proc, launcher, f"resume: the checkpoint {step} was signed by")
    assert "--trust_checkpoint" in proc.stderr
    assert not marker.exists()
    assert {**_files(runs), **_files(save_dir)} == before
