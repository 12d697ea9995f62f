"""Llama 3 8B (Meta, 2024): 32 layers, d_model 4096, GQA 32/8 heads, 128K vocabulary, 8K context."""

from maxtext_rocm.config import apply_variant, defaults


def get_config(variant: str = ""):
    cfg = defaults()
    cfg.name = "llama3_8b"
    cfg.model.update(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        mlp_dim=14336, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False, remat="full",
        # 1024 positions x 2 rows: 2K-token chunks keep the head's matmuls large on a GPU while a
        # chunk's fp32 logits (1 GiB at 128K vocab) stay far below the unchunked 8 GiB.
        loss_chunk_len=1024)
    cfg.train.update(seq_len=8192, per_device_batch_size=2)
    cfg.optimizer.update(lr=3e-4, warmup_steps=2000)
    return apply_variant(cfg, variant)
