"""Llama 3 70B: 80 layers, d_model 8192, GQA 64/8 heads, MLP 28672; otherwise as Llama 3 8B."""

from maxtext_rocm.config import load_preset


def get_config(variant: str = ""):
    cfg = load_preset(f"llama3_8b:{variant}")
    cfg.name = "llama3_70b"
    cfg.model.update(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, mlp_dim=28672)
    cfg.train.per_device_batch_size = 1
    cfg.optimizer.lr = 1.5e-4
    return cfg
