"""Llama 3.1 405B: 126 layers, d_model 16384, GQA 128/8 heads, MLP 53248, 128K context scaling."""

from maxtext_rocm.config import load_preset


def get_config(variant: str = ""):
    cfg = load_preset(f"llama3_1_8b:{variant}")
    cfg.name = "llama3_1_405b"
    cfg.model.update(d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8, mlp_dim=53248)
    cfg.train.per_device_batch_size = 1
    cfg.optimizer.lr = 8e-5
    return cfg
