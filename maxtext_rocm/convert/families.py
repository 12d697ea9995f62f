"""The Hugging Face architectures that convert: for each `model.family`, its transformers class and
the layer options (cfg.model keys) every checkpoint of it has.

A family is not a model of its own here: the decoder is one (models/llama.py), and a family is a
set of values for its options (qk_norm, qkv_bias, sliding_window, moe_renormalize, ...) plus the
names its tensors and config keys go by (mapping.py, hf_config.py). `from-hf` sets the fixed
options; `to-hf` refuses a model whose options its family's class could not load, rather than
writing a checkpoint transformers would read as something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Family:
    """`architecture`: the transformers class; `fixed`: the cfg.model options its layers always
    have; `windowed`: whether its config's `sliding_window` is read (else a window is refused)."""

    architecture: str
    fixed: Mapping[str, Any]
    windowed: bool = False


_PLAIN = {"qk_norm": False, "qkv_bias": False}
FAMILIES = {
    "llama": Family("LlamaForCausalLM", _PLAIN),
    "mistral": Family("MistralForCausalLM", _PLAIN, windowed=True),
    "qwen2": Family("Qwen2ForCausalLM", {"qk_norm": False, "qkv_bias": True}),
    "qwen3": Family("Qwen3ForCausalLM", {"qk_norm": True, "qkv_bias": False}),
    "mixtral": Family("MixtralForCausalLM", {**_PLAIN, "moe_renormalize": True}, windowed=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", {"qk_norm": True, "qkv_bias": False}),
}
ARCHITECTURES = {family.architecture: name for name, family in FAMILIES.items()}


def mismatched_options(model_cfg) -> list[str]:
    """`key=value` for each option of `model_cfg` that its family's class cannot hold."""
    family = FAMILIES[model_cfg.family]
    wrong = [f"model.{key}={model_cfg[key]}" for key, value in family.fixed.items() if model_cfg[key] != value]
    if model_cfg.sliding_window and not family.windowed:
        wrong.append(f"model.sliding_window={model_cfg.sliding_window}")
    return wrong
