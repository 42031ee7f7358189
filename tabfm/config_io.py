"""The one typed loader of every config file (STYLE 9): run configs, model presets, plan configs, topology presets.

A config is a frozen dataclass with one docstring per field, a file is YAML, and `--set a.b=c` overrides go over
the file, the file over the defaults. `from_dict(cls, mapping)` builds the dataclass from its type hints:

    unknown keys      refused, listing the valid ones; a field without a default must be given
    values            checked against the hint (bool, int, float, str, tuples, dicts, X | None); a list becomes a
                      tuple (frozen configs stay hashable); YAML 1.1's `3e-4`, read as a string, is a float
    unions            of dataclasses are told apart by a tag, `type: Uniform` (a distribution of the prior, by
                      class name) or `kind: transformer` (a class's KIND), else by the one option whose fields hold
                      the most of the keys given
    presets           a dataclass with PRESETS = "model" has files configs/model/<name>.yaml: it may be written as
                      a preset name, a path to a .yaml file, or `{preset: name, key: value, ...}` to start from one

Every error is a ConfigError (a ValueError) of one line that names the key and where its value came from:

    unknown config key optim.lrr; valid keys of optim: lr, ... (in configs/pretrain/tiny.yaml)
    train.steps must be an integer, got 'ten' (from --set train.steps=ten)

This module imports nothing of tabfm (the one-device model reads its presets with it, and `tabfm --help` lists
presets without importing torch). Why not pydantic v2 or OmegaConf: validating stdlib dataclasses, pydantic ignores
unknown keys unless each class (data/ and parallel/ ones too) carries its config, coerces "10" and 1 to ints and
booleans, keeps lists inside `Any` as lists, and its errors are multi-line; OmegaConf's structured configs take no
unions of dataclasses (the prior's distributions) and read `${...}` in strings as interpolation. Both would add a
dependency and still need the tags, presets and one-line errors written here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

_PACKAGE = Path(__file__).resolve().parent
CONFIG_ROOT = _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"
"""configs/ of a source checkout, or the copy an installed wheel ships in tabfm/configs."""
TAG_KEYS = ("kind", "type")
"""Keys that name the option of a union of dataclasses: `kind` a class's KIND, `type` its class name."""

KeyPath = tuple[str | int, ...]


class ConfigError(ValueError):
    """A config that cannot be used: one line naming the key and the file (or --set) its value came from."""


def dotted(path: KeyPath) -> str:
    """('levels', 0, 'span') -> 'levels[0].span'."""
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


# ---------------------------------------------------------------------------------------------------------
# Where each value came from
# ---------------------------------------------------------------------------------------------------------

class Origins:
    """Where each key's value came from (a file, a preset file, a --set override), by key path; a key without an
    entry came with its section."""

    def __init__(self, root: str | None = None) -> None:
        self._by_path: dict[KeyPath, str] = {} if root is None else {(): root}

    def set(self, path: Sequence[str | int], origin: str) -> None:
        self._by_path[tuple(path)] = origin

    def of(self, path: KeyPath) -> str | None:
        """The origin of the key at `path`: its own entry, or its nearest section's."""
        for n in range(len(path), -1, -1):
            if path[:n] in self._by_path:
                return self._by_path[path[:n]]
        return None

    def blame(self, path: KeyPath, message: str) -> KeyPath:
        """The key a section's own check (its __post_init__) complains about: the longest key of the section that
        the message names, by its full dotted path or a tail of it ("table.max_rows" for data.table.max_rows),
        else the section itself."""
        named = [p for p in self._by_path if p[:len(path)] == path and len(p) > len(path) and _names(message, p)]
        return max(named, key=len) if named else path


def _names(message: str, path: KeyPath) -> bool:
    """Whether `message` names the key at `path` as a whole word: its dotted path or a tail of it."""
    tails = {dotted(path[k:]) for k in range(len(path)) if isinstance(path[k], str)}
    return any(re.search(rf"(?<![\w.]){re.escape(tail)}(?!\w)", message) for tail in tails)


# ---------------------------------------------------------------------------------------------------------
# Presets: configs/<kind>/<name>.yaml
# ---------------------------------------------------------------------------------------------------------

def shown(path: str | Path) -> str:
    """A path as errors show it: relative to the working directory when it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def preset_dir(kind: str) -> Path:
    """The folder of the `kind` presets (model, pretrain, plan, topology); TABFM_TOPOLOGY_DIR moves the topology
    presets (tests, and machines of one's own)."""
    if kind == "topology" and os.environ.get("TABFM_TOPOLOGY_DIR"):
        return Path(os.environ["TABFM_TOPOLOGY_DIR"])
    return CONFIG_ROOT / kind


def preset_names(kind: str) -> list[str]:
    """The preset names of `kind`, sorted."""
    folder = preset_dir(kind)
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def preset_path(kind: str, name: str | Path, also: Sequence[str] = ()) -> Path:
    """The file of preset `name`, or `name` itself when it is a path to a .yaml file; ConfigError listing the
    presets (and the other choices `also`) when it is neither."""
    path = Path(name)
    looks_like_a_path = path.suffix in (".yaml", ".yml") or len(path.parts) > 1
    if looks_like_a_path and path.is_file():
        return path
    if looks_like_a_path and path.is_dir():  # it exists: "does not exist" sent one looking for a typo
        raise ConfigError(f"{kind} config file {name} is a folder; give a .yaml file in it")
    if not looks_like_a_path and (preset_dir(kind) / f"{name}.yaml").is_file():
        return preset_dir(kind) / f"{name}.yaml"
    choices = ", ".join([*preset_names(kind), *also]) or "(none)"
    what = f"{kind} config file {name} does not exist" if looks_like_a_path else f"unknown {kind} preset {str(name)!r}"
    raise ConfigError(f"{what}; presets: {choices}, or a path to a .yaml file")


# ---------------------------------------------------------------------------------------------------------
# Files and --set overrides
# ---------------------------------------------------------------------------------------------------------

class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (safe_load keeps the last without a word:
    `steps: 2` then `steps: 3` trained 3 steps)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged by SafeLoader below, where the
                continue                                   # mapping's own keys override the anchor's
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool):  # odd keys: left to the config's own checks
                continue
            if key in seen:
                raise _DuplicateKey(f"key {key!r} appears twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML file holds; ConfigError, one line, when it can't be read or holds nothing."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give a .yaml file in it")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: {e}; give each key once") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path} is not valid YAML: {getattr(e, 'problem', None) or e}{where}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    except RecursionError:  # a config nested thousands deep: no config is
        raise ConfigError(f"{path} is nested too deeply to be a config") from None
    if raw is None:  # an empty file (or only comments): most likely the wrong file, or one saved half-written
        raise ConfigError(f"{path} is empty: write its keys in it, or leave the file out to use the defaults")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of keys to values, got a {type(raw).__name__}")
    return raw


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=c' -> (['a', 'b'], c parsed as YAML: numbers, booleans, lists, mappings)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part.strip() for part in key.strip().split(".")):
        raise ConfigError(f"--set {text!r}: write it as section.key=value, e.g. optim.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML ({getattr(e, 'problem', None) or e})") from None
    return key.strip().split("."), value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str], cls: type | None = None,
                    origins: Origins | None = None) -> dict[str, Any]:
    """`raw` with every `a.b=c` override set (sections created as needed; `raw` itself is not changed). With the
    config class `cls`, a preset name met on the way (`model: tiny`, then model.embed_dim=64) becomes a preset
    section to refine; `origins` records each override as the origin of its key."""
    raw = dict(raw)
    given: dict[tuple[str, ...], str] = {}
    for text in overrides:
        keys, value = parse_override(text)
        if (first := given.get(tuple(keys))) is not None:  # the later won without a word; a YAML file refuses it
            raise ConfigError(f"--set {'.'.join(keys)} is given twice ({first!r}, then {text!r}); give it once")
        given[tuple(keys)] = text
        node, tp = raw, cls
        for depth, key in enumerate(keys[:-1]):
            tp = _field_type(tp, key) if tp is not None else None
            child = node.get(key)
            if child is None and key in node:  # `train:` with every key commented out: refused as without --set
                raise ConfigError(f"{'.'.join(keys[:depth + 1])} is empty in the config file (null, every key "
                                  "commented out?): give it keys, or remove the line to take its defaults")
            if isinstance(child, str) and _preset_class(tp) is not None:
                child = {"preset": child}
            if (child is not None and not isinstance(child, dict)) or (tp is not None and not _is_section(tp)):
                raise ConfigError(f"--set {text!r}: {'.'.join(keys[:depth + 1])} is a value, not a section")
            if child is None:
                child = {}
            node[key] = child = dict(child)
            node = child
        node[keys[-1]] = value
        if origins is not None:
            origins.set(keys, f"from --set {text}")
    return raw


def load(cls: type, path: str | Path | None = None, overrides: Sequence[str] = ()) -> Any:
    """Config `cls`: its defaults, then the YAML file (if any), then the `a.b=c` overrides."""
    origins = Origins()
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
        origins.set((), f"in {shown(path)}")
    return _Builder(origins).build(cls, apply_overrides(raw, overrides, cls, origins), ())


def load_preset(cls: type, name_or_path: str | Path, also: Sequence[str] = ()) -> Any:
    """Config `cls` from its preset `name_or_path` (cls.PRESETS names the folder) or from a .yaml path."""
    path = preset_path(cls.PRESETS, name_or_path, also)
    return _Builder(Origins(f"in {shown(path)}")).build(cls, read_yaml(path), ())


def from_dict(cls: type, data: Mapping[str, Any], where: str = "", origin: str | None = None) -> Any:
    """Dataclass `cls` from a (partial) mapping, missing fields keeping their defaults; ConfigError naming the key
    (prefixed with `where`, e.g. "model") and the `origin` of the data ("in run.yaml") on anything wrong."""
    path: KeyPath = tuple(where.split(".")) if where else ()
    return _Builder(Origins(origin)).build(cls, data, path)


# ---------------------------------------------------------------------------------------------------------
# Type hints
# ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _union_args(tp: Any) -> tuple | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _field_type(tp: Any, key: str) -> Any:
    """The hint of field `key` of dataclass `tp` (of the option of a union that has it); None when unknown."""
    for option in _union_args(tp) or (tp,):
        if dataclasses.is_dataclass(option) and key in _field_names(option):
            return _hints(option)[key]
    return None


def _is_section(tp: Any) -> bool:
    """Whether a value of hint `tp` may be a mapping (a dataclass, a dict, or a union holding one)."""
    return any(dataclasses.is_dataclass(o) or o is dict or typing.get_origin(o) is dict or o is Any
               for o in _union_args(tp) or (tp,))


def _preset_class(tp: Any) -> type | None:
    """The class with presets that `tp` (a dataclass, or a union holding one) may be written as a preset of."""
    found = [o for o in _union_args(tp) or (tp,) if dataclasses.is_dataclass(o) and getattr(o, "PRESETS", None)]
    return found[0] if len(found) == 1 else None


def tag_of(cls: type) -> tuple[str, str]:
    """(key, value) naming `cls` among the options of a union: ('kind', cls.KIND), or ('type', class name)."""
    return ("kind", cls.KIND) if hasattr(cls, "KIND") else ("type", cls.__name__)


def _is_dataclass_union(tp: Any) -> bool:
    return sum(dataclasses.is_dataclass(o) for o in _union_args(tp) or ()) > 1


def to_dict(obj: Any, tp: Any = None) -> Any:
    """A config as plain YAML/JSON-able data that from_dict reads back; an option of a union of dataclasses (hint
    `tp`) carries its tag (`type: Uniform`)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        hints = _hints(type(obj))
        out = {f.name: to_dict(getattr(obj, f.name), hints.get(f.name)) for f in dataclasses.fields(obj)}
        if _is_dataclass_union(tp):
            key, value = tag_of(type(obj))
            out = {key: value, **out}
        return out
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------------------------------------
# Building a dataclass from a mapping, by its type hints
# ---------------------------------------------------------------------------------------------------------

class _Builder:
    """One build: the origins of the data, and the error that names a key's path and origin."""

    def __init__(self, origins: Origins) -> None:
        self.origins = origins

    def fail(self, path: KeyPath, message: str) -> ConfigError:
        origin = self.origins.of(path)
        message = " ".join(message.split())  # one line
        return ConfigError(f"{message} ({origin})" if origin else message)

    def build(self, cls: type, data: Any, path: KeyPath) -> Any:
        """Dataclass `cls` from `data` (a mapping, or a preset name when cls has presets) at key `path`."""
        data = self._expand_preset(cls, data, path)
        if not isinstance(data, Mapping):
            raise self.fail(path, f"{dotted(path) or 'the config'} must be a mapping of {cls.__name__} fields, "
                                  f"got {data!r}")
        names = _field_names(cls)
        unknown = [k for k in data if k not in names]
        if unknown:
            prefix = f"{dotted(path)}." if path else ""
            raise self.fail(path + (unknown[0],),
                            f"unknown config key{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(prefix + str(k) for k in unknown)}; valid keys"
                            f"{' of ' + dotted(path) if path else ''}: {', '.join(names)}")
        missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            keys = ", ".join(dotted(path + (k,)) for k in missing)
            raise self.fail(path, f"missing config key{'s' if len(missing) > 1 else ''} {keys}")
        hints = _hints(cls)
        kwargs = {k: self.convert(v, hints[k], path + (k,)) for k, v in data.items()}
        try:
            return cls(**kwargs)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise self.fail(self.origins.blame(path, str(e)), str(e)) from None

    def _expand_preset(self, cls: type, data: Any, path: KeyPath) -> Any:
        """`name` or {preset: name, ...} of a class with presets as the preset's mapping with the rest over it;
        the preset's own keys have its file as their origin."""
        kind = getattr(cls, "PRESETS", None)
        if kind is None:
            return data
        if isinstance(data, str | Path):
            data = {"preset": data}
        if not isinstance(data, Mapping) or "preset" not in data:
            return data
        try:
            file = preset_path(kind, data["preset"])
        except ConfigError as e:
            raise self.fail(path + ("preset",), str(e)) from None
        preset = read_yaml(file)
        rest = {k: v for k, v in data.items() if k != "preset"}
        for key in preset:
            if key not in rest:
                self.origins.set(path + (key,), f"in {shown(file)}")
        return {**preset, **rest}

    def convert(self, value: Any, tp: Any, path: KeyPath) -> Any:
        """`value` (from YAML) as type `tp`."""
        where = dotted(path)
        if tp is Any:  # lists become tuples, as in the defaults (frozen configs stay hashable)
            return tuple(self.convert(v, Any, path) for v in value) if isinstance(value, list) else value
        options = _union_args(tp)
        if options is not None:
            return self._union(value, options, path)
        if dataclasses.is_dataclass(tp):
            return self.build(tp, value, path)
        origin = typing.get_origin(tp)
        if origin is dict or tp is dict:
            if not isinstance(value, Mapping):
                raise self.fail(path, f"{where} must be a mapping, got {value!r}")
            kt, vt = typing.get_args(tp) or (Any, Any)
            return {self.convert(k, kt, path): self.convert(v, vt, path + (str(k),)) for k, v in value.items()}
        if origin in (tuple, list) or tp in (tuple, list):
            return self._sequence(value, tp, path)
        return self._scalar(value, tp, path)

    def _union(self, value: Any, options: tuple, path: KeyPath) -> Any:
        if value is None and type(None) in options:
            return None
        options = tuple(a for a in options if a is not type(None))
        classes = [a for a in options if dataclasses.is_dataclass(a)]
        if classes and (isinstance(value, Mapping) or _preset_class(typing.Union[tuple(classes)]) is not None):
            return self._dataclass_option(value, classes, path)
        for option in options:
            try:
                return self.convert(value, option, path)
            except ConfigError:
                continue
        names = [getattr(a, "__name__", str(a)) for a in options]
        raise self.fail(path, f"{dotted(path)}: {value!r} is not any of {names}")

    def _dataclass_option(self, value: Any, classes: list[type], path: KeyPath) -> Any:
        """The option of a union of dataclasses that `value` is: by its tag, as a preset name, or by the one
        option whose fields hold the most of its keys."""
        tags = {tag_of(c)[1].lower(): c for c in classes}
        if isinstance(value, Mapping):
            for key in TAG_KEYS:
                if key in value:
                    if str(value[key]).lower() not in tags:
                        raise self.fail(path + (key,), f"{dotted(path + (key,))}={value[key]!r}; use one of "
                                                       f"{', '.join(tag_of(c)[1] for c in classes)}")
                    rest = {k: v for k, v in value.items() if k != key}
                    return self.build(tags[str(value[key]).lower()], rest, path)
            fit = {c: len(set(value) & {*_field_names(c), *(["preset"] if getattr(c, "PRESETS", None) else [])})
                   for c in classes}
            best = [c for c in classes if fit[c] == max(fit.values())]
            if len(best) == 1:
                return self.build(best[0], value, path)
            key, _ = tag_of(best[0])
            raise self.fail(path, f"{dotted(path) or 'the config'}: give {key} as one of "
                                  f"{', '.join(tag_of(c)[1] for c in best)}, got {value!r}")
        return self.build(_preset_class(typing.Union[tuple(classes)]), value, path)

    def _sequence(self, value: Any, tp: Any, path: KeyPath) -> Any:
        where, origin, targs = dotted(path), typing.get_origin(tp) or tp, typing.get_args(tp)
        homogeneous = origin is tuple and len(targs) == 2 and targs[1] is Ellipsis
        if homogeneous and not isinstance(value, list | tuple | Mapping):
            value = [value]  # one item for a list of them: `chunks: 4`
        if not isinstance(value, list | tuple):
            raise self.fail(path, f"{where} must be a list, got {value!r}")
        if homogeneous:
            items = [self.convert(v, targs[0], path + (i,)) for i, v in enumerate(value)]
        elif origin is tuple and targs:
            if len(targs) != len(value):
                raise self.fail(path, f"{where} needs {len(targs)} items, got {value!r}")
            items = [self.convert(v, t, path + (i,)) for i, (v, t) in enumerate(zip(value, targs, strict=True))]
        else:
            items = list(value)
        return tuple(items) if origin is tuple else items

    def _scalar(self, value: Any, tp: Any, path: KeyPath) -> Any:
        where = dotted(path)
        if tp is bool:
            if not isinstance(value, bool):
                raise self.fail(path, f"{where} must be true or false, got {value!r}")
        elif tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.fail(path, f"{where} must be an integer, got {value!r}")
        elif tp is float:
            if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
                try:
                    value = float(value)
                except ValueError:
                    pass
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise self.fail(path, f"{where} must be a number, got {value!r}")
            return float(value)
        elif tp is str:
            if not isinstance(value, str):
                raise self.fail(path, f"{where} must be a string, got {value!r}")
        return value
