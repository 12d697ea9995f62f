"""Loading a run's config: presets, variants, overrides from the command line or a notebook (each
key's declaration, default and type: schema.py; validation: checks.py).

A run is described by one `ml_collections.ConfigDict` with one group per part of the trainer
(`model`, `mesh`, `pipeline`, `precision`, `optimizer`, `data`, `train`, `dpo`, `checkpoint`, `lora`,
`log`, `distributed`). Each part reads only its own group. Presets live in `configs/NAME.py` and define `get_config(variant="")`,
starting from `defaults()`.

Every user mistake surfaces as a `ConfigError` whose message is one sentence naming the key and
what would be valid; the command line turns it into exit status 2.
"""

from __future__ import annotations

import ast
import importlib.util
import linecache
import re
import traceback
from pathlib import Path
from typing import Any, Iterable, Mapping

import ml_collections

# Re-exported: the valid values and the error types live at the bottom of the import graph, so
# config/checks.py, data/ and sharding.py import them without importing this module.
from maxtext_rocm.config.choices import (  # noqa: F401
    ATTENTION_IMPLEMENTATIONS, CONTEXT_PARALLEL_MODES, DATA_SOURCES, FP8_FORMATS, FP8_SCALINGS, MESH_AXES,
    MODEL_FAMILIES, MOE_IMPLEMENTATIONS, NONFINITE_ACTIONS, PIPELINE_SCHEDULES, PRECISION_POLICIES,
    PRECISION_VARIANTS, REMAT_POLICIES, SCHEDULES)
from maxtext_rocm.errors import CheckpointError, ConfigError, UserError  # noqa: F401
# Validation lives in config/checks.py; its entry points are part of this module's interface.
from maxtext_rocm.config.checks import axis_sizes, global_batch_size, mesh_shape, validate  # noqa: F401
from maxtext_rocm.config import declared, key_hints, schema
from maxtext_rocm.config.declared import defaults  # noqa: F401  (part of this module's interface)


def apply_variant(cfg: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
    """The variants every preset understands: precision policies (`:bf16`, `:fp32`, `:fp8`)."""
    if variant not in PRECISION_VARIANTS:
        raise ConfigError(
            f"unknown variant {variant!r}; valid variants are "
            + ", ".join(repr(v) for v in PRECISION_VARIANTS if v)
        )
    if variant:
        cfg.precision.policy = variant
    return cfg


def _configs_dirs() -> list[Path]:
    return [Path.cwd() / "configs", Path(__file__).resolve().parents[2] / "configs"]  # the repository's configs/


def _resolve_preset(path: str) -> Path:
    candidate = Path(path)
    if candidate.suffix != ".py":  # a bare preset name such as "tiny_llama"
        for folder in _configs_dirs():
            if (folder / f"{path}.py").is_file():
                return folder / f"{path}.py"
    if candidate.is_file():
        return candidate
    known = sorted({p.stem for d in _configs_dirs() if d.is_dir() for p in d.glob("*.py")})
    raise ConfigError(
        f"config file {path!r} does not exist; give a path such as configs/tiny_llama.py "
        f"or a preset name ({', '.join(known) or 'none found'})"
    )


# Every preset file loaded so far: an error inside one is reported at its own line, the innermost
# preset's (presets build on each other), not at the loader's.
_PRESET_FILES: set[str] = set()


def load_preset(spec: str) -> ml_collections.ConfigDict:
    """The config that `PATH.py[:VARIANT]` (or a preset name) defines, before overrides.

    Presets may build on each other: `configs/llama3_1_8b.py` starts from `load_preset("llama3_8b")`.
    A preset that does not import, or whose get_config raises (an unknown key included), is a
    ConfigError naming the file and the line.
    """
    path, _, variant = spec.partition(":")
    preset = _resolve_preset(path)
    _PRESET_FILES.add(str(preset.resolve()))
    module_spec = importlib.util.spec_from_file_location(f"maxtext_rocm_preset_{preset.stem}", preset)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"config file {str(preset)!r} does not define get_config(variant='')")
        cfg = module.get_config(variant)
    except ConfigError:
        raise
    except SyntaxError as error:  # the file itself: its line is in the error, not in a frame
        raise ConfigError(f"config file {error.filename or str(preset)!r} line {error.lineno} is not valid "
                          f"Python ({error.msg}); fix it or pass another preset") from None
    except Exception as error:  # noqa: BLE001 - a preset is user code and may raise anything
        raise _preset_error(preset, error) from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"get_config in {str(preset)!r} returned a {type(cfg).__name__}, not the "
                          "ConfigDict that config.defaults() starts")
    cfg.lock()  # a preset that built its own ConfigDict is held to its keys from here on too
    return cfg


def _preset_error(preset: Path, error: Exception) -> ConfigError:
    """One sentence for an exception raised while a preset ran: the file and line it came from (the
    innermost preset frame), and for a locked-config error the unknown key with the close name."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if str(Path(f.filename).resolve()) in _PRESET_FILES]
    where_file, line = (frames[-1].filename, frames[-1].lineno) if frames else (str(preset), None)
    at = f"config file {where_file!r}" + (f" line {line}" if line else "")
    text = str(error.args[0]) if error.args else ""
    unknown = re.search(r'Key "([^"]+)" does not exist and cannot be added since the config is locked', text)
    if unknown:
        close = re.search(r'Did you mean "([^"]+)"', text)
        meant = close.group(1) if close else key_hints.SYNONYMS.get(unknown.group(1))
        source = linecache.getline(where_file, line).strip() if line else ""
        return ConfigError(
            f"{at} sets the unknown config key {unknown.group(1)!r}" + (f" ({source})" if source else "")
            + (f"; did you mean {meant!r}?" if meant else "; see config.defaults() for the keys"))
    first = (text.strip().splitlines() or [""])[0][:300]
    return ConfigError(f"{at} raised {type(error).__name__}" + (f": {first}" if first else "")
                       + "; fix the preset or pass another one")


def load(spec: str, overrides: Mapping[str, Any] | Iterable[str] | None = None):
    """Loads `PATH.py[:VARIANT]` (or a preset name), applies overrides and validates the result.

    `overrides` is either a mapping `{"train.steps": 100}` of typed values or command-line
    strings `["--config.train.steps=100"]`.
    """
    cfg = load_preset(spec)
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            set_key(cfg, key, value)
    elif overrides is not None:
        apply_cli_overrides(cfg, list(overrides))
    if not cfg.output_dir:
        cfg.output_dir = f"runs/{cfg.name}"
    validate(cfg)
    return cfg


def _lookup(cfg: ml_collections.ConfigDict, key: str):
    """Returns (parent, leaf name) for a dotted key, or raises a ConfigError naming the nearest."""
    parts = key.split(".")
    node = cfg
    for depth, part in enumerate(parts):
        here = ".".join(parts[: depth + 1])
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            if not isinstance(node, ml_collections.ConfigDict):  # a key under a leaf: `train.steps.x`
                raise ConfigError(f"unknown config key {key!r}; {'.'.join(parts[:depth])!r} is a value, "
                                  "not a group of keys")
            siblings = list(node.keys())
            meant = key_hints.suggestion(cfg, key, depth)
            hint = f"did you mean {meant!r}? " if meant else ""
            scope = ".".join(parts[:depth]) or "the config"
            raise ConfigError(
                f"unknown config key {here!r}; {hint}keys in {scope} are: {', '.join(siblings)}"
            )
        if depth < len(parts) - 1:
            node = node[part]
    return node, parts[-1]


def set_key(cfg: ml_collections.ConfigDict, key: str, value: Any) -> None:
    """Sets a dotted key, coerced to its declared type (config/declared.py; ints widen to floats)."""
    parent, leaf = _lookup(cfg, key)
    current = parent[leaf]
    if isinstance(current, ml_collections.ConfigDict) and not isinstance(value, Mapping):
        raise ConfigError(f"config key {key!r} is a group; set one of its keys ({', '.join(current.keys())})")
    value = schema.coerce(key, declared.key(key), value)
    if isinstance(value, Mapping):
        value = ml_collections.ConfigDict(dict(value))
    with parent.unlocked():
        if current is not None and type(value) is not type(current) and not isinstance(current, ml_collections.ConfigDict):
            # ml_collections types a field by its first value; the declared type is wider where a
            # count takes a fraction (train.per_device_batch_size) or None (model.sliding_window)
            del parent[leaf]
        parent[leaf] = value


def _parse_cli_value(key: str, current: Any, text: str) -> Any:
    """Reads a command-line value by the key's declared type (the current value's, for a key inside
    a dict value such as model.rope_scaling.factor)."""
    spec = declared.key(key)
    kind = spec.kind if spec is not None else type(current)
    if spec is not None and spec.nullable and text.lower() == "none":
        return None
    if kind is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"config key {key!r} takes true or false, not {text!r}")
    if spec is not None and spec.fractional:
        try:
            return float(text)  # schema.coerce keeps a whole number an int
        except ValueError:
            raise ConfigError(f"config key {key!r} takes a number (a fraction of a sequence per device is "
                              f"allowed), not {text!r}") from None
    if kind in (int, float):
        try:
            return float(text) if kind is float else int(text)
        except ValueError:
            raise ConfigError(f"config key {key!r} takes a{'n int' if kind is int else ' float'}, not {text!r}") from None
    if kind is str:
        return text
    if kind is tuple and not text.lstrip().startswith(("(", "[")):
        return text  # `a,b` (or one item): schema.coerce splits it into the key's items
    # None-valued keys (e.g. model.rope_scaling) and tuples take Python literals.
    if text.lower() == "none":
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"config key {key!r} takes a Python literal (a dict, tuple or None), not {text!r}") from None


def apply_cli_overrides(cfg: ml_collections.ConfigDict, args: list[str]) -> None:
    """Applies `--config.GROUP.KEY=VALUE` (or `--config.GROUP.KEY VALUE`) arguments in order."""
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--config."):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --config.train.steps=100")
        body = arg[len("--config."):]
        if "=" in body:
            key, text = body.split("=", 1)
        elif i + 1 < len(args):
            key, text = body, args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value; write it as {arg}=VALUE")
        parent, leaf = _lookup(cfg, key)
        set_key(cfg, key, _parse_cli_value(key, parent[leaf], text))
        i += 1
