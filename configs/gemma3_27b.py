"""Gemma 3 27B (Google, 2025), its text model: 62 layers, d_model 5376, GQA 32/16 heads of 128,
GeGLU MLP 21504, a 262K vocabulary.

Layers come in units of five sliding-window layers (1024 tokens, rope base 10,000) and one full
layer (rope base 1,000,000, linearly scaled by 8); 62 = 10 units of six and two sliding layers
after them (model.attention_kinds), one scan of 62 layers, each handed its index. Gemma's
other departures from Llama are layer options: an RMSNorm over each head's queries and keys, norms
after attention and the MLP as well as before, norm scales applied as 1 + w, the embedding scaled
by sqrt(d_model), scores scaled by 168 ** -0.5. 27.0B parameters in the text model (the published
27B counts the vision tower too, which is not imported); tied embeddings.
"""

from maxtext_rocm.config import apply_variant, defaults


def get_config(variant: str = ""):
    cfg = defaults()
    cfg.name = "gemma3_27b"
    cfg.model.update(
        family="gemma3", vocab_size=262208, d_model=5376, n_layers=62, n_heads=32, n_kv_heads=16,
        head_dim=128, mlp_dim=21504, norm_eps=1e-6, tie_embeddings=True,
        attention_kinds=("sliding",) * 5 + ("full",), sliding_window=1024,
        rope_theta=1e6, rope_linear_factor=8.0, rope_local_theta=1e4, query_pre_attn_scalar=168.0,
        qk_norm=True, qkv_bias=False, norm_unit_offset=True, post_norms=True, scale_embeddings=True,
        mlp_activation="gelu_tanh", remat="full",
        # 2K-token chunks of 262K-vocabulary fp32 logits would be 2 GiB: half that.
        loss_chunk_len=512)
    # Llama 3 70B's shape of step and schedule (Gemma 3's report publishes no learning rate).
    cfg.train.update(seq_len=8192, per_device_batch_size=1)
    cfg.optimizer.update(lr=1.5e-4, warmup_steps=2000)
    return apply_variant(cfg, variant)
