"""gpt-oss-20b (OpenAI, 2025): 24 layers, d_model 2880, GQA 64/8 heads of 64, 32 experts, 4 per token.

20.91B parameters as published; 4.19B active per token as this code base counts (embedding and
LM head whole), 3.61B without the embedding table, OpenAI's published 3.6B. Untied embeddings, a
201,088-token vocabulary. Every layer is a mixture of experts whose SwiGLU is clamped
(model.mlp_activation="clamped_silu"), 2880 wide, with biases on the router and every expert
projection, routed by a softmax over the top four logits. Attention has biases on q, k, v and the
output, a learned sink logit per head, and alternates a 128-token sliding window with full
attention (model.attention_kinds); rope base 150,000 with YaRN scaling x32 over a 4,096-token
original context. The published experts are MXFP4; `convert from-hf` dequantizes them.
"""

from maxtext_rocm.config import apply_variant, defaults

# The published rope_scaling (YaRN: truncate false, attention factor 0.1 ln 32 + 1).
YARN = {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position": 4096, "truncate": False,
        "attention_factor": None}


def get_config(variant: str = ""):
    cfg = defaults()
    cfg.name = "gpt_oss_20b"
    cfg.model.update(
        family="gpt_oss", vocab_size=201088, d_model=2880, n_layers=24, n_heads=64, n_kv_heads=8,
        head_dim=64, mlp_dim=2880, n_experts=32, experts_per_token=4, norm_eps=1e-5, tie_embeddings=False,
        attention_kinds=("sliding", "full"), sliding_window=128, rope_theta=150000.0, rope_yarn=dict(YARN),
        qkv_bias=True, out_bias=True, attention_sinks=True, moe_bias=True, moe_router="topk_softmax",
        mlp_activation="clamped_silu", qk_norm=False, remat="full",
        # 2K-token chunks of 201K-vocabulary fp32 logits would be 1.5 GiB: a quarter of that.
        loss_chunk_len=512,
        moe_aux_loss_weight=0.9)  # Hugging Face's router_aux_loss_coef as published
    # Mixtral's shape of step and schedule (OpenAI's model card publishes no learning rate).
    cfg.train.update(seq_len=4096, per_device_batch_size=1)
    cfg.optimizer.update(lr=1e-4, warmup_steps=2000)
    return apply_variant(cfg, variant)
