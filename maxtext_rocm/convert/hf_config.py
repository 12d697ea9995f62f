"""Hugging Face `config.json` <-> `cfg.model`, for the architectures of families.py (Llama, Mistral,
Qwen2/2.5, Qwen3, Gemma 3, Mixtral, Qwen3-MoE, gpt-oss).

Published checkpoints say `rope_theta` + `rope_scaling` (Llama 3.1: `rope_type: "llama3"`);
files written by transformers 5 say `rope_parameters` (with `rope_theta` inside). Both are read.
Anything this code base cannot represent (another activation or rope type, an output bias outside
gpt-oss, layers of different attention kinds outside Gemma 3 and gpt-oss, dense layers between
sparse ones) is refused with one sentence naming the key.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from maxtext_rocm.config import MOE_FAMILIES
from maxtext_rocm.config.choices import feed_forward_dim
from maxtext_rocm.models.activations import CLAMP_LIMIT, SIGMOID_ALPHA
from maxtext_rocm.convert.families import ARCHITECTURES, FAMILIES, MODEL_TYPES, MULTIMODAL, mismatched_options
from maxtext_rocm.convert.hf_attention import ConvertError, rope_keys, window_keys, write_rope, write_windows

__all__ = ["ConvertError", "architecture", "hf_config", "model_updates"]
# config.json's activation names -> model.mlp_activation
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Keys whose values this code base has no layer for: refused unless null or false
UNREPRESENTED = {"final_logit_softcapping": "a tanh cap on the logits", "attn_logit_softcapping":
                 "a tanh cap on the attention scores", "use_bidirectional_attention": "bidirectional attention"}


def architecture(hf: Mapping[str, Any], where: str) -> str:
    """The model family (model.family, families.py) a Hugging Face config describes."""
    names = hf.get("architectures") or ([FAMILIES[MODEL_TYPES[hf["model_type"]]].architecture]
                                        if hf.get("model_type") in MODEL_TYPES else [])
    name = names[0] if names else hf.get("model_type", "unknown")
    if name not in ARCHITECTURES:
        raise ConvertError(f"{where} describes a {name}, which cannot be converted; supported architectures "
                           f"are {', '.join([*ARCHITECTURES, *MULTIMODAL])}")
    return ARCHITECTURES[name]


def model_updates(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The `cfg.model` keys a Hugging Face config.json sets."""
    family = architecture(hf, where)
    if family == "gpt_oss":
        _check_gpt_oss(hf, where)
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key) and not (family == "gpt_oss" and key == "attention_bias"):
            raise ConvertError(f"{where} sets {key}=true; this code base's layers have biases only on q, k and v "
                               "(Qwen2's) and, in gpt-oss alone, on the attention output and the experts, never on "
                               "a dense MLP")
    act_key = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
    act = hf.get(act_key) or "silu"
    if act not in ACTIVATIONS:
        raise ConvertError(f"{where} sets {act_key}={act!r}; only SwiGLU ('silu') and GeGLU ('gelu_pytorch_tanh') "
                           "MLPs are supported")
    for key, what in UNREPRESENTED.items():
        if hf.get(key):
            raise ConvertError(f"{where} sets {key}={hf[key]!r}: {what}, which this code base does not have")
    try:
        d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        updates = dict(
            family=family, vocab_size=int(hf["vocab_size"]), d_model=d_model,
            n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim") or d_model // n_heads),
            # Qwen3-MoE: the experts' width beside the dense layers' (which no supported stack has)
            mlp_dim=int((hf.get("intermediate_size") or hf["moe_intermediate_size"]) if family == "qwen3_moe"
                        else hf["intermediate_size"]),
            moe_mlp_dim=int(hf["moe_intermediate_size"]) if family == "qwen3_moe" else 0,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]) if hf.get("query_pre_attn_scalar") else None,
            **{"mlp_activation": ACTIVATIONS[act], **FAMILIES[family].fixed},  # gpt-oss fixes its own activation
        )
        updates.update(rope_keys(hf, where))
        spec = FAMILIES[family]
        updates.update(window_keys(hf, updates["n_layers"], spec.windowed, spec.layered, where))
        updates.update(_experts(hf, family, where))
    except KeyError as error:
        raise ConvertError(f"{where} has no {error.args[0]!r}, which a {family} config needs") from None
    return updates


def _check_gpt_oss(hf: Mapping[str, Any], where: str) -> None:
    """What a gpt-oss config may say that this code base's layers do not compute: no attention
    biases, or a clamp and sigmoid scale other than the published ones."""
    if not hf.get("attention_bias", True):
        raise ConvertError(f"{where} sets attention_bias=false; gpt-oss is supported with its published biases "
                           "on the attention projections")
    for key, ours in (("swiglu_limit", CLAMP_LIMIT), ("swiglu_alpha", SIGMOID_ALPHA)):
        if float(hf.get(key, ours)) != ours:
            raise ConvertError(f"{where} sets {key}={hf[key]!r}; only gpt-oss's published {key}={ours} is supported")


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
        architectures=[FAMILIES[m.family].architecture], model_type=FAMILIES[m.family].model_type or m.family,
        vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=bool(m.tie_embeddings))
    # gpt-oss's config says "silu" of its clamped SwiGLU (swiglu_limit and swiglu_alpha say the rest)
    their_act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "clamped_silu": "silu"}[m.mlp_activation]
    out["hidden_activation" if m.family == "gemma3" else "hidden_act"] = their_act
    if m.query_pre_attn_scalar or "query_pre_attn_scalar" in out:
        scalar = m.query_pre_attn_scalar or m.head_dim
        out["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar  # transformers: int
    out.update(_family_keys(m, out))
    write_rope(m, out)
    write_windows(m, out, FAMILIES[m.family].windowed)
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
        # intermediate_size: model.mlp_dim where moe_mlp_dim is set apart (an import of this version
        # does), else the original's (mlp_dim is then the experts')
        dense = m.mlp_dim if m.moe_mlp_dim else out.get("intermediate_size", m.mlp_dim)
        return {experts: m.n_experts, "num_experts_per_tok": m.experts_per_token,
                "moe_intermediate_size": feed_forward_dim(m), "intermediate_size": dense,
                "norm_topk_prob": m.moe_renormalize,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": m.moe_aux_loss_weight,
                "attention_bias": False, "use_sliding_window": False}
    keys = {"intermediate_size": m.mlp_dim}
    if m.family == "gpt_oss":
        keys.update(num_local_experts=m.n_experts, num_experts_per_tok=m.experts_per_token,
                    router_aux_loss_coef=m.moe_aux_loss_weight, attention_bias=True, swiglu_limit=CLAMP_LIMIT,
                    swiglu_alpha=SIGMOID_ALPHA)
    if m.family == "mixtral":
        keys.update(num_local_experts=m.n_experts, num_experts_per_tok=m.experts_per_token,
                    router_aux_loss_coef=m.moe_aux_loss_weight)
    if m.family in ("llama", "qwen3", "gemma3"):
        keys.update(attention_bias=False)
    if m.family == "llama":
        keys.update(mlp_bias=False)
    if m.family in ("qwen2", "qwen3"):
        keys.update(use_sliding_window=False)
    return keys
