"""Qwen3 8B (Alibaba, 2025): 36 layers, d_model 4096, GQA 32/8 heads, head norms, 152K vocabulary.

8.2B parameters as published (8.19B counted); untied embeddings. Qwen3 is a Llama decoder with an
RMSNorm over each head's queries and keys before rope (model.qk_norm) and no q/k/v biases.
"""

from maxtext_rocm.config import apply_variant, defaults


def get_config(variant: str = ""):
    cfg = defaults()
    cfg.name = "qwen3_8b"
    cfg.model.update(
        family="qwen3", vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8,
        head_dim=128, mlp_dim=12288, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=False,
        qk_norm=True, qkv_bias=False, sliding_window=0, remat="full",
        # As Llama 3 8B's: 2K-token chunks of 152K-vocabulary fp32 logits are 1.2 GiB.
        loss_chunk_len=1024)
    # Llama 3 8B's shape of step and schedule (Qwen3's report publishes no learning rate).
    cfg.train.update(seq_len=8192, per_device_batch_size=2)
    cfg.optimizer.update(lr=3e-4, warmup_steps=2000)
    return apply_variant(cfg, variant)
