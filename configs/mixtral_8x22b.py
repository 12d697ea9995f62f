"""Mixtral 8x22B (Mistral AI, 2024): 56 layers, d_model 6144, GQA 48/8 heads, 8 experts, 2 per token.

140.6B parameters, 39.2B active per token; vocabulary 32768.
"""

from maxtext_rocm.config import apply_variant, load_preset


def get_config(variant: str = ""):
    cfg = load_preset("mixtral_8x7b")
    cfg.name = "mixtral_8x22b"
    cfg.model.update(vocab_size=32768, d_model=6144, n_layers=56, n_heads=48, n_kv_heads=8,
                     head_dim=128, mlp_dim=16384)
    return apply_variant(cfg, variant)
