"""Mistral 7B v0.3 (Mistral AI, 2024): 32 layers, d_model 4096, GQA 32/8 heads, 32768 vocabulary.

7.25B parameters; untied embeddings. v0.3, not v0.1: no sliding window (v0.1 attends 4096
tokens back, with rope base 10000 and 32000 tokens; v0.3 has rope base 1e6 and 32768 tokens).
"""

from maxtext_rocm.config import apply_variant, defaults


def get_config(variant: str = ""):
    cfg = defaults()
    cfg.name = "mistral_7b"
    cfg.model.update(
        family="mistral", vocab_size=32768, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        head_dim=128, mlp_dim=14336, rope_theta=1e6, norm_eps=1e-5, tie_embeddings=False,
        sliding_window=0, remat="full", loss_chunk_len=1024)
    # Llama 3 8B's shape of step and schedule.
    cfg.train.update(seq_len=8192, per_device_batch_size=2)
    cfg.optimizer.update(lr=3e-4, warmup_steps=2000)
    return apply_variant(cfg, variant)
