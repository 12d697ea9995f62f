"""A Mixtral small enough to train on a laptop CPU: tiny_llama with 8 experts, 2 per token.

Each expert is half tiny_llama's MLP, so a token's two experts cost what tiny_llama's MLP does:
the same active FLOPs, four times the feed-forward parameters.
"""

from maxtext_rocm.config import apply_variant, load_preset


def get_config(variant: str = ""):
    cfg = load_preset("tiny_llama")
    cfg.name = "tiny_mixtral"
    cfg.model.update(family="mixtral", mlp_dim=384, n_experts=8, experts_per_token=2)
    return apply_variant(cfg, variant)
