"""The Qwen2.5, Qwen3, Qwen3-MoE, Mistral, Gemma 3 and gpt-oss presets against transformers' own count of the published
checkpoints' config.json, each model built on torch's meta device (shapes, no memory).

The published values are written out here, from the Hugging Face repositories' config.json, as a
reference apart from the presets: a preset that drifted from its checkpoint fails on its count, and
on any layer option a count cannot see (rope base, epsilon, router renormalisation), through the
config `convert from-hf` would read from the published file.
"""

import json

import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm import count_active_params, count_params
from maxtext_rocm.convert.hf_config import hf_config, model_updates

_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, head_dim=128,
              hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000, rope_scaling=None,
              attention_bias=False, sliding_window=None, use_sliding_window=False, tie_word_embeddings=False,
              max_position_embeddings=40960)
_QWEN3_MOE = dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  router_aux_loss_coef=0.001)
_GPT_OSS = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
                intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                head_dim=64, num_local_experts=32, num_experts_per_tok=4, experts_per_token=4, hidden_act="silu",
                rms_norm_eps=1e-5, rope_theta=150000, rope_scaling={
                    "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                    "rope_type": "yarn", "truncate": False},
                layer_types=["sliding_attention", "full_attention"] * 12, sliding_window=128, attention_bias=True,
                swiglu_limit=7.0, router_aux_loss_coef=0.9, tie_word_embeddings=False,
                max_position_embeddings=131072, initial_context_length=4096)
PUBLISHED = {  # preset -> the checkpoint's config.json (the keys that describe the model)
    "qwen3_8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, max_window_layers=36),
    "qwen3_32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, max_window_layers=64),
    "qwen3_30b_a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          max_window_layers=48),
    "qwen3_235b_a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                            max_window_layers=94),
    "qwen2_5_7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064,
                       hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0,
                       rope_scaling=None, sliding_window=None, use_sliding_window=False,
                       tie_word_embeddings=False, max_position_embeddings=131072, max_window_layers=28),
    "mistral_7b": dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=32768,
                       hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, hidden_act="silu", rms_norm_eps=1e-5,
                       rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False,
                       max_position_embeddings=32768),
    # google/gemma-3-27b-it's text_config, as a Gemma3ForCausalLM reads it
    "gemma3_27b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208,
                       hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                       num_key_value_heads=16, head_dim=128, hidden_activation="gelu_pytorch_tanh",
                       rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                       rope_scaling={"factor": 8.0, "rope_type": "linear"}, query_pre_attn_scalar=168,
                       sliding_window=1024, sliding_window_pattern=6, final_logit_softcapping=None,
                       attn_logit_softcapping=None, tie_word_embeddings=True, max_position_embeddings=131072),
    # openai/gpt-oss-20b's, less its quantization_config (MXFP4 experts; the model is the same)
    "gpt_oss_20b": _GPT_OSS,
    "gpt_oss_120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128,
                         layer_types=["sliding_attention", "full_attention"] * 18),
}
# The published totals and active counts, in Qwen's, Mistral's and OpenAI's rounding, for the
# record; Gemma 3 27B's text model alone (its published 27B counts the vision tower too).
PUBLISHED_BILLIONS = {"qwen3_8b": 8.2, "qwen3_32b": 32.8, "qwen3_30b_a3b": 30.5, "qwen3_235b_a22b": 235,
                      "qwen2_5_7b": 7.61, "mistral_7b": 7.25, "gemma3_27b": 27.0, "gpt_oss_20b": 20.9,
                      "gpt_oss_120b": 116.8}


def meta_model(config):
    """transformers' model of a config (a config.json's contents, or transformers' own config
    object), built on the meta device (no memory). Skips the test where torch or transformers (the
    test extra) is not installed."""
    torch, transformers = pytest.importorskip("torch"), pytest.importorskip("transformers")
    if isinstance(config, dict):
        config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def transformers_counts(model) -> tuple[int, int]:
    """(total, active) parameters of a transformers model; active leaves out the experts each token
    does not choose: (E - k) / E of every expert weight (under `mlp.experts`, whether stored per expert
    or fused as [E, ...] tensors), the router and everything else whole."""
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    experts = sum(p.numel() for name, p in named.items() if ".mlp.experts." in name)
    cfg = model.config
    if not experts:
        return total, total
    n, k = cfg.num_experts, cfg.num_experts_per_tok
    assert experts % n == 0
    return total, total - experts // n * (n - k)


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_counts_equal_transformers_count_of_the_published_config(preset):
    cfg = config_lib.load(preset)
    total, active = transformers_counts(meta_model(PUBLISHED[preset]))
    ours = count_params(cfg), count_active_params(cfg)
    print(f"{preset}: ours {ours[0]:,} ({ours[1]:,} active), transformers {total:,} ({active:,} active)")
    assert ours == (total, active)
    assert total / 1e9 == pytest.approx(PUBLISHED_BILLIONS[preset], rel=0.005)


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_is_what_from_hf_reads_from_the_published_config(preset):
    """Every cfg.model key a published config.json sets (convert/hf_config.py), the preset has alike."""
    model = config_lib.load(preset).model
    expected = model_updates(PUBLISHED[preset], f"{preset}'s published config.json")
    plain = {key: model[key].to_dict() if hasattr(model[key], "to_dict") else model[key] for key in expected}
    assert plain == expected  # a dict-valued key (model.rope_yarn) as the dict it holds


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_exported_config_loads_in_transformers_as_the_family_with_the_same_count(preset, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = config_lib.load(preset)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg.model)))
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert loaded.model_type == PUBLISHED[preset]["model_type"]
    model = meta_model(loaded)
    assert type(model).__name__ == PUBLISHED[preset]["architectures"][0]
    assert transformers_counts(model) == (count_params(cfg), count_active_params(cfg))


def test_active_count_leaves_out_exactly_the_unchosen_experts():
    """The transformers-side active count on a model small enough to write out by hand."""
    config = dict(PUBLISHED["qwen3_30b_a3b"], vocab_size=64, hidden_size=32, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                  num_experts=4, num_experts_per_tok=1)
    total, active = transformers_counts(meta_model(config))
    experts_per_layer = 4 * 3 * 32 * 16
    assert total - active == 2 * experts_per_layer * 3 // 4


def test_an_experts_width_apart_from_the_dense_one_is_exported_as_published():
    """Qwen3-MoE's moe_intermediate_size (model.moe_mlp_dim) beside its intermediate_size
    (model.mlp_dim), neither lost on the way out; a dense family refuses the key in one sentence."""
    cfg = config_lib.load("qwen3_30b_a3b")
    exported = hf_config(cfg.model)
    assert (exported["intermediate_size"], exported["moe_intermediate_size"]) == (6144, 768)
    dense = config_lib.load("qwen3_8b")
    dense.model.moe_mlp_dim = 768
    with pytest.raises(config_lib.ConfigError, match="model.moe_mlp_dim=768 has no effect on model.family='qwen3'"):
        config_lib.validate(dense)
