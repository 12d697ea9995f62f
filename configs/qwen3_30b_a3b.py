"""Qwen3 30B-A3B (Alibaba, 2025): 48 layers, d_model 2048, GQA 32/4 heads, 128 experts, 8 per token.

30.5B parameters, 3.3B active per token, as published (30.53B and 3.35B counted); untied
embeddings. Every layer is a mixture of experts (no shared expert, no dense layers); each expert's
SwiGLU is 768 wide (Hugging Face's `moe_intermediate_size`: model.moe_mlp_dim; its
`intermediate_size`, 6144, model.mlp_dim, is a dense layer's, which this model has none of). The router's softmax top-8 weights are rescaled to sum to one
(`norm_topk_prob`: model.moe_renormalize).
"""

from maxtext_rocm.config import apply_variant, defaults


def get_config(variant: str = ""):
    cfg = defaults()
    cfg.name = "qwen3_30b_a3b"
    cfg.model.update(
        family="qwen3_moe", vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
        head_dim=128, mlp_dim=6144, moe_mlp_dim=768, n_experts=128, experts_per_token=8, moe_renormalize=True,
        rope_theta=1e6, norm_eps=1e-6, tie_embeddings=False, qk_norm=True, qkv_bias=False,
        sliding_window=0, remat="full", loss_chunk_len=1024,
        moe_aux_loss_weight=0.001)  # Hugging Face's router_aux_loss_coef for Qwen3-MoE
    # Mixtral's shape of step and schedule (Qwen3's report publishes no learning rate).
    cfg.train.update(seq_len=4096, per_device_batch_size=1)
    cfg.optimizer.update(lr=1e-4, warmup_steps=2000)
    return apply_variant(cfg, variant)
