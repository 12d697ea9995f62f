"""Llama 3.1 8B: Llama 3 8B with rotary frequencies rescaled for a 128K context."""

from maxtext_rocm.config import load_preset

# Published in Llama 3.1's config.json ("rope_type": "llama3").
LLAMA3_1_ROPE_SCALING = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)


def get_config(variant: str = ""):
    cfg = load_preset(f"llama3_8b:{variant}")
    cfg.name = "llama3_1_8b"
    cfg.model.rope_scaling = dict(LLAMA3_1_ROPE_SCALING)
    return cfg
