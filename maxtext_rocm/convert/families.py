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
    have; `windowed`: whether its config's `sliding_window` is read (else a window is refused);
    `layered`: whether its `layer_types` may mix kinds (model.attention_kinds, with their own rope
    base); `scaled_scores`: whether it reads query_pre_attn_scalar; `model_type`: config.json's,
    where it is not the family's name. The activation and the rope are read for every family."""

    architecture: str
    fixed: Mapping[str, Any]
    windowed: bool = False
    layered: bool = False
    scaled_scores: bool = False
    model_type: str = ""


# The layer options as Llama has them: every family states where it departs from these. gpt-oss's
# own (_OFF) are off in every other family.
_OFF = {"out_bias": False, "attention_sinks": False, "moe_bias": False, "moe_router": "softmax_topk"}
_PLAIN = {"qk_norm": False, "qkv_bias": False, "norm_unit_offset": False, "post_norms": False,
          "scale_embeddings": False, **_OFF}
FAMILIES = {
    "llama": Family("LlamaForCausalLM", _PLAIN),
    "mistral": Family("MistralForCausalLM", _PLAIN, windowed=True),
    "qwen2": Family("Qwen2ForCausalLM", {**_PLAIN, "qkv_bias": True}),
    "qwen3": Family("Qwen3ForCausalLM", {**_PLAIN, "qk_norm": True}),
    # Gemma 3's text model: its query_pre_attn_scalar, rope bases and layer pattern are read apart
    "gemma3": Family("Gemma3ForCausalLM", {"qk_norm": True, "qkv_bias": False, "norm_unit_offset": True,
                                           "post_norms": True, "scale_embeddings": True, **_OFF},
                     windowed=True, layered=True, scaled_scores=True, model_type="gemma3_text"),
    "mixtral": Family("MixtralForCausalLM", {**_PLAIN, "moe_renormalize": True}, windowed=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", {**_PLAIN, "qk_norm": True}),
    # biases on every attention projection, the router and the experts; sinks; clamped SwiGLU
    # experts routed by a softmax over the top logits; sliding and full layers alternating
    "gpt_oss": Family("GptOssForCausalLM", {**_PLAIN, "qkv_bias": True, "out_bias": True, "attention_sinks": True,
                                            "moe_bias": True, "moe_router": "topk_softmax",
                                            "mlp_activation": "clamped_silu"}, windowed=True, layered=True),
}
ARCHITECTURES = {family.architecture: name for name, family in FAMILIES.items()}
MODEL_TYPES = {family.model_type or name: name for name, family in FAMILIES.items()}


def mismatched_options(model_cfg) -> list[str]:
    """`key=value` for each option of `model_cfg` that its family's class cannot hold."""
    family = FAMILIES[model_cfg.family]
    wrong = [f"model.{key}={model_cfg[key]}" for key, value in family.fixed.items() if model_cfg[key] != value]
    if model_cfg.mlp_activation == "clamped_silu" and "mlp_activation" not in family.fixed:
        wrong.append("model.mlp_activation=clamped_silu")
    if model_cfg.sliding_window and not family.windowed:
        wrong.append(f"model.sliding_window={model_cfg.sliding_window}")
    if len(model_cfg.attention_kinds) > 1 and not family.layered:
        wrong.append(f"model.attention_kinds={','.join(model_cfg.attention_kinds)}")
    if model_cfg.rope_local_theta is not None and not family.layered:
        wrong.append(f"model.rope_local_theta={model_cfg.rope_local_theta}")
    if model_cfg.query_pre_attn_scalar is not None and not family.scaled_scores:
        wrong.append(f"model.query_pre_attn_scalar={model_cfg.query_pre_attn_scalar}")
    return wrong


# Checkpoints that hold a text model beside other towers: the class, the text model's config key,
# its tensors' prefix, and the prefixes of what is not imported.
@dataclasses.dataclass(frozen=True)
class Multimodal:
    text_architecture: str
    text_model_type: str
    config_key: str
    prefix: str
    skipped: tuple[str, ...]


MULTIMODAL = {"Gemma3ForConditionalGeneration": Multimodal("Gemma3ForCausalLM", "gemma3_text", "text_config",
                                                           "language_model.", ("vision_tower.", "multi_modal_projector."))}


def multimodal_of(hf: Mapping[str, Any]) -> Multimodal | None:
    names = hf.get("architectures") or []
    return MULTIMODAL.get(names[0]) if names else None


def text_config(hf: Mapping[str, Any]) -> dict:
    """The config.json of the text model `hf` describes: itself, or a multimodal checkpoint's
    text config as its text class's own (what `to-hf` of it writes: the text model alone)."""
    multimodal = multimodal_of(hf)
    if multimodal is None:
        return dict(hf)
    text = dict(hf.get(multimodal.config_key) or {})
    text.update(architectures=[multimodal.text_architecture], model_type=multimodal.text_model_type)
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text
