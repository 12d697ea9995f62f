"""Hugging Face `config.json` <-> `cfg.model`, for LlamaForCausalLM and MixtralForCausalLM.

Published checkpoints say `rope_theta` + `rope_scaling` (Llama 3.1: `rope_type: "llama3"`);
files written by transformers 5 say `rope_parameters` (with `rope_theta` inside). Both are read.
Anything this code base cannot represent (biases, other activations, other rope types) is refused
with one sentence naming the key.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from maxtext_rocm.config import UserError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral"}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
# Our rope_scaling keys -> Hugging Face's "llama3" rope keys.
ROPE_KEYS = {"factor": "factor", "low_freq_factor": "low_freq_factor",
             "high_freq_factor": "high_freq_factor", "original_max_position": "original_max_position_embeddings"}


class ConvertError(UserError):
    """A Hugging Face folder or a checkpoint that cannot be converted."""


def architecture(hf: Mapping[str, Any], where: str) -> str:
    """The model family ("llama" or "mixtral") a Hugging Face config describes."""
    names = hf.get("architectures") or ([MODEL_TYPES[hf["model_type"]]] if hf.get("model_type") in MODEL_TYPES else [])
    name = names[0] if names else hf.get("model_type", "unknown")
    if name not in ARCHITECTURES:
        raise ConvertError(f"{where} describes a {name}, which cannot be converted; supported architectures "
                           f"are {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def _rope(hf: Mapping[str, Any], where: str) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling or None) from either spelling of the rope settings."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = dict(params) if isinstance(params, Mapping) else dict(hf.get("rope_scaling") or {})
    theta = scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ConvertError(f"{where} asks for rope_type {kind!r}; only 'default' and Llama 3.1's 'llama3' "
                           "frequency scaling are supported")
    missing = [k for k in ROPE_KEYS.values() if k not in scaling]
    if missing:
        raise ConvertError(f"{where} has llama3 rope scaling without {', '.join(missing)}")
    return float(theta), {ours: float(scaling[theirs]) if ours != "original_max_position" else int(scaling[theirs])
                          for ours, theirs in ROPE_KEYS.items()}


def model_updates(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The `cfg.model` keys a Hugging Face config.json sets."""
    family = architecture(hf, where)
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConvertError(f"{where} sets {key}=true; this code base's layers have no biases")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConvertError(f"{where} sets hidden_act={act!r}; only SwiGLU ('silu') MLPs are supported")
    try:
        d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        updates = dict(
            family=family, vocab_size=int(hf["vocab_size"]), d_model=d_model,
            n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim") or d_model // n_heads),
            mlp_dim=int(hf["intermediate_size"]), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except KeyError as error:
        raise ConvertError(f"{where} has no {error.args[0]!r}, which a {family} config needs") from None
    updates["rope_theta"], updates["rope_scaling"] = _rope(hf, where)
    if family == "mixtral":
        updates.update(n_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                       sliding_window=int(hf.get("sliding_window") or 0),
                       moe_aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.02)))
    else:
        updates.update(n_experts=1, experts_per_token=1, sliding_window=0)
    return updates


def hf_config(model_cfg, base: Mapping[str, Any] | None = None, dtype: str = "float32",
              max_position: int | None = None) -> dict[str, Any]:
    """A config.json for transformers from `cfg.model`; `base` (the imported original, if any)
    keeps what this code base does not know (token ids, max positions, ...)."""
    m = model_cfg
    out = copy.deepcopy(dict(base or {}))
    for stale in ("auto_map", "quantization_config", "_name_or_path"):
        out.pop(stale, None)
    family = m.family
    out.update(
        architectures=[MODEL_TYPES[family]], model_type=family, vocab_size=m.vocab_size, hidden_size=m.d_model,
        intermediate_size=m.mlp_dim, num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=bool(m.tie_embeddings), hidden_act="silu")
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(num_local_experts=m.n_experts, num_experts_per_tok=m.experts_per_token,
                   sliding_window=m.sliding_window or None, router_aux_loss_coef=m.moe_aux_loss_weight)
    scaling = None
    if m.rope_scaling is not None:
        scaling = {"rope_type": "llama3", **{theirs: m.rope_scaling[ours] for ours, theirs in ROPE_KEYS.items()}}
    if "rope_parameters" in out:  # keep the spelling the original used (transformers 5)
        out["rope_parameters"] = {"rope_theta": m.rope_theta, **(scaling or {"rope_type": "default"})}
        out.pop("rope_scaling", None), out.pop("rope_theta", None)
    else:  # the published spelling, which transformers 4 and 5 both read
        out.update(rope_theta=m.rope_theta, rope_scaling=scaling)
    if "max_position_embeddings" not in out:  # informative only: Llama 3.1 scaling reads its own keys
        scaled = int(m.rope_scaling["original_max_position"] * m.rope_scaling["factor"]) if m.rope_scaling else 0
        out["max_position_embeddings"] = max(max_position or 0, scaled) or 8192
    # transformers 5 writes "dtype", 4 wrote "torch_dtype" (5 still reads it): keep what is there.
    for key in [k for k in ("dtype", "torch_dtype") if k in out] or ["torch_dtype"]:
        out[key] = dtype
    return out
