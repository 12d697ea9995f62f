"""Mixtral 8x7B (Mistral AI, 2024): 32 layers, d_model 4096, GQA 32/8 heads, 8 experts, 2 per token.

46.7B parameters, 12.9B active per token. No sliding window (Mixtral dropped Mistral 7B's).
"""

from maxtext_rocm.config import apply_variant, defaults


def get_config(variant: str = ""):
    cfg = defaults()
    cfg.name = "mixtral_8x7b"
    cfg.model.update(
        family="mixtral", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        head_dim=128, mlp_dim=14336, n_experts=8, experts_per_token=2, rope_theta=1e6,
        norm_eps=1e-5, tie_embeddings=False, sliding_window=None, remat="full", loss_chunk_len=1024,
        moe_aux_loss_weight=0.02)  # Hugging Face's router_aux_loss_coef for Mixtral
    cfg.train.update(seq_len=4096, per_device_batch_size=1)
    cfg.optimizer.update(lr=1e-4, warmup_steps=2000)
    return apply_variant(cfg, variant)
