"""Config files into dataclasses: unknown keys rejected, types checked, one-line errors.

    cfg = load_yaml(path, FSDPConfig, flag="--fsdp_config")

Every error is a ConfigError naming the file, the key (dotted for nested sections) and what is
allowed. Value checks beyond types live in each dataclass's __post_init__, which raises
ConfigError naming the field; `from_dict` prefixes the file and section.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from pathlib import Path

import yaml

from gptlite.errors import ConfigError

# Mappings and lists within each other: the deepest file shipped here nests six levels
# (sweeps/models_quick.yaml); one nested deeper than this is refused as it is read. PyYAML's composer
# and hjson's decoder (DeepSpeed's parser) recurse once per level, and a file 100,000 levels deep
# ended in a RecursionError traceback.
MAX_NESTING = 32


def load_yaml(path: str | Path, cls, flag: str):
    """The dataclass `cls` built from the YAML mapping in `path`."""
    return from_dict(cls, read_yaml(path, flag), where=f"{flag} {path}")


class _TooDeep(yaml.YAMLError):
    def __init__(self, mark, cycle: bool = False):
        super().__init__()
        self.mark, self.cycle = mark, cycle


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping (PyYAML keeps the last,
    silently; DeepSpeed's JSON configs refuse duplicates too, backends/deepspeed_config.py), and a
    document nested more than MAX_NESTING levels deep: counted as it is composed, before the composer
    recurses that deep, and through aliases (an alias nests its anchor's node where it stands, and an
    alias inside its own anchor nests it for ever)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._heights: dict[int, int] = {}  # each composed node's levels of sequences and mappings

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            if id(node) not in self._heights:  # its anchor is still being composed: an ancestor
                raise _TooDeep(mark, cycle=True)
            if self._depth + self._heights[id(node)] > MAX_NESTING:
                raise _TooDeep(mark)
            return node
        container = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        if container and self._depth >= MAX_NESTING:
            raise _TooDeep(mark)
        self._depth += container
        node = super().compose_node(parent, index)
        self._depth -= container
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        self._heights[id(node)] = container + max((self._heights[id(c)] for c in children), default=0)
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key}'", key_node.start_mark)
            try:
                seen.add(key)
            except TypeError:  # an unhashable key: construct_mapping says so below
                pass
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path, flag: str) -> dict:
    """The mapping in YAML file `path`; an empty file is an empty mapping; a key given twice in a
    mapping is refused."""
    p = Path(path)
    if not os.path.isfile(p):  # never raises (a name too long for the filesystem is not found)
        raise ConfigError(f"{flag}: file not found: {path}")
    try:
        data = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except _TooDeep as e:
        raise too_deep(f"{flag} {path}", e.mark.line + 1, e.mark.column + 1, e.cycle) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{flag} {path}: not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path}: not UTF-8 text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} {path}: must be a mapping of keys to values (got {type(data).__name__})")
    return data


def too_deep(where: str, line: int, column: int, cycle: bool = False) -> ConfigError:
    """The one line refusing a file nested deeper than MAX_NESTING (or, through a YAML alias inside
    its own anchor, endlessly), naming the place it goes too deep."""
    what = "an alias inside its own anchor, nested endlessly," if cycle else "nested too deeply"
    return ConfigError(f"{where}: {what} at line {line}, column {column}: {NESTING_ALLOWED}")


NESTING_ALLOWED = f"mappings and lists may nest at most {MAX_NESTING} levels deep"


_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def check_json_nesting(text: str, where: str) -> None:
    """Refuse JSON `text` nested more than MAX_NESTING levels deep, before a parser recurses into it
    (brackets counted outside strings; DeepSpeed's hjson also has comments and unquoted strings,
    whose brackets may be counted: only a comment holding dozens of unclosed ones would be refused)."""
    depth = 0
    for token in _JSON_TOKENS.finditer(text):
        bracket = token.group()
        if bracket in "[{":
            depth += 1
            if depth > MAX_NESTING:
                line = text.count("\n", 0, token.start()) + 1
                raise too_deep(where, line, token.start() - text.rfind("\n", 0, token.start()))
        elif bracket in "]}":
            depth = max(depth - 1, 0)


def from_dict(cls, data, where: str, section: str = ""):
    """Build dataclass `cls` from mapping `data`, checking keys and value types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {section.rstrip('.') or 'the file'} must be a mapping of keys to values "
                          f"(got {type(data).__name__})")
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ConfigError(f"{where}: unknown key '{section}{unknown[0]}' (allowed: {', '.join(allowed)})")
    required = [f.name for f in dataclasses.fields(cls) if f.init and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise ConfigError(f"{where}: missing key '{section}{missing[0]}' (required: {', '.join(required)})")
    values = {}
    for name, value in data.items():
        values[name] = _convert(hints[name], value, where, f"{section}{name}")
    try:
        return cls(**values)
    except ConfigError as e:
        message = str(e)  # the section's name once, whether or not the dataclass's own check gave it
        raise ConfigError(f"{where}: {message if message.startswith(section) else section + message}") from None


def _convert(hint, value, where: str, key: str):
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{where}: {key} must not be empty (expected {_describe(options)})")
    for option in options:
        if dataclasses.is_dataclass(option):
            return from_dict(option, value, where, section=f"{key}.")
        if option is dict or typing.get_origin(option) is dict:
            if isinstance(value, dict):
                return value  # checked by the dataclass's __post_init__
            continue
        if typing.get_origin(option) is list:
            (item,) = typing.get_args(option)
            if isinstance(value, list):
                return [_convert(item, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
            continue
        if _is_instance(value, option):
            return float(value) if option is float else value
    raise ConfigError(f"{where}: {key} must be {_describe(options)} (got {value!r})")


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _is_instance(value, option) -> bool:
    if option is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if option is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(option, type) and isinstance(value, option)


def _describe(options) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             type(None): "null"}
    parts = []
    for option in options:
        if dataclasses.is_dataclass(option):
            parts.append("a mapping")
        elif typing.get_origin(option) is list:
            parts.append("a list")
        elif option is dict or typing.get_origin(option) is dict:
            parts.append("a mapping")
        else:
            parts.append(names.get(option, getattr(option, "__name__", str(option))))
    return " or ".join(parts)
