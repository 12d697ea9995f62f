"""Qwen3 235B-A22B: 94 layers, d_model 4096, GQA 64/4 heads, 128 experts of 1536, 8 per token
(a dense layer's 12,288, which it has none of).

235B parameters, 22B active per token, as published (235.09B and 22.19B counted); otherwise as
Qwen3 30B-A3B.
"""

from maxtext_rocm.config import load_preset


def get_config(variant: str = ""):
    cfg = load_preset(f"qwen3_30b_a3b:{variant}")
    cfg.name = "qwen3_235b_a22b"
    cfg.model.update(d_model=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, mlp_dim=12288,
                     moe_mlp_dim=1536)
    return cfg
