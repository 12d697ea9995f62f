"""Qwen3 32B: 64 layers, d_model 5120, GQA 64/8 heads of 128, MLP 25600; otherwise as Qwen3 8B.

32.8B parameters as published; untied embeddings (64 x 128 = 8192 query features, wider than
d_model).
"""

from maxtext_rocm.config import load_preset


def get_config(variant: str = ""):
    cfg = load_preset(f"qwen3_8b:{variant}")
    cfg.name = "qwen3_32b"
    cfg.model.update(d_model=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, mlp_dim=25600)
    cfg.train.per_device_batch_size = 1
    cfg.optimizer.lr = 1.5e-4
    return cfg
