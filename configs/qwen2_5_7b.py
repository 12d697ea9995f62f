"""Qwen2.5 7B (Alibaba, 2024): 28 layers, d_model 3584, GQA 28/4 heads, q/k/v biases, 152K vocabulary.

7.61B parameters as published; untied embeddings. Qwen2.5 is a Llama decoder with biases on the
query, key and value projections (model.qkv_bias) and no head norms.
"""

from maxtext_rocm.config import apply_variant, defaults


def get_config(variant: str = ""):
    cfg = defaults()
    cfg.name = "qwen2_5_7b"
    cfg.model.update(
        family="qwen2", vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
        head_dim=128, mlp_dim=18944, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=False,
        qk_norm=False, qkv_bias=True, sliding_window=0, remat="full", loss_chunk_len=1024)
    # Llama 3 8B's shape of step and schedule.
    cfg.train.update(seq_len=8192, per_device_batch_size=2)
    cfg.optimizer.update(lr=3e-4, warmup_steps=2000)
    return apply_variant(cfg, variant)
