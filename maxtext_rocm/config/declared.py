"""The whole config as declared: every group's declaration in one `SCHEMA` (config/keys_model.py,
config/keys_run.py), and what is read from it: `defaults()` (the ConfigDict users override with
`--config.GROUP.KEY=VALUE`), each key's declaration by name (for coercing overrides: loading.py),
and the check of every key on its own (`check_values`, before the cross-key checks of
config/checks.py). `train --help` and docs/configs.md's key tables read it too (config/help.py).
Adding a key is one `Key(...)` in its group plus the code that reads it.
"""

from __future__ import annotations

import math

import ml_collections

from maxtext_rocm.config.keys_model import MESH, MODEL, PIPELINE, PRECISION
from maxtext_rocm.config.keys_run import (CHECKPOINT, DATA, DISTRIBUTED, DPO, EVAL, GRPO, LOG, LORA, OPTIMIZER,
                                         TRAIN)
from maxtext_rocm.config.schema import Group, Key, check_value, leaves
from maxtext_rocm.errors import ConfigError

SCHEMA = Group("A run's config.", {
    "name": Key("run", "the run's name"),
    "output_dir": Key("", "where the run writes; '' is runs/NAME"),
    "model": MODEL, "mesh": MESH, "pipeline": PIPELINE, "precision": PRECISION, "optimizer": OPTIMIZER,
    "data": DATA, "train": TRAIN, "dpo": DPO, "grpo": GRPO, "checkpoint": CHECKPOINT, "lora": LORA, "eval": EVAL,
    "log": LOG, "distributed": DISTRIBUTED,
})


def root() -> Group:
    """The whole config's declaration (read at each call, so a test may declare a key in it)."""
    return SCHEMA


def keys() -> dict[str, Key]:
    """Every declared key by dotted name."""
    return dict(root().walk())


def key(dotted: str) -> Key | None:
    return keys().get(dotted)


def group(dotted: str) -> Group | None:
    return dict(root().groups()).get(dotted)


def defaults() -> ml_collections.ConfigDict:
    """Every key the trainer reads, with its default, locked: a preset or a notebook that sets a key
    no part of the trainer reads (a typo such as `cfg.model.dmodel = ...`) fails at once instead of
    training with the default silently. `set_key` and `.unlocked()` add one on purpose."""
    cfg = root().defaults()
    cfg.lock()
    return cfg


def check_values(cfg) -> None:
    """Every declared key of `cfg` checked on its own, in declaration order, before any cross-key
    check (which could compare inf or NaN without complaint, or fail on a string with a
    traceback); and every float in the config, nested ones included, finite."""
    declared = keys()
    for dotted, spec in declared.items():
        node = cfg
        for part in dotted.split("."):
            node = node[part]
        check_value(dotted, spec, node)
    for dotted, value in leaves(cfg):
        if dotted not in declared and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{dotted}={value!r} is not valid; use a finite number")
