"""How a config key is declared: `Key` (its type, default, allowed values or range, one line of
documentation) and `Group`, with what follows from a declaration alone: a value coerced to the key's
type, and the key's own check. The declarations are config/keys_model.py and config/keys_run.py;
config/declared.py assembles them into the whole config and reads everything else from it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Mapping

import ml_collections

from maxtext_rocm.errors import ConfigError

@dataclasses.dataclass(frozen=True)
class Key:
    """One config key. `kind` is the default's type unless given (a key whose default is None
    names it). Bounds: `at_least`/`above` and `at_most`/`below` (floats must also be finite).
    `choices`: the values it may take (for a tuple, the values its items may take). `valid`: the
    phrase naming what is valid where the bounds alone do not say it (-1 to fill, 0 for off...).
    `nullable`: None is also accepted. `fractional`: a count that also takes a fraction."""

    default: Any
    doc: str
    choices: tuple = ()
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    valid: str = ""
    kind: type | None = None
    nullable: bool = False
    fractional: bool = False

    def __post_init__(self):
        if not self.doc.strip():
            raise ValueError("every config key needs a line of documentation")
        if self.kind is None:
            if self.default is None:
                raise ValueError("a key whose default is None must name its kind")
            object.__setattr__(self, "kind", type(self.default))

    @property
    def bounded(self) -> bool:
        return any(b is not None for b in (self.at_least, self.above, self.at_most, self.below))

    def range_text(self) -> str:
        """The bounds in words: '>= 0 and < 1'."""
        parts = []
        if self.at_least is not None:
            parts.append(f">= {self.at_least}")
        if self.above is not None:
            parts.append(f"> {self.above}")
        for sign, high in (("<=", self.at_most), ("<", self.below)):
            if high is not None:
                parts.append(f"{sign} {high if high < 2**32 else '2**' + str(int(high).bit_length() - 1)}")
        return " and ".join(parts)

    def in_range(self, value) -> bool:
        return ((self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above)
                and (self.at_most is None or value <= self.at_most) and (self.below is None or value < self.below))

    def type_text(self) -> str:
        if self.fractional:
            return "number"
        name = {bool: "bool", int: "int", float: "float", str: "str", tuple: "list", dict: "dict"}[self.kind]
        return f"{name} or None" if self.nullable else name


@dataclasses.dataclass(frozen=True)
class Group:
    """Keys (and subgroups) that one part of the trainer reads, with what the group is for and the
    page of docs/ that explains it."""

    doc: str
    keys: Mapping[str, Key | Group]
    page: str = ""

    def walk(self, prefix: str = "") -> Iterator[tuple[str, Key]]:
        """(dotted name, Key) for every key, in declaration order."""
        for name, item in self.keys.items():
            if isinstance(item, Group):
                yield from item.walk(f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", item

    def groups(self, prefix: str = "") -> Iterator[tuple[str, Group]]:
        """(dotted name, Group) for every group below this one."""
        for name, item in self.keys.items():
            if isinstance(item, Group):
                yield f"{prefix}{name}", item
                yield from item.groups(f"{prefix}{name}.")

    def defaults(self) -> ml_collections.ConfigDict:
        cfg = ml_collections.ConfigDict()
        for name, item in self.keys.items():
            # A None default (model.rope_scaling) leaves the field untyped: ml_collections lets a
            # preset set it to the declared kind, which check_values then holds it to.
            cfg[name] = item.defaults() if isinstance(item, Group) else item.default
        return cfg


# ----------------------------------------------------------------------------------------------
# Coercion: a value given for a key, made the key's type


def coerce(dotted: str, spec: Key | None, value: Any) -> Any:
    """`value` as key `dotted`'s declared type (ints widen to floats, lists become tuples, `a,b`
    splits into a tuple's items), or a ConfigError naming the key and its type; a value inside a
    dict-valued key (no `spec`) as it is."""
    if spec is None or (value is None and spec.nullable):
        return value
    if spec.fractional and isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value) if isinstance(value, float) and value.is_integer() else value
    kind = spec.kind
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is tuple and isinstance(value, list):
        return tuple(value)
    if kind is tuple and isinstance(value, str):
        return split_items(dotted, spec, value)
    if kind is dict and isinstance(value, (Mapping, ml_collections.ConfigDict)):
        return value
    raise ConfigError(f"config key {dotted!r} takes a {spec.type_text()} (default {spec.default!r}), not {value!r}")


def split_items(dotted: str, spec: Key, text: str) -> tuple:
    """`a,b` for a list-valued key: its items, whole numbers where the default's are
    (`log.profile_steps`), names otherwise (`lora.targets`); an empty string is the empty tuple."""
    items = [item.strip() for item in text.split(",")] if text.strip() else []
    shown = ",".join(map(str, spec.default))
    if "" in items:
        raise ConfigError(f"config key {dotted!r} has an empty item in {text!r}; write its items as a,b "
                          f"(default {shown})")
    if spec.default and all(isinstance(x, int) and not isinstance(x, bool) for x in spec.default):
        try:
            return tuple(int(item) for item in items)
        except ValueError:
            raise ConfigError(f"config key {dotted!r} takes whole numbers such as {shown}, not {text!r}") from None
    return tuple(items)


# ----------------------------------------------------------------------------------------------
# Each key's own check: its type, finiteness, allowed values and range


def leaves(node, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every leaf of a config, nested dicts (model.rope_scaling) included."""
    for name, value in node.items():
        if isinstance(value, (Mapping, ml_collections.ConfigDict)):
            yield from leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_value(dotted: str, spec: Key, value: Any) -> None:
    """Raises a ConfigError (one sentence) if `value` is not one key `dotted` may take."""
    if value is None and spec.nullable:
        return
    if spec.kind in (int, float) or spec.fractional:
        if not _is_number(value) or (spec.kind is int and not spec.fractional and not isinstance(value, int)):
            wanted = spec.valid or (f"a number {spec.range_text()}".strip() if spec.kind is float or spec.fractional
                                    else f"an integer {spec.range_text()}".strip())
            raise ConfigError(f"{dotted}={value!r} is a {type(value).__name__}; it takes {wanted}")
        if not math.isfinite(value) or not spec.in_range(value):
            raise ConfigError(_out_of_range(dotted, spec, value))
    elif spec.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{dotted} takes true or false, not {value!r}")
    elif spec.kind is str and not isinstance(value, str):
        raise ConfigError(f"{dotted}={value!r} is a {type(value).__name__}; it takes a string")
    if spec.choices and spec.kind is not tuple and value not in spec.choices:
        raise ConfigError(f"{dotted}={value!r} is not valid; choose one of {', '.join(map(repr, spec.choices))}")
    if spec.kind is tuple and spec.choices:
        ok = (not isinstance(value, str) and len(value) > 0 and all(v in spec.choices for v in value)
              and len(set(value)) == len(value))
        if not ok:
            raise ConfigError(f"{dotted}={value!r} is not valid; use distinct names from {', '.join(spec.choices)}")


def _out_of_range(dotted: str, spec: Key, value) -> str:
    """The sentence for a number outside its range, in the form users have seen from this key."""
    if spec.valid:
        return f"{dotted}={value!r} is not valid; use {spec.valid}"
    if spec.kind is int and not spec.fractional:
        bounds = spec.range_text()
        return f"{dotted} must be {'positive' if bounds == '> 0' else bounds}, got {value!r}"
    return f"{dotted}={value!r} is not valid; use a finite number {spec.range_text()}".rstrip()
