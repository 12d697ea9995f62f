"""Hugging Face `config.json` <-> `cfg.model`, for the architectures of families.py (Llama, Mistral,
Qwen2/2.5, Qwen3, Mixtral, Qwen3-MoE).

Published checkpoints say `rope_theta` + `rope_scaling` (Llama 3.1: `rope_type: "llama3"`);
files written by transformers 5 say `rope_parameters` (with `rope_theta` inside). Both are read.
Anything this code base cannot represent (another activation or rope type, an output bias, layers
of different attention kinds, dense layers between sparse ones) is refused with one sentence naming
the key.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from maxtext_rocm.config import MOE_FAMILIES, UserError
from maxtext_rocm.convert.families import ARCHITECTURES, FAMILIES, mismatched_options

# Our rope_scaling keys -> Hugging Face's "llama3" rope keys.
ROPE_KEYS = {"factor": "factor", "low_freq_factor": "low_freq_factor",
             "high_freq_factor": "high_freq_factor", "original_max_position": "original_max_position_embeddings"}


class ConvertError(UserError):
    """A Hugging Face folder or a checkpoint that cannot be converted."""


def architecture(hf: Mapping[str, Any], where: str) -> str:
    """The model family (model.family, families.py) a Hugging Face config describes."""
    names = hf.get("architectures") or ([FAMILIES[hf["model_type"]].architecture]
                                        if hf.get("model_type") in FAMILIES else [])
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
            raise ConvertError(f"{where} sets {key}=true; this code base's layers have biases only on q, k and v "
                               "(Qwen2's), not on the attention output or the MLP")
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
            mlp_dim=int(hf["moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **FAMILIES[family].fixed,
        )
        updates["rope_theta"], updates["rope_scaling"] = _rope(hf, where)
        updates["sliding_window"] = _window(hf, family, where)
        updates.update(_experts(hf, family, where))
    except KeyError as error:
        raise ConvertError(f"{where} has no {error.args[0]!r}, which a {family} config needs") from None
    return updates


def _window(hf: Mapping[str, Any], family: str, where: str) -> int:
    """model.sliding_window: Mistral's and Mixtral's `sliding_window` on every layer, or none; one
    window for some layers only (Qwen's `use_sliding_window`, mixed `layer_types`) is refused."""
    if hf.get("use_sliding_window"):
        raise ConvertError(f"{where} sets use_sliding_window=true (a window on the layers from max_window_layers "
                           "on), which is not supported yet")
    kinds = set(hf.get("layer_types") or [])
    if len(kinds) > 1:
        raise ConvertError(f"{where} mixes layer_types {sorted(kinds)}; layers of different attention kinds "
                           "are not supported yet")
    if not FAMILIES[family].windowed or kinds == {"full_attention"}:
        return 0
    return int(hf.get("sliding_window") or 0)


def _experts(hf: Mapping[str, Any], family: str, where: str) -> dict[str, Any]:
    """The mixture-of-experts keys (n_experts 1 for a dense family)."""
    if family not in MOE_FAMILIES:
        return dict(n_experts=1, experts_per_token=1)
    if family == "qwen3_moe":
        if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ConvertError(f"{where} sets mlp_only_layers or decoder_sparse_step, so some layers are dense; "
                               "a mixture of experts on every layer is supported, not a mix")
        experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
        renormalize = bool(hf.get("norm_topk_prob", False))
    else:
        experts, renormalize = hf["num_local_experts"], True
    return dict(n_experts=int(experts), experts_per_token=int(hf["num_experts_per_tok"]),
                moe_renormalize=renormalize, moe_aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.02)))


def hf_config(model_cfg, base: Mapping[str, Any] | None = None, dtype: str = "float32",
              max_position: int | None = None) -> dict[str, Any]:
    """A config.json for transformers from `cfg.model`; `base` (the imported original, if any)
    keeps what this code base does not know (token ids, max positions, ...)."""
    m = model_cfg
    wrong = mismatched_options(m)
    if wrong:
        raise ConvertError(f"{', '.join(wrong)} cannot be written as a {FAMILIES[m.family].architecture} "
                           f"(model.family={m.family!r}), which transformers would load without it; "
                           "choose the family whose layers have it (docs/models.md)")
    out = copy.deepcopy(dict(base or {}))
    for stale in ("auto_map", "quantization_config", "_name_or_path"):
        out.pop(stale, None)
    out.update(
        architectures=[FAMILIES[m.family].architecture], model_type=m.family, vocab_size=m.vocab_size,
        hidden_size=m.d_model, num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=bool(m.tie_embeddings), hidden_act="silu")
    out.update(_family_keys(m, out))
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


def _family_keys(m, out: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json keys that differ by family; `out` the config so far (the original's keys)."""
    if m.family == "qwen3_moe":  # `num_experts` as published unless the original spelled it otherwise
        experts = "num_local_experts" if "num_local_experts" in out else "num_experts"
        return {experts: m.n_experts, "num_experts_per_tok": m.experts_per_token, "moe_intermediate_size": m.mlp_dim,
                "intermediate_size": out.get("intermediate_size", m.mlp_dim), "norm_topk_prob": m.moe_renormalize,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": m.moe_aux_loss_weight,
                "attention_bias": False, "use_sliding_window": False}
    keys = {"intermediate_size": m.mlp_dim}
    if m.family == "mixtral":
        keys.update(num_local_experts=m.n_experts, num_experts_per_tok=m.experts_per_token,
                    router_aux_loss_coef=m.moe_aux_loss_weight)
    if FAMILIES[m.family].windowed:
        keys["sliding_window"] = m.sliding_window or None
        if "layer_types" in out:
            keys["layer_types"] = ["sliding_attention" if m.sliding_window else "full_attention"] * m.n_layers
    elif "layer_types" in out:
        keys["layer_types"] = ["full_attention"] * m.n_layers
    if m.family in ("llama", "qwen3"):
        keys.update(attention_bias=False)
    if m.family == "llama":
        keys.update(mlp_bias=False)
    if m.family in ("qwen2", "qwen3"):
        keys.update(use_sliding_window=False)
    return keys
