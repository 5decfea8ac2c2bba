"""Signed manifests: a checkpoint is loaded only once the suite has checked that it wrote it.

Checkpoints are pickles in part (torch.save's files, DCP's .metadata, DeepSpeed's engine files), and
unpickling runs whatever code a file names: a checkpoint someone else wrote, shared or left in a
shared directory, would be a way to run code as you. So each checkpoint (training/checkpoint.py)
and each export (training/export.py) is written with manifest.json beside its files:

    {"version": 1, "files": {"model/state.pt": {"size": 1234, "sha256": "..."}, ...},
     "key_id": "...", "written_by": "user@host", "hmac": "..."}

and a checkpoint's manifest is kept in its --save_dir's owner.json too, which verify holds it to.

`hmac` is HMAC-SHA256 over the rest, under a key only you can read: a list of hashes alone could be
rewritten by whoever rewrote the files. Before anything is unpickled (a resume, an export,
--init_from), `verify` checks the signature, then that the directory holds exactly those files with
those sizes and SHA-256s: a checkpoint without a valid manifest (another user's or machine's, or one
from before checkpoints were signed) is refused in one line naming --trust_checkpoint, and a
truncated or changed file is found before any rank starts.

The key: the file $GPTLITE_CHECKPOINT_KEY names, else checkpoint.key in $GPTLITE_CACHE (default
~/.cache/gptlite); 32 random bytes made with mode 0600 the first time a checkpoint is saved. Rank 0
signs; every rank verifies (and so refuses what rank 0 refuses, under every launcher), so on several
nodes each needs the key: a shared home, or the variable pointing at a copy (docs/checkpoints.md).
The ranks of one machine hash the files once: the first to take the checkpoint's lock in verified/
beside the key hashes them and notes each file's identity (size, inode, device, mtime, ctime, which
any change to it changes); the others find the note true and only check the signature and sizes.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import tempfile
from pathlib import Path

from core.owned import DCP_FORMAT, DEEPSPEED_FORMAT, OWNER
from core.records import atomic_write_json
from gptlite.errors import ConfigError

MANIFEST = "manifest.json"
KEY_ENV = "GPTLITE_CHECKPOINT_KEY"
KEY_FILE = "checkpoint.key"
TRUST_FLAG = "--trust_checkpoint"
VERSION = 1
_CHUNK = 1 << 20


def key_path() -> Path:
    """Where this user's signing key is: $GPTLITE_CHECKPOINT_KEY, else $GPTLITE_CACHE/checkpoint.key."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV])
    return Path(os.environ.get("GPTLITE_CACHE") or Path.home() / ".cache" / "gptlite") / KEY_FILE


def _read_key(path: Path) -> bytes | None:
    """The key in `path`, None if there is none; ConfigError for one that others could read or
    that is not a key (a signature under a key others know proves nothing)."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"{KEY_ENV}: the checkpoint signing key {path} cannot be read ({e.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{KEY_ENV}: the checkpoint signing key {path} is open to other users (mode "
                          f"{stat.S_IMODE(mode):o}); make it yours alone: chmod 600 {path}")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ConfigError(f"{KEY_ENV}: {path} is not a checkpoint signing key (hex digits, 32 bytes as the suite makes "
                          "it); point GPTLITE_CHECKPOINT_KEY at your key, or remove the file to make a new one")
    return key


def signing_key() -> bytes:
    """This user's key, made on first use (mode 0600; two processes making it at once get the same one)."""
    path = key_path()
    key = _read_key(path)
    if key is not None:
        return key
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic, and never replaces a key another process made meanwhile
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    except OSError as e:
        raise ConfigError(f"{KEY_ENV}: cannot make the checkpoint signing key {path} ({e.strerror}); point "
                          f"{KEY_ENV} at a file you can write") from None
    return _read_key(path)


def key_id(key: bytes) -> str:
    """A name for a key that does not give it away (said in refusals: which key signed what)."""
    return hashlib.sha256(b"gptlite checkpoint key\0" + key).hexdigest()[:16]


def file_digest(path: Path) -> tuple[int, str]:
    """(size, SHA-256) of a file, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _sign(key: bytes, body: dict) -> str:
    canonical = json.dumps({k: v for k, v in body.items() if k != "hmac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and not p.is_symlink() and p != directory / MANIFEST)


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def write(directory: Path, files: list[str] | None = None) -> Path:
    """Sign `files` (relative to `directory`; default every file under it) into directory/manifest.json."""
    key = signing_key()
    body = {"version": VERSION, "files": {}, "key_id": key_id(key), "written_by": _who()}
    for name in _files(directory) if files is None else files:
        size, sha = file_digest(directory / name)
        body["files"][name] = {"size": size, "sha256": sha}
    body["hmac"] = _sign(key, body)
    atomic_write_json(directory / MANIFEST, body)
    return directory / MANIFEST


def _parse(path: Path) -> dict | str:
    """The manifest in `path`, or what is wrong with it."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"not readable JSON ({type(e).__name__})"
    if not isinstance(body, dict):
        return f"holds a {type(body).__name__}, not an object"
    if body.get("version") != VERSION:
        return f"version {body.get('version')!r}, not {VERSION}"
    files = body.get("files")
    if not isinstance(files, dict) or not isinstance(body.get("hmac"), str):
        return "'files' and 'hmac' missing"
    for name, entry in files.items():
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str)
                or Path(name).is_absolute() or ".." in Path(name).parts):
            return f"files.{name}: not a size and SHA-256 of a file inside it"
    return body


def verify(directory: Path, where: str, trust: bool = False, only: str | None = None) -> bool:
    """Check `directory` against its manifest before anything in it is loaded: signed with this
    user's key, and holding exactly the files listed (only the file `only`, for an export) with their
    sizes and SHA-256s. Refusals are ConfigErrors starting with `where` (one line). With `trust`
    (--trust_checkpoint) a missing or foreign manifest is let through, but damage it shows is still
    refused. True where the signature and every file checked out; False where `trust` let it through."""
    path = directory / MANIFEST
    trust_it = f"if you trust whoever wrote it, pass {TRUST_FLAG}"
    if not path.is_file():
        if trust:
            return False
        raise ConfigError(f"{where} has no {MANIFEST} signed by you: it was written by another tool, or by this suite "
                          f"before checkpoints were signed, and loading it unpickles its files, which can run code; "
                          f"{trust_it}")
    body = _parse(path)
    if isinstance(body, str):
        if trust:
            return False
        raise ConfigError(f"{where}: its {path} is not a manifest this suite writes ({body}); {trust_it}")
    key = _read_key(key_path())
    signed = key is not None and hmac.compare_digest(_sign(key, body), body["hmac"])
    if not signed and not trust:
        by = f" by {body['written_by']}" if isinstance(body.get("written_by"), str) else ""
        raise ConfigError(f"{where} was signed{by} with another key than yours ({key_path()}): a checkpoint of another "
                          f"user or machine, or a manifest rewritten by hand; {trust_it} (on several nodes, each needs "
                          f"the key that signed it: {KEY_ENV})")
    recorded = _owner_copy(directory)
    if recorded is not None and recorded != body:
        raise ConfigError(f"{where} is damaged: its {MANIFEST} is not the one {directory.parent / OWNER} recorded when "
                          "it was saved; nothing was loaded")
    _check_files(directory, body["files"], where, only)
    return signed


def _owner_copy(directory: Path) -> dict | None:
    """The manifest the --save_dir's owner file recorded for checkpoint `directory` when it was saved
    (training/checkpoint.py), or None where there is no such record (an export, a step copied alone)."""
    try:
        found = json.loads((directory.parent / OWNER).read_text())
    except (OSError, ValueError):
        return None
    kept = found.get("checkpoints") if isinstance(found, dict) else None
    return kept.get(directory.name) if isinstance(kept, dict) else None


def _check_files(directory: Path, files: dict, where: str, only: str | None) -> None:
    damaged = f"{where} is damaged:"
    if only is not None:
        if only not in files:
            raise ConfigError(f"{where}: {directory / MANIFEST} does not list {only}; it signs another file")
        files = {only: files[only]}
    else:
        for p in sorted(directory.rglob("*")):
            if p.is_symlink() or not (p.is_file() or p.is_dir()):
                raise ConfigError(f"{damaged} {p.relative_to(directory)} is a link or a special file, which no "
                                  "checkpoint holds")
        extra = sorted(set(_files(directory)) - set(files))
        if extra:
            raise ConfigError(f"{damaged} it holds {extra[0]}, which was not in it when it was written")
    for name, entry in sorted(files.items()):
        target = directory / name
        if not target.is_file() or target.is_symlink():
            raise ConfigError(f"{damaged} {name} is missing (listed in its {MANIFEST})")
        size = target.stat().st_size
        if size != entry["size"]:
            raise ConfigError(f"{damaged} {name} is {size} bytes, {entry['size']} when it was written (truncated or "
                              "replaced); nothing was loaded")
    with _hashed_once(directory, files) as done:
        if done:
            return
        for name, entry in sorted(files.items()):
            if not hmac.compare_digest(file_digest(directory / name)[1], entry["sha256"]):
                raise ConfigError(f"{damaged} {name} is not what was written (its SHA-256 differs); nothing was "
                                  "loaded")


def _identity(path: Path) -> list[int]:
    """What changes whenever a file's content can have (ctime: no user call sets it back)."""
    st = path.stat()
    return [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]


@contextlib.contextmanager
def _hashed_once(directory: Path, files: dict):
    """Yields True where this machine's ranks already hashed `files` and none has changed since; else
    False, and a hash that completes without raising is noted for the next rank. Held one rank at a
    time (a lock per checkpoint), so that the ranks started together hash it once. Where the notes
    cannot be kept (no writable cache), every rank hashes."""
    notes = key_path().parent / "verified"  # the user's own, beside the key (a shared home: per machine by st_dev)
    listed = json.dumps({name: entry["sha256"] for name, entry in sorted(files.items())}, sort_keys=True)
    name = hashlib.sha256(f"{directory.resolve()}\0{listed}".encode()).hexdigest()[:32]
    lock = None
    with contextlib.suppress(OSError):
        notes.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not stat.S_IMODE(notes.stat().st_mode) & 0o077:  # notes others could write would vouch for anything
            lock = open(notes / f"{name}.lock", "a+")
    if lock is None:
        yield False
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        identity = {n: _identity(directory / n) for n in sorted(files)}
        note = notes / f"{name}.json"
        try:
            done = json.loads(note.read_text()) == identity
        except (OSError, ValueError):
            done = False
        yield done
        if not done:
            with contextlib.suppress(OSError):
                atomic_write_json(note, identity)


# Formats whose files are pickles beyond torch's weights-only loader: said when loaded unverified.
PICKLED = {DCP_FORMAT: "DCP's .metadata (and its non-tensor items) is a pickle",
           DEEPSPEED_FORMAT: "DeepSpeed's engine files are pickles (DeepSpeed loads them with weights_only=False)"}
# (A ZeRO-0 export reads its one file weights-only: training/export.py passes DeepSpeed's only for ZeRO 1-3.)


def trusted_note(directory: Path, fmt: str | None) -> str | None:
    """The line said when a checkpoint is loaded on --trust_checkpoint alone, where its format is a
    pickle that torch's weights-only loader cannot read (torch files are read weights-only: no note)."""
    if fmt not in PICKLED:
        return None
    return (f"note: {directory} is loaded on {TRUST_FLAG} (no manifest signed by you): {PICKLED[fmt]}, "
            "unpickled as such, which runs any code it names")
