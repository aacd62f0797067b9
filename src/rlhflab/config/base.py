"""A small typed-config engine: dataclasses + YAML + dotted ``key=value`` overrides.

Every field is declared with :func:`setting`, which carries its documentation and its
constraints, so that validation, ``--help`` text and error messages all come from one place.
Errors always name the full dotted field (``ppo.clip_low``), never a bare traceback.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rlhflab.errors import RlhflabError

_YAML11_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


class ConfigError(RlhflabError, ValueError):
    """An invalid configuration; the message names the offending field."""


def setting(
    default: Any,
    doc: str,
    *,
    choices: tuple | None = None,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    hint: str | None = None,
) -> Any:
    """Declare a config field with its documentation and constraints.

    ``choices``: allowed values. ``low``/``high``: inclusive bounds (``low_open`` makes the
    lower bound strict, e.g. a learning rate must be > 0). ``hint``: what a value out of
    bounds may have meant, added to its error (temperature 0: greedy decoding).
    """
    meta = {"doc": doc, "choices": choices, "low": low, "high": high, "low_open": low_open}
    meta["hint"] = hint
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, doc: str) -> Any:
    """Declare a nested config section."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc, "section": True})


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check ``value`` against the annotation ``tp``; only lossless conversions (int → float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{name}: expected {_type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        key_t, val_t = typing.get_args(tp) or (Any, Any)
        return {_coerce(k, key_t, name): _coerce(v, val_t, f"{name}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _YAML11_FLOAT.match(value.strip()):
        return float(value)  # YAML 1.1 reads "3e-4" (no dot) as a string: it is a number
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if tp is str and isinstance(value, (int, float)):  # YAML's yes/no/on/off: booleans
        what = "true/false (yes, no, on, off)" if isinstance(value, bool) else "a number"
        raise ConfigError(
            f"{name}: expected str, got {value!r} (YAML reads it as {what}; quote it)"
        )
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{name}: expected {_type_name(tp)}, got {value!r}")
    return value


def _check_finite(value: Any, name: str) -> None:
    """Reject NaN and ±inf in any float setting, in lists and mappings too.

    NaN passes every bound (all comparisons with it are false) and an infinite learning rate
    or coefficient only shows up as a halted run later. No setting takes infinity to mean
    "never" or "off": that is null (None) wherever a field allows it.
    """
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}: must be a finite number, got {value!r}")
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{name}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{name}.{k}")


def _check_bounds(value: Any, meta: dict, name: str) -> None:
    if value is None:
        return
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(f"{name}: {value!r} is not one of {list(meta['choices'])}")
    low, high = meta.get("low"), meta.get("high")
    hint = f" ({meta['hint']})" if meta.get("hint") else ""
    if low is not None and (value < low or (meta.get("low_open") and value == low)):
        rel = ">" if meta.get("low_open") else ">="
        raise ConfigError(f"{name}: must be {rel} {low}, got {value!r}{hint}")
    if high is not None and value > high:
        raise ConfigError(f"{name}: must be <= {high}, got {value!r}{hint}")


def build(cls: type, data: dict | None, prefix: str = "") -> Any:
    """Build the dataclass ``cls`` from a nested mapping, rejecting unknown keys."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}; known keys here: {sorted(fields)}"
        )
    kwargs = {}
    for key, value in data.items():
        name = prefix + key
        if fields[key].metadata.get("section"):
            kwargs[key] = build(hints[key], value, name + ".")
        else:
            kwargs[key] = _coerce(value, hints[key], name)
            _check_finite(kwargs[key], name)
    obj = cls(**kwargs)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("section"):
            _check_bounds(getattr(obj, f.name), f.metadata, prefix + f.name)
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a", "b", "c"], value parsed as YAML: 3, 0.1, true, null, [1, 2])."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    if not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"override {text!r}: no setting named before '='; write key.sub=value")
    if not raw.strip():
        return key.strip().split("."), ""
    try:
        return key.strip().split("."), load_yaml_text(raw)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"override {text!r}: the value is not valid YAML ({problem}); quote the whole "
            "override for the shell, e.g. 'rm.heads={preference: 1.0}'"
        ) from None


def merge_overrides(data: dict, overrides: list[str] | dict | None) -> dict:
    """Apply dotted overrides: ``["ppo.lr=1e-5"]`` (values parsed as YAML, as on the command
    line) or ``{"ppo.lr": 1e-5}`` (values as they are, from Python)."""
    if isinstance(overrides, dict):
        items = [
            (str(key).split("."), value, f"{key}={value!r}") for key, value in overrides.items()
        ]
    else:
        items = [(*parse_override(text), text) for text in overrides or []]
    for path, value, text in items:
        node = data
        for depth, part in enumerate(path[:-1]):
            if node.get(part) is None:  # absent, or a YAML section left empty ("ppo:")
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):  # the file (or an earlier override) set it so
                raise ConfigError(
                    f"{'.'.join(path[: depth + 1])}: expected a mapping of settings, got "
                    f"{type(node).__name__} "
                    f"{node!r} (so override {text!r} has no section to go into)"
                )
        node[path[-1]] = value
    return data


def load(
    cls: type,
    path: str | Path | None = None,
    overrides: list[str] | dict | None = None,
    base: dict | None = None,
    base_file: str | Path | None = None,
) -> Any:
    """Load ``cls`` from a YAML file (optional) on top of ``base``, then apply overrides.
    An error about a value the file set names the file; one about a value ``base`` set
    names ``base_file`` where given (a run's recorded config.yaml), with how to replace it."""
    data: dict = _deep_copy(base or {})
    loaded: dict = {}
    if path is not None:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            raise ConfigError(
                f"{path}:{line}: not valid UTF-8 (byte 0x{raw[exc.start]:02x}); "
                "save the file as UTF-8"
            ) from None
        try:
            loaded = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        except _RepeatedSetting as exc:
            raise ConfigError(
                f"{path}:{exc.args[1]}: {exc.args[0]!r} is set twice in one section; keep one"
            ) from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}{_yaml_problem(exc)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = _deep_merge(data, loaded)
    data = merge_overrides(data, overrides)
    try:
        return build(cls, data)
    except ConfigError as exc:  # a value the file set: the file named, as for its syntax
        field = field_of(str(exc))
        if path is not None and set_in(field, loaded, overrides):
            raise ConfigError(f"{path}: {exc}") from None
        if base_file is not None and set_in(field, base or {}, overrides):
            unknown = str(exc).startswith("unknown config key")
            fix = "remove it from that file" if unknown else f"give another with {field}=..."
            raise ConfigError(f"{base_file}: {exc} (the run's recorded setting: {fix})") from None
        raise


def field_of(message: str) -> str:
    """The dotted setting a build error names: before its first ':', or the unknown key."""
    unknown = "unknown config key "
    if message.startswith(unknown):
        return message[len(unknown) :].split(";", 1)[0]
    return message.split(":", 1)[0]


def set_in(field: str, loaded: dict, overrides) -> bool:
    """Whether dotted ``field`` is set in the file's ``loaded`` and no override replaced it."""
    node, path = loaded, []
    for part in field.split("."):
        if not isinstance(node, dict) or part not in node:  # past section.field: a key
            if len(path) < 2:  # of a mapping-valued setting ("reward.functions.mod:fn")
                return False
            break
        node, path = node[part], [*path, part]
    given = overrides.keys() if isinstance(overrides, dict) else overrides or ()
    named = {field, ".".join(path)}
    return not any(str(o).split("=", 1)[0].strip() in named for o in given)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """``:LINE:COLUMN: not valid YAML (what)`` on one line, where PyYAML says it in
    several (naming "<unicode string>" for the file)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    what = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc)
    context, opened = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and opened is not None and opened is not mark:  # e.g. a bracket never closed
        what = f"{what}; {context} from {opened.line + 1}:{opened.column + 1}"
    where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    what = str(what).split(' in "<unicode string>"')[0]  # PyYAML's name for the text
    return f"{where}: not valid YAML ({' '.join(what.split())})"


class _RepeatedSetting(Exception):
    """(key, line): a mapping of a config file that sets one key twice."""


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# YAML 1.2's numbers, not PyYAML's YAML 1.1 ones: there `seed: 010` is octal (8), `1:30`
# sexagesimal (90) and `0x10` hex (16) — numbers a config did not mean, taken silently —
# while `1e-5` (no dot) is a string. Here an integer is decimal (leading zeros too, `_`
# between digits allowed) and `1e-5` is a float; anything else stays a string, which a
# numeric field then refuses by name.
_DECIMAL_INT = re.compile(r"^[-+]?[0-9](_?[0-9])*$")
_DECIMAL_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9](?:_?[0-9])*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


class ConfigYamlLoader(yaml.SafeLoader):
    """yaml.safe_load's loader with YAML 1.2's decimal numbers (above), for config files
    and ``key=value`` overrides."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_decimal_int(self, node) -> int:
        return int(self.construct_scalar(node).replace("_", ""), 10)


ConfigYamlLoader.add_implicit_resolver(_INT_TAG, _DECIMAL_INT, list("-+0123456789"))
ConfigYamlLoader.add_implicit_resolver(_FLOAT_TAG, _DECIMAL_FLOAT, list("-+0123456789."))
ConfigYamlLoader.add_constructor(_INT_TAG, ConfigYamlLoader.construct_decimal_int)


def load_yaml_text(text: str) -> Any:
    """A YAML value as config files and overrides read it (:class:`ConfigYamlLoader`)."""
    return yaml.load(text, Loader=ConfigYamlLoader)


class ConfigYamlDumper(yaml.SafeDumper):
    """yaml.safe_dump's dumper, quoting a string that either reader (PyYAML's YAML 1.1 or
    :class:`ConfigYamlLoader`) would take for a number: a run's config.yaml or a sweep's
    best.yaml holding the string '1e5' reads back as that string."""

    yaml_implicit_resolvers = {
        first: list(resolvers)
        for first, resolvers in yaml.SafeDumper.yaml_implicit_resolvers.items()
    }


ConfigYamlDumper.add_implicit_resolver(_INT_TAG, _DECIMAL_INT, list("-+0123456789"))
ConfigYamlDumper.add_implicit_resolver(_FLOAT_TAG, _DECIMAL_FLOAT, list("-+0123456789."))


def dump_yaml_text(data: Any) -> str:
    """``data`` as YAML that :func:`load_yaml_text` reads back as it is (key order kept)."""
    return yaml.dump(data, Dumper=ConfigYamlDumper, sort_keys=False, allow_unicode=True)


class _UniqueKeyLoader(ConfigYamlLoader):
    """The config loader, except that a key given twice in one mapping is an error:
    PyYAML keeps the last silently, so `lr: 1e-5` above `lr: -5` trained with −5."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:  # the mapping's own keys ("<<" merges may be overridden)
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue
            if key_node.value in seen:
                raise _RepeatedSetting(key_node.value, key_node.start_mark.line + 1)
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def _deep_copy(d: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def _deep_merge(a: dict, b: dict) -> dict:
    out = _deep_copy(a)
    for k, v in b.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per field: dotted name, default, documentation (for ``rlhflab config``)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if f.metadata.get("section"):
            lines.append(f"[{name}] {f.metadata['doc']}")
            lines.extend(describe(hints[f.name], name + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {name} = {default!r}: {f.metadata.get('doc', '')}")
    return lines
