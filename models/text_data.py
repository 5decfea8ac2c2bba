"""Tokenized text for language models: a tokenizer and a dataset read through Hugging Face's libraries,
with the flags of transformers' run_clm.py example (--tokenizer_name, --dataset_name,
--dataset_config_name, --train_file, --validation_file, --text_column_name, --block_size).

    tokenizer   AutoTokenizer.from_pretrained: a local directory, or a Hub name
    rows        datasets.load_dataset: a Hub name (or a local directory of data files), or local files by
                their extension (.txt a row per line, .json/.jsonl, .parquet, .csv); without a validation
                file, the last --validation_split_percentage of the training rows (in file order: the
                same split every run)
    tokens      each row's text tokenized as the tokenizer does by default (its BOS/EOS included)
    samples     packed (run_clm.py's group_texts): the tokens of each 1000 rows joined and cut into
                samples of block_size inputs, each with its next tokens as targets (the last target is
                the next sample's first input); or, with --pad_to_block_size, one row per sample, cut
                to block_size + 1 tokens and padded: inputs with the pad token, targets with -100,
                which cross-entropy leaves out (models/workload.py IGNORE_INDEX).

Tokenizing and packing run once: datasets' map writes each step's result to its cache
($GPTLITE_CACHE/datasets, default ~/.cache/gptlite/datasets) under a fingerprint of what it was made
from (the rows' own fingerprint, the tokenizer's full definition, the column, block_size, the layout),
and a later run with the same inputs reads it back. The ranks of a run take a file lock around it, so
the first tokenizes and the others read its cache.

A sample is (input_ids, labels) of block_size tokens each, like the character windows; the global
batch of a step is drawn by the suite's deterministic sampler (gptlite/data.py draw_indices), so
every backend and world size trains on the same samples in the same order.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from gptlite.data import DataError, draw_indices
from gptlite.errors import ConfigError, one_line
from models.hub import hub_unreachable, import_datasets as _datasets, import_transformers as _transformers
from models.spec import TextRequest, text_file_builder
from models.workload import IGNORE_INDEX

ROWS_PER_PACK = 1000  # run_clm.py packs the rows of each batch of its map (1000 rows) on their own
VERSION = 1  # of the tokenizing and packing below: a change makes new cache entries


def cache_dir() -> Path:
    return Path(os.environ.get("GPTLITE_CACHE") or Path.home() / ".cache" / "gptlite") / "datasets"


def _local(name: str) -> bool:
    return os.path.exists(name) or name.startswith((".", "/", "~"))


def load_tokenizer(name: str | None, flag: str = "tokenizer_name"):
    """AutoTokenizer.from_pretrained(name): a local directory, or a Hub name where the Hub can be
    reached (its cached copy first). ConfigError, one line, for anything else."""
    if name is None:
        raise ConfigError("tokenizer_name: tokenized text needs a tokenizer: --tokenizer_name (a local directory "
                          "of a tokenizer's files, or a Hub name), or --model_name_or_path (the checkpoint's)")
    transformers = _transformers()
    if _local(name):
        path = Path(name).expanduser()
        if not path.is_dir():
            raise ConfigError(f"{flag}: {name} is not a directory (a tokenizer is a directory of its files, as "
                              "save_pretrained writes them: tokenizer.json, tokenizer_config.json, ...)")
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 - OSError, ValueError, KeyError: not a tokenizer
            raise ConfigError(f"{flag}: {name} holds no tokenizer transformers can load ({one_line(e)}); give "
                              "--tokenizer_name a directory a tokenizer's save_pretrained wrote") from None
        # transformers makes a tokenizer of no vocabulary from a directory of a config.json alone (a
        # checkpoint saved without its tokenizer), which turns every text into no tokens at all.
        if not tokenizer.vocab_size:
            raise ConfigError(f"{flag}: {name} holds no tokenizer transformers can load (no vocabulary: no tokenizer "
                              "files); give --tokenizer_name a directory a tokenizer's save_pretrained wrote")
        return tokenizer
    with contextlib.suppress(Exception):  # in the Hugging Face cache already: no network needed
        return transformers.AutoTokenizer.from_pretrained(name, local_files_only=True)
    why = hub_unreachable()
    if why is not None:
        raise ConfigError(f"{flag}: {name!r} is not a local directory and the Hugging Face Hub is out of reach "
                          f"({why}); pass a local path: a directory with the tokenizer's files")
    try:
        return transformers.AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - not on the Hub, gated, not a tokenizer
        raise ConfigError(f"{flag}: {name!r}: no tokenizer loads from it ({one_line(e)}); pass a local path: a "
                          "directory with the tokenizer's files") from None


def tokenizer_id(tokenizer) -> str:
    """A fingerprint of what the tokenizer does: its full definition (a fast tokenizer's JSON, its
    normalizer, pre-tokenizer, model, post-processor and added tokens), not where it was read from."""
    Hasher = _datasets().fingerprint.Hasher
    backend = getattr(tokenizer, "backend_tokenizer", None)
    what = backend.to_str() if backend is not None else Hasher.hash(tokenizer)
    return Hasher.hash((type(tokenizer).__name__, what))


def _rows(request: TextRequest) -> tuple[dict, str]:
    """{"train": Dataset, "val": Dataset or None} of raw rows, and a description of the source."""
    datasets = _datasets()
    cache = str(cache_dir())
    if request.train_file is not None:
        splits = {"train": _read_file("train_file", request.train_file, cache)}
        splits["val"] = _read_file("validation_file", request.validation_file, cache) \
            if request.validation_file is not None else None
        source = str(Path(request.train_file).resolve())
        if request.validation_file is not None:
            source += f" (validation: {Path(request.validation_file).resolve()})"
        return splits, source
    name, config = request.dataset_name, request.dataset_config_name
    source = name + (f" ({config})" if config else "")
    if not _local(name) and not (datasets.config.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE):
        why = hub_unreachable()
        if why is not None:
            raise ConfigError(f"dataset_name: {name!r} is not a local directory and the Hugging Face Hub is out of "
                              f"reach ({why}); pass local files: --train_file (and --validation_file), .txt, .jsonl "
                              "or .parquet")
    try:
        loaded = datasets.load_dataset(name, config, cache_dir=cache)
    except Exception as e:  # noqa: BLE001 - not found, offline, a configuration to choose, unreadable files
        raise ConfigError(f"dataset_name: {source}: cannot be loaded ({one_line(e)}); with no network, pass local "
                          "files: --train_file (and --validation_file)") from None
    if "train" not in loaded:
        raise DataError(f"dataset_name: {source} has no train split (its splits: {', '.join(loaded)})")
    val = next((loaded[s] for s in ("validation", "valid", "dev") if s in loaded), None)
    return {"train": loaded["train"], "val": val}, source


def _read_file(flag: str, path: str, cache: str):
    datasets = _datasets()
    builder = text_file_builder(flag, path)
    if not os.path.isfile(path):
        raise DataError(f"{flag}: file not found: {path}" if not os.path.exists(path)
                        else f"{flag}: not a regular file: {path}")
    if os.path.getsize(path) == 0:
        raise DataError(f"{flag}: {path} has no rows (an empty file)")
    # keep_linebreaks: each line keeps its newline, as run_clm.py reads text files.
    options = {"keep_linebreaks": True} if builder == "text" else {}
    try:
        # No progress bar: a local file's rows are read in moments, and a refusal of them (a column
        # missing, no rows) is then the only line said.
        with _progress(True):
            return datasets.load_dataset(builder, data_files={"train": path}, split="train", cache_dir=cache,
                                         **options)
    except Exception as e:  # noqa: BLE001 - datasets' generation errors: the cause is the file's
        cause = e.__cause__ or e
        raise DataError(f"{flag}: {path} cannot be read as {builder} ({one_line(cause)})") from None


def _text_column(ds, request: TextRequest, flag: str, path: str) -> str:
    datasets = _datasets()
    column = request.text_column_name or "text"
    if column not in ds.column_names:
        have = ", ".join(ds.column_names) or "none"
        raise DataError(f"{flag}: {path} has no column {column!r} (its columns: {have}); name the text's column "
                        "with --text_column_name")
    feature = ds.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise DataError(f"{flag}: {path}: column {column!r} is not text (it holds {feature}); name the text's column "
                        "with --text_column_name")
    return column


def _tokenize(tokenizer, column: str):
    def tokenize(rows):
        # A missing value (null in JSON Lines) is an empty row.
        ids = tokenizer([t or "" for t in rows[column]])["input_ids"]
        return {"ids": ids}

    return tokenize


def _pack(block_size: int):
    """run_clm.py's group_texts, with the targets of each sample: the tokens of the rows joined and
    cut into windows of block_size + 1 that overlap by one (inputs [0, T), targets [1, T + 1)), so
    every token but the first is a target once, and the inputs are run_clm.py's samples (but for its
    last where the tokens end exactly there: its last input would have no target). The remainder of
    each batch of rows is dropped, as run_clm.py drops it."""

    def pack(rows):
        joined = np.fromiter((t for ids in rows["ids"] for t in ids), dtype=np.int64)
        n = max((len(joined) - 1) // block_size, 0)
        return {"ids": [joined[i * block_size: (i + 1) * block_size + 1].tolist() for i in range(n)]}

    return pack


def _cut(block_size: int):
    """One row per sample: cut to block_size + 1 tokens; a row of fewer than two tokens has no target."""

    def cut(rows):
        return {"ids": [ids[: block_size + 1] for ids in rows["ids"] if len(ids) >= 2]}

    return cut


def _progress(quiet: bool):
    """datasets' progress bars on, or off with --quiet, for this load only."""
    datasets = _datasets()
    was_off = datasets.are_progress_bars_disabled()
    off = quiet or was_off

    @contextlib.contextmanager
    def scope():
        (datasets.disable_progress_bars if off else datasets.enable_progress_bars)()
        try:
            yield
        finally:
            (datasets.disable_progress_bars if was_off else datasets.enable_progress_bars)()

    return scope()


def load_text_dataset(request: TextRequest, block_size: int, tokenizer=None) -> "TokenizedText":
    """The run's text data: tokenized, packed (or padded) and split, read from the cache where the same
    was made before. `tokenizer`: one already loaded (else request.tokenizer is loaded). Raises
    ConfigError/DataError, one line."""
    Hasher = _datasets().fingerprint.Hasher
    _transformers()
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(request.tokenizer, request.tokenizer_flag)
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"GPTLITE_CACHE: cannot create {directory} for the tokenized data ({one_line(e)})") from None
    # The ranks of a run one after another: the first tokenizes, the others read what it cached. One lock
    # per source, so that runs on other data do not wait.
    what = [request.dataset_name, request.dataset_config_name] + [
        str(Path(f).resolve()) if f else None for f in (request.train_file, request.validation_file)]
    with FileLock(str(directory / f"prepare-{Hasher.hash(what)}.lock")), _progress(request.quiet):
        splits, source = _rows(request)
        made = _prepare(splits, request, tokenizer, block_size, source)
    return TokenizedText(made, tokenizer, request, block_size, source)


def _prepare(splits: dict, request: TextRequest, tokenizer, block_size: int, source: str) -> dict:
    datasets = _datasets()
    Features, Sequence, Value = datasets.Features, datasets.Sequence, datasets.Value
    Hasher = datasets.fingerprint.Hasher
    files = request.train_file is not None
    split_off = splits["val"] is None  # the validation rows are the training rows' last ones
    where = {"train": ("train_file" if files else "dataset_name", request.train_file or source)}
    where["val"] = ("validation_file", request.validation_file) if request.validation_file is not None \
        else where["train"] if split_off else ("dataset_name", source)
    train = splits["train"]
    column = _text_column(train, request, *where["train"])
    if not split_off:
        _text_column(splits["val"], request, *where["val"])
    else:
        n = len(train)
        cut = n - max(n * request.validation_split_percentage // 100, 1)  # at least one validation row
        if n and cut < 1:
            raise DataError(f"{where['train'][0]}: {where['train'][1]} has {n} rows: too few to split "
                            f"{request.validation_split_percentage}% off for validation; give more rows or "
                            "--validation_file")
        splits = {"train": train.select(range(cut)), "val": train.select(range(cut, n))}
    features = Features({"ids": Sequence(Value("int32"))})
    tokens_id = tokenizer_id(tokenizer)
    layout = "padded" if request.pad else "packed"
    made = {}
    for split, rows in splits.items():
        flag, path = where[split]
        if len(rows) == 0:
            raise DataError(f"{flag}: {path} has no rows (an empty {'file' if request.train_file else 'split'})")
        tokenized_fp = Hasher.hash(("gptlite-tokenize", VERSION, rows._fingerprint, tokens_id, column))
        tokenized = rows.map(_tokenize(tokenizer, column), batched=True, remove_columns=rows.column_names,
                             features=features, new_fingerprint=tokenized_fp,
                             load_from_cache_file=not request.overwrite_cache,
                             desc=f"Tokenizing the {'training' if split == 'train' else 'validation'} rows")
        layout_fp = Hasher.hash(("gptlite-layout", VERSION, tokenized_fp, layout, block_size))
        shaped = tokenized.map(_cut(block_size) if request.pad else _pack(block_size), batched=True,
                               batch_size=ROWS_PER_PACK, features=features, new_fingerprint=layout_fp,
                               load_from_cache_file=not request.overwrite_cache,
                               desc=f"{'Padding' if request.pad else 'Packing'} into samples of {block_size} tokens")
        if len(shaped) == 0:
            tokens = _real_tokens(tokenized, 0) + len(tokenized)
            need = "a row of at least 2 tokens" if request.pad else \
                f"at least {block_size + 1} tokens within {ROWS_PER_PACK} rows"
            more = "more text or a smaller --block_size"
            if split == "val" and split_off:
                more += ", a larger --validation_split_percentage or a --validation_file"
            raise DataError(f"{flag}: {path}: no {'training' if split == 'train' else 'validation'} sample of "
                            f"{block_size} tokens: its rows have {tokens} tokens in all ({len(rows)} rows of column "
                            f"{column!r}), a sample needs {need}; give {more}")
        made[split] = shaped.with_format("numpy")
    return made


class TokenizedText:
    """The training and validation samples behind CharDataset's `batch` interface."""

    def __init__(self, splits: dict, tokenizer, request: TextRequest, block_size: int, source: str):
        self.splits, self.tokenizer, self.block_size, self.source = splits, tokenizer, block_size, source
        self.pad = request.pad
        self._lengths: dict[str, np.ndarray] = {}  # each split's counted targets per sample (padded)
        self.tokenizer_name = request.tokenizer
        # Padding inputs never reach a real position's output (right padding, a causal model), and their
        # targets are -100: any id the embedding has will do.
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can give, its added tokens included (len(tokenizer))."""
        return len(self.tokenizer)

    def _samples(self, split: str, indices) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.splits[split][[int(i) for i in indices]]["ids"]
        n, T = len(rows), self.block_size
        x = torch.full((n, T), self.pad_id, dtype=torch.long)
        y = torch.full((n, T), IGNORE_INDEX, dtype=torch.long)
        for r, ids in enumerate(rows):
            ids = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            x[r, : len(ids) - 1] = ids[:-1]
            y[r, : len(ids) - 1] = ids[1:]
        return x, y

    def batch(self, split: str, seed: int, step: int, global_index: int, size: int, global_batch: int):
        """Samples [global_index, global_index + size) of `step`'s global batch: (x, y), each (size, T)."""
        indices = draw_indices(split, seed, step, global_batch, len(self.splits[split]))
        return self._samples(split, indices[global_index: global_index + size])

    def check(self) -> list[tuple]:
        """The first and last sample of each split, (x, y) (Workload.check reads their targets)."""
        out = []
        for split, ds in self.splits.items():
            x, y = self._samples(split, sorted({0, len(ds) - 1}))
            out += list(zip(x, y))
        return out

    def target_counts(self, split: str, seed: int, step: int, global_batch: int) -> np.ndarray | None:
        """The targets that count (not padding) of each sample of `step`'s global batch, for the loss to
        weigh micro-batches by (gptlite/data.py BatchLayout.micro_weights); None for packed samples,
        whose targets all count."""
        if not self.pad:
            return None
        if split not in self._lengths:
            import pyarrow.compute as pc

            lengths = pc.list_value_length(self.splits[split].data.column("ids")).to_numpy()
            self._lengths[split] = lengths.astype(np.int64) - 1
        return self._lengths[split][draw_indices(split, seed, step, global_batch, len(self.splits[split]))]

    def held_tensors(self) -> list[torch.Tensor]:
        return []  # memory-mapped Arrow files: no torch memory

    def describe(self) -> dict:
        """The record's description of the data (config.json's `data`)."""
        counts = {split: _real_tokens(ds, self.block_size) for split, ds in self.splits.items()}
        return {"source": self.source, "tokenizer": self.tokenizer_name, "vocab_size": self.vocab_size,
                "layout": "padded" if self.pad else "packed", "block_size": self.block_size,
                "train_samples": len(self.splits["train"]), "val_samples": len(self.splits["val"]),
                "train_tokens": counts["train"], "val_tokens": counts["val"],
                "sample": {"input": [self.block_size], "target": [self.block_size]},
                "held_tensor_bytes": {}}


def _real_tokens(ds, block_size: int) -> int:
    """Targets that count (not padding) in all the split's samples: each sample's tokens but the first."""
    import pyarrow.compute as pc

    return int(pc.sum(pc.list_value_length(ds.data.column("ids"))).as_py() or 0) - len(ds)


def check_vocab(tokenizer_vocab: int, model_vocab: int, model: str, tokenizer: str | None,
                flag: str = "tokenizer_name") -> None:
    """A tokenizer whose ids the model's embedding cannot all take is refused (ConfigError, one line)."""
    if tokenizer_vocab > model_vocab:
        raise ConfigError(f"{flag}: the tokenizer {tokenizer or ''} has {tokenizer_vocab} tokens (ids 0.."
                          f"{tokenizer_vocab - 1}); model {model}'s embedding has {model_vocab} rows: give a model "
                          f"with a vocab_size of at least {tokenizer_vocab}, or its own tokenizer")
