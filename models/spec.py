"""Naming a model: `--model` and `--model_args`, checked without importing any model library."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gptlite.errors import ConfigError

KINDS = ("gptlite", "hf", "pretrained", "torchvision", "file", "module")
# --model's value when --model_name_or_path names a transformers checkpoint (core/config.py sets it).
PRETRAINED = "pretrained"
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def kind_of(name: str) -> str:
    """Which kind of model `name` is: gptlite, hf, torchvision, file (a .py path) or module."""
    if name in ("gptlite", PRETRAINED):
        return name
    for prefix in ("hf", "torchvision"):
        if name.startswith(prefix + ":"):
            return prefix
    if name.endswith(".py"):
        return "file"
    return "module"


def check_name(name: str) -> None:
    """Refuse a --model value that cannot name a model (one line, ConfigError)."""
    kind = kind_of(name)
    if kind in ("hf", "torchvision") and not re.fullmatch(r"[A-Za-z0-9_\-.]+", name.split(":", 1)[1]):
        raise ConfigError(f"model: {name!r} needs a model type after '{kind}:' (e.g. hf:gpt2, hf:llama, hf:resnet)")
    if kind == "module" and not _MODULE_NAME.match(name):
        raise ConfigError(f"model must be gptlite, hf:<model_type>, torchvision:<name>, a .py file or an importable "
                          f"module name (got {name!r})")


def model_label(name: str) -> str:
    """A short name for run names and tables: gptlite, hf_gpt2, torchvision_resnet18, my_model."""
    kind = kind_of(name)
    if kind in ("hf", "torchvision"):
        return name.replace(":", "_")
    if kind == "file":
        return Path(name).stem
    return name.rsplit(".", 1)[-1] if kind == "module" else name


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    if depth or quote:
        raise ConfigError(f"model_args: unbalanced brackets or quotes in {text!r}")
    return [p.strip() for p in parts]


def parse_model_args(text: str | None) -> dict:
    """`--model_args n_layer=4,n_embd=128,depths=[2,2,2,2]` as a dict (values read as YAML)."""
    if not text:
        return {}
    args = {}
    for part in _split_top_level(text):
        if not part:
            raise ConfigError(f"model_args: an empty item between commas in {text!r}; write key=value pairs "
                              "separated by single commas")
        key, sep, value = part.partition("=")
        key = key.strip()
        if sep and not value.strip():
            raise ConfigError(f"model_args: {key} has no value (got {part!r})")
        if not sep or not key.isidentifier():
            raise ConfigError(f"model_args: expected key=value pairs separated by commas, e.g. n_layer=4,n_embd=128 "
                              f"(got {part!r})")
        if key in args:
            raise ConfigError(f"model_args: {key} given twice")
        try:
            args[key] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"model_args: {key}: cannot read the value {value!r}") from None
        except RecursionError:  # PyYAML's composer recurses once per level of [ and {
            raise ConfigError(f"model_args: {key}: the value is nested too deeply to read ({len(value)} characters); "
                              "a model setting is a number, a string, or a short list or mapping") from None
    return args


# Text data files by extension, read by datasets' builder of that name (as transformers' run_clm.py does):
# .txt one row per line, .json/.jsonl JSON Lines (or a JSON array), .parquet and .csv columns.
TEXT_FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
                      ".csv": "csv"}


def text_file_builder(flag: str, path: str) -> str:
    """The `datasets` builder that reads `path` (by its extension), or ConfigError naming those allowed."""
    suffix = Path(path).suffix.lower()
    if suffix not in TEXT_FILE_BUILDERS:
        got = f"extension {suffix}" if suffix else "no extension"
        raise ConfigError(f"{flag}: {path} has {got}; the data files read are .txt (a row per line), .json or "
                          ".jsonl (JSON Lines), .parquet and .csv")
    return TEXT_FILE_BUILDERS[suffix]


@dataclass(frozen=True)
class TextRequest:
    """Tokenized text for a language model (models/text_data.py): run_clm.py's data flags."""

    tokenizer: str | None = None  # --tokenizer_name, else the checkpoint of --model_name_or_path
    dataset_name: str | None = None
    dataset_config_name: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    text_column_name: str | None = None  # None: "text"
    validation_split_percentage: int = 5  # of the training rows, when there is no validation file
    pad: bool = False  # one row per sample, padded (labels -100), instead of packed
    overwrite_cache: bool = False
    quiet: bool = False  # no progress bars
    tokenizer_flag: str = "tokenizer_name"  # the flag that named the tokenizer, for messages


@dataclass(frozen=True)
class ModelRequest:
    """What train.py's flags say about the model and its data (core/config.py builds it)."""

    name: str = "gptlite"
    args: dict = field(default_factory=dict)
    data: str | None = None  # --data: a text file, an image directory (CIFAR-10), or None
    checkpoint: str | None = None  # --model_name_or_path: a transformers checkpoint (kind pretrained)
    seq_len: int = 256  # tokens per sample for text models (--block_size, or the preset's)
    block_size_given: bool = False  # --block_size given: a model without tokens cannot take it
    dropout: float | None = None  # --dropout: every dropout probability of an HF config
    # GPT-lite's config for a vocabulary size (the preset with its overrides): gptlite only.
    gptlite_config: Callable | None = None
    trust_data: bool = False  # --trust_data: --data may be read from pickles (CIFAR-10's python version)
    text: TextRequest | None = None  # --train_file / --dataset_name: tokenized text instead of --data

    @property
    def kind(self) -> str:
        return kind_of(self.name)


def format_model_args(args: dict) -> str:
    """`args` as --model_args writes them (parse_model_args reads them back): k=v,... with each value
    plain where YAML reads it back as the same string, else as JSON."""
    def value(v) -> str:
        plain = isinstance(v, str) and v.isidentifier() and yaml.safe_load(v) == v
        return v if plain else json.dumps(v, separators=(",", ":"))

    return ",".join(f"{k}={value(v)}" for k, v in args.items())
