"""Llama 3.1 70B: Llama 3 70B dimensions with Llama 3.1's rotary scaling."""

from maxtext_rocm.config import load_preset


def get_config(variant: str = ""):
    cfg = load_preset(f"llama3_70b:{variant}")
    cfg.name = "llama3_1_70b"
    cfg.model.rope_scaling = dict(load_preset("llama3_1_8b").model.rope_scaling)
    return cfg
