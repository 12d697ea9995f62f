"""The schema in words: `python -m maxtext_rocm.train --help [GROUP | GROUP.KEY]` and the key tables
of docs/configs.md (written by `python -m maxtext_rocm.config.help --write docs/configs.md`,
checked by tests/test_config_schema.py), both read from the declarations (config/declared.py)."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from maxtext_rocm.config import declared, key_hints, schema
from maxtext_rocm.errors import ConfigError

USAGE = "usage: python -m maxtext_rocm.train CONFIG.py[:VARIANT] [--config.GROUP.KEY=VALUE ...]"
TABLES_BEGIN = "<!-- key tables: written from config/declared.py by python -m maxtext_rocm.config.help --write -->"
TABLES_END = "<!-- end of key tables -->"


def values_text(spec: schema.Key) -> str:
    """What a key may take, in words: its choices, or its range and what its special values mean."""
    if spec.choices:
        return ", ".join(map(str, spec.choices))
    if spec.valid:
        return spec.valid
    return spec.range_text()


def _default_text(spec: schema.Key) -> str:
    value = spec.default
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if value else "(empty)"
    return repr(value) if isinstance(value, str) else str(value)


def _top_level_keys() -> list[str]:
    return [name for name, item in declared.root().keys.items() if isinstance(item, schema.Key)]


def overview() -> str:
    """`--help`: the usage, then each group with what it is for."""
    lines = [USAGE, "",
             "CONFIG.py is a preset file (configs/NAME.py, or just NAME); VARIANT is bf16 (default), fp32 or fp8.",
             "Each --config.GROUP.KEY=VALUE overrides one key (true/false for booleans, a,b for lists).", "",
             "groups (--help GROUP lists its keys, --help GROUP.KEY one key):",
             f"  {'(top)':<13}{', '.join(_top_level_keys())}"]
    for name, item in declared.root().keys.items():
        if isinstance(item, schema.Group):
            count = sum(1 for _ in item.walk())
            lines.append(f"  {name:<13}{item.doc} ({count} keys)")
    return "\n".join(lines)


def _key_lines(dotted: str, spec: schema.Key) -> list[str]:
    values = values_text(spec)
    head = f"  --config.{dotted}={_default_text(spec)}  ({spec.type_text()}" + (f": {values})" if values else ")")
    return [head, f"      {spec.doc}"]


def describe(topic: str) -> str:
    """`--help GROUP` or `--help GROUP.KEY`; a ConfigError naming the close name for anything else."""
    if topic in ("top", "(top)"):
        return "\n".join(line for name in _top_level_keys() for line in _key_lines(name, declared.key(name)))
    spec, group = declared.key(topic), declared.group(topic)
    if spec is not None:
        return "\n".join(_key_lines(topic, spec))
    if group is not None:
        page = f" (docs/{group.page})" if group.page else ""
        lines = [f"{topic}: {group.doc}{page}"]
        for dotted, key_spec in group.walk(f"{topic}."):
            lines += _key_lines(dotted, key_spec)
        return "\n".join(lines)
    names = [*declared.keys(), *dict(declared.root().groups())]
    same_leaf = [name for name in names if name.split(".")[-1] == topic]  # `--help steps`: train.steps
    meant = (key_hints.SYNONYMS.get(topic) or (same_leaf[0] if len(same_leaf) == 1 else None)
             or next(iter(difflib.get_close_matches(topic, names, n=1)), None))
    groups = ", ".join(name for name, item in declared.root().keys.items() if isinstance(item, schema.Group))
    raise ConfigError(f"--help {topic!r} names no config group or key"
                      + (f"; did you mean {meant!r}?" if meant else "")
                      + f" (groups: {groups}; or a key such as train.steps)")


def help_text(args: list[str]) -> str:
    """What `train --help [TOPIC ...]` prints."""
    return "\n\n".join(describe(topic) for topic in args) if args else overview()


def markdown_tables() -> str:
    """docs/configs.md's key tables: one per group, a row per key."""
    out = [TABLES_BEGIN, ""]
    sections = [("(top)", None, [(name, declared.key(name)) for name in _top_level_keys()])]
    sections += [(name, item, list(item.walk(f"{name}."))) for name, item in declared.root().keys.items()
                 if isinstance(item, schema.Group)]
    for name, group, rows in sections:
        title = f"### `{name}`" if group else "### Top level"
        see = f" See [{group.page[:-3]}]({group.page})." if group and group.page and group.page != "configs.md" else ""
        out += [title, ""] + ([f"{group.doc}{see}", ""] if group else [])
        out += ["| key | type | default | values | what it does |", "| --- | --- | --- | --- | --- |"]
        for dotted, spec in rows:
            cells = [f"`{dotted}`", spec.type_text(), f"`{_default_text(spec)}`", values_text(spec), spec.doc]
            out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        out.append("")
    out.append(TABLES_END)
    return "\n".join(out)


def with_tables(page: str) -> str:
    """`page` (docs/configs.md's text) with its key tables replaced by the schema's."""
    if TABLES_BEGIN not in page or TABLES_END not in page:
        raise ValueError(f"the page has no key tables to replace (between {TABLES_BEGIN!r} and {TABLES_END!r})")
    before, rest = page.split(TABLES_BEGIN, 1)
    return before + markdown_tables() + rest.split(TABLES_END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Writes docs/configs.md's key tables from the config schema.")
    parser.add_argument("--write", metavar="PAGE", help="the page whose key tables to rewrite (docs/configs.md)")
    args = parser.parse_args(argv)
    if args.write:
        page = Path(args.write)
        page.write_text(with_tables(page.read_text()))
    else:
        print(markdown_tables())
    return 0


if __name__ == "__main__":
    sys.exit(main())
