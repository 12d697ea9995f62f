"""The checks of gpt-oss's layer options taken together with the rest of the config: attention
sinks against the attention implementations and layouts that take them, and YaRN's rope
scaling (config/checks.py runs them with the others)."""

from __future__ import annotations

from typing import Mapping

import ml_collections

from maxtext_rocm.errors import ConfigError

# The attention implementations with a sink input (models/attention.py, SINK_IMPLEMENTATIONS;
# "auto" picks among them when sinks are on).
SINK_ATTENTION = ("xla", "blockwise", "auto")
YARN_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position", "truncate", "attention_factor")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_sinks(m, mesh) -> None:
    """model.attention_sinks: cuDNN's fused kernel, the Pallas kernels and context parallelism's
    exchanges have no sink input, so each is refused rather than silently run without."""
    if not m.attention_sinks:
        return
    _require(m.attention in SINK_ATTENTION,
             f"model.attention={m.attention!r} has no attention sinks, which model.attention_sinks=True asks for; "
             f"use model.attention {', '.join(SINK_ATTENTION)}")
    sizes = [mesh[group]["sequence"] for group in ("ici", "dcn")]
    _require(all(size == 1 for size in sizes),
             f"model.attention_sinks=True does not yet run with mesh sequence > 1 (mesh.ici.sequence={sizes[0]}, "
             f"mesh.dcn.sequence={sizes[1]}): context parallelism's attention has no sinks; set both to 1")


def check_rope_yarn(m) -> None:
    """model.rope_yarn: exactly YARN_KEYS, numbers where numbers are meant, and not beside
    Llama 3.1's rope_scaling (a rope has one scaling)."""
    yarn = m.rope_yarn
    if yarn is None:
        return
    _require(isinstance(yarn, (Mapping, ml_collections.ConfigDict)),
             f"model.rope_yarn must be None or a dict with keys {', '.join(YARN_KEYS)}")
    missing, extra = [k for k in YARN_KEYS if k not in yarn], [k for k in yarn.keys() if k not in YARN_KEYS]
    _require(not missing and not extra, f"model.rope_yarn needs exactly the keys {', '.join(YARN_KEYS)}"
             + (f"; missing {', '.join(missing)}" if missing else "") + (f"; unknown {', '.join(extra)}" if extra else ""))
    for key in ("factor", "beta_fast", "beta_slow", "original_max_position", "attention_factor"):
        value = yarn[key]
        if key == "attention_factor" and value is None:
            continue
        _require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                 f"model.rope_yarn.{key}={value!r} is not valid; it takes a number > 0"
                 + (" (or None for 0.1 ln(factor) + 1)" if key == "attention_factor" else ""))
    _require(isinstance(yarn["truncate"], bool), f"model.rope_yarn.truncate={yarn['truncate']!r} is not valid; "
                                                 "it takes true or false")
    _require(yarn["factor"] >= 1, f"model.rope_yarn.factor must be >= 1, got {yarn['factor']}")
    _require(m.rope_scaling is None, "model.rope_yarn and model.rope_scaling are both set; a rope takes one "
                                     "scaling, so set the other to None")
