"""gpt-oss-120b (OpenAI, 2025): gpt-oss-20b's layers (configs/gpt_oss_20b.py), 36 of them, with
128 experts each, 4 per token: 116.83B parameters as published; 5.71B active per token as this
code base counts, 5.13B without the embedding table, OpenAI's published 5.1B."""

from maxtext_rocm.config import load_preset


def get_config(variant: str = ""):
    cfg = load_preset(f"gpt_oss_20b:{variant}")
    cfg.name = "gpt_oss_120b"
    cfg.model.update(n_layers=36, n_experts=128)
    return cfg
