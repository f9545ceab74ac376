"""YAML input → typed dataclasses, with errors that name the file, key and line.

YAML is only an input format: ``yaml.safe_load`` semantics (composed via the safe
loader so every key keeps its line), unknown keys rejected, values type-checked.
"""

from __future__ import annotations

import dataclasses
import math
import re
import stat
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

from aegis_cli.ops.errors import ConfigError

_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq")}
MAX_INPUT_BYTES = 64 << 20  # configs, catalogs and golden files are kilobytes
# values built beyond the file's own nodes, through aliases: an alias bomb (each level's list
# holding the previous level several times) is billions after 9 levels, from a few hundred bytes
MAX_ALIAS_EXPANSION = 100_000
# the largest number a float option takes: every one is a duration (1e9 s is 31 years); past it
# deadlines and timeouts overflow (a timedelta ends at 1e9 days)
MAX_FLOAT = 1e9
# YAML 1.2 floats that YAML 1.1 (PyYAML) reads as strings: 1e300, 1E-3, +2e5 (no dot, or no exponent sign)
_YAML12_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def read_input_text(path: str | Path, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of an input file named on the command line or in a config. Refuses what
    would hang or exhaust memory instead of reading it: FIFOs and devices (/dev/zero never
    ends), directories, files over ``max_bytes``. ConfigError names the file and the problem."""
    p = Path(path)
    try:
        st = p.stat()
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{p}: is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{p}: is not a regular file")
        if st.st_size > max_bytes:
            raise ConfigError(f"{p}: {st.st_size} bytes, over the limit of {max_bytes}")
        with open(p, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read ({exc})") from None
    if len(data) > max_bytes:
        raise ConfigError(f"{p}: grew past the limit of {max_bytes} bytes while being read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: cannot read ({exc})") from None


class Located(dict):
    """A mapping that remembers the line of each key (1-based)."""

    lines: dict[str, int]
    line: int


def _size(root: yaml.Node) -> int:
    """Nodes in the composed document, each counted once however many aliases point at it."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            stack += [n for kv in node.value for n in kv]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
    return len(seen)


def _construct(node: yaml.Node, budget: list[int]) -> Any:
    """The value of ``node``; ``budget`` ([nodes left]) bounds what aliases expand to."""
    budget[0] -= 1
    if budget[0] < 0:
        raise ConfigError(f"line {node.start_mark.line + 1}: malformed YAML: aliases expand to over "
                          f"{MAX_ALIAS_EXPANSION} values more than the file holds (an alias bomb?)")
    if node.tag not in _PLAIN_TAGS:  # no python/object, binary or custom tags, ever
        raise ConfigError(f"line {node.start_mark.line + 1}: malformed YAML: unsupported tag {node.tag!r}")
    if isinstance(node, yaml.MappingNode):
        out = Located()
        out.lines, out.line = {}, node.start_mark.line + 1
        for k, v in node.value:
            key = _construct(k, budget)
            if not isinstance(key, str):
                raise ConfigError(f"line {k.start_mark.line + 1}: keys must be strings, got {key!r}")
            if key in out:
                raise ConfigError(f"line {k.start_mark.line + 1}: duplicate key {key!r}")
            out[key] = _construct(v, budget)
            out.lines[key] = k.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, budget) for v in node.value]
    # the safe constructor of the node itself: a re-serialised empty scalar (``key:`` with no
    # value, which YAML reads as null) did not parse back
    return SafeConstructor().construct_object(node, deep=True)


def load_yaml(path: Path) -> Any:
    """Parse a YAML file safely; ConfigError names the file and line on any problem."""
    text = read_input_text(path)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise ConfigError(f"{path}: malformed YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}:{where}: malformed YAML: {problem}") from None
    if node is None:
        raise ConfigError(f"{path}: empty file")
    try:
        return _construct(node, [_size(node) + MAX_ALIAS_EXPANSION])
    except RecursionError:
        raise ConfigError(f"{path}: malformed YAML: nested too deeply") from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML: {str(exc).splitlines()[0]}") from None


def yaml_type(value: Any) -> str:
    """What a parsed YAML value is, in YAML's words (not our Located class)."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """A value for an error message: scalars as written, containers by their kind."""
    return yaml_type(value) if value is None or isinstance(value, (dict, list)) else repr(value)


def _where(src: str, data: Any, key: str | None = None) -> str:
    if isinstance(data, Located):
        line = data.lines.get(key, data.line) if key else data.line
        return f"{src}: line {line}"
    return src


def _coerce(value: Any, tp: Any, src: str, parent: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _coerce(value, tp, src, parent, key)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, src)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{_where(src, parent, key)}: {key} must be a list, got {yaml_type(value)}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, src, parent, key) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is float:
        if isinstance(value, str) and _YAML12_FLOAT.fullmatch(value.strip()):
            value = float(value)  # a number to YAML 1.2 and to every reader, a string only to YAML 1.1
        elif isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, float):
            if math.isfinite(value) and abs(value) > MAX_FLOAT:
                raise ConfigError(f"{_where(src, parent, key)}: {key} must be a finite number of at most {MAX_FLOAT:g}, "
                                  f"got {value:g}")
            return value
    if tp in (int, float, str, bool) and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{_where(src, parent, key)}: {key} must be {tp.__name__}, got {_shown(value)}")
    return value


def from_dict(cls: type, data: Any, src: str) -> Any:
    """Build dataclass ``cls`` from a mapping; unknown or missing keys raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{_where(src, data)}: expected a mapping for {cls.__name__}, got {yaml_type(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise ConfigError(f"{_where(src, data, key)}: unknown key {key!r} (allowed: {', '.join(fields)})")
    kwargs = {k: _coerce(v, hints[k], src, data, k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a value __post_init__ could not take (a bad format string, say)
        raise ConfigError(f"{_where(src, data)}: invalid value: {exc}") from None
    except TypeError as exc:
        missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        raise ConfigError(f"{_where(src, data)}: missing key(s) {', '.join(missing) or '?'} for {cls.__name__}") from exc
    except ConfigError as exc:
        raise ConfigError(f"{_where(src, data)}: {exc}") from None
